"""The rows a target pass carries: a sequence's window, and a pass of windows."""

from __future__ import annotations

from dataclasses import dataclass

from speculators.sampling import SamplingSettings
from stages.tree_shape import main_chain_length


@dataclass(frozen=True)
class Window:
    """One sequence's rows in a target pass: inputs[i] at absolute position first + i
    (for a tree, first + refed + the row's depth).

    A decoding window's inputs are the last committed token (or, started ahead,
    a speculated one) and then drafts; every row's logits are verified. A
    prompt window is a chunk of the prompt: only its last row's logits are
    wanted, and only the prompt's last chunk is verified (it gives the first token).
    With ``sampling`` the target itself verifies the rows (speculators.verify,
    beside its last stage) and returns the committed tokens instead of logits.
    refed: committed tokens before the last one, fed again first (their cells
    were dropped after a side branch was accepted); their rows are not verified.
    parents: the verified rows (inputs[refed:]) form a token tree in preorder
    (speculators.tree; their parents, row 0 the last committed token); None: a chain.
    logprobs: None, or the committed tokens' log-probabilities are wanted,
    with this many likeliest alternatives each (speculators.logprobs).
    grammar: None, or its tokens are chosen under this grammar
    (speculators.grammar), after ``generated``: the sequence's tokens after
    its prompt up to and including row 0's input.
    filler: its last ``filler`` drafts are no drafter's but padding (the last
    token repeated), so that it is as wide as the windows it shares a pass
    with (Scheduler.shared_drafts); verified like any row, so a filler the
    target happens to choose is committed, but not counted as a draft nor
    shown to the draft policy.
    """

    sequence: int
    first: int
    inputs: tuple[int, ...]
    prompt: bool = False
    sampling: SamplingSettings | None = None  # set: the target chooses the tokens (the sequence's)
    refed: int = 0
    parents: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None  # a tree's rows' ranks among their siblings (speculators.tree.DraftTree)
    logprobs: int | None = None
    grammar: str | None = None
    generated: tuple[int, ...] | None = None
    filler: int = 0

    @property
    def drafts(self) -> tuple[int, ...]:
        return () if self.prompt else self.inputs[self.refed + 1:]

    @property
    def logit_rows(self) -> tuple[int, ...]:
        """Rows of this window whose logits the pass returns."""
        return (len(self.inputs) - 1,) if self.prompt else tuple(range(self.refed, len(self.inputs)))

    @property
    def batch_parents(self) -> tuple[int, ...] | None:
        """Parents of every input row (the refed rows a chain before the tree), or None for a chain."""
        if self.parents is None:
            return None
        return (*range(-1, self.refed - 1), self.refed - 1, *(parent + self.refed for parent in self.parents[1:]))

    @property
    def main_rows(self) -> int:
        """Input rows on the main chain (all of a chain's): the stages keep their cells."""
        return len(self.inputs) if self.parents is None else self.refed + main_chain_length(self.parents)

    @property
    def main_drafts(self) -> tuple[int, ...]:
        """The main chain's drafts, filler left out."""
        return self.drafts[: self.main_rows - self.refed - 1 - self.filler]


@dataclass(frozen=True)
class TargetPass:
    """One pass through every stage: the windows of one or more sequences, in row order.
    Every stage first drops each window's sequence's cached positions from its ``first`` on."""

    windows: tuple[Window, ...]

    @property
    def tokens(self) -> int:
        return sum(len(window.inputs) for window in self.windows)
