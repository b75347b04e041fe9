"""A sequence's speculation, as one record with one owner (its SequenceState):
the draft tokens not yet verified and what was drafted beside them.

``tokens`` is the chain the next windows feed; ``candidates`` a token tree's
other rows for the next window (speculators.tree.choose_rows picks those
that pay); ``corrections`` what a draft model drafted, while the head window
was verified, after the likely rejections of its drafts
(speculators.corrections); ``ranks`` how often the target took a
candidate of each rank where it declined the first. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculators.corrections import Corrections
from speculators.tree import DraftTree, RankAcceptance


@dataclass
class Speculation:
    """tokens: draft tokens after the committed text, not yet verified;
    candidates: the tree drafted for the next window (its main chain is
    ``tokens``), until that window is made; corrections: by (position, the
    target's token there), a draft model's continuation after it, drafted
    while the head window was verified; ranks: acceptance by candidate rank
    at a tree's forks (it outlives every window)."""

    tokens: list[int] = field(default_factory=list)
    candidates: DraftTree | None = None
    corrections: Corrections = field(default_factory=dict)
    ranks: RankAcceptance = field(default_factory=RankAcceptance)

    def awaited(self, tokens: list[int], candidates: DraftTree | None = None) -> None:
        """What the drafter beside stage 0 drafted while the loop waited: the
        whole speculation, and a tree's candidates for the next window (None: a chain)."""
        self.tokens = list(tokens)
        self.candidates = candidates

    def extend(self, tokens: list[int], corrections: Corrections | None) -> None:
        """Tokens a drafter added to its end while a pass ran, and the
        corrections it drafted at the head window's positions (these replace the
        last; None: it drafted none this time, the last stay)."""
        self.tokens.extend(tokens)
        if corrections is not None:
            self.corrections = dict(corrections)

    def take_candidates(self) -> DraftTree | None:
        """The tree's candidates for the window being made (they serve it only)."""
        candidates, self.candidates = self.candidates, None
        return candidates

    def committed(self, tokens: list[int], position: int, last: int | None) -> bool:
        """The target committed ``tokens``, the last of them ``last`` at
        ``position`` (None: the sequence finished, nothing follows): the
        speculation keeps what still extends the committed text; where it
        went wrong, a correction drafted at that position for that token
        becomes it. Returns whether such a correction (with drafts after its
        token) was taken. The corrections served this verification only."""
        corrections, self.corrections = self.corrections, {}
        if self.tokens[: len(tokens)] == tokens:
            del self.tokens[: len(tokens)]
            return False
        correction = [] if last is None else corrections.get((position, last), [])
        self.tokens = correction[1:]
        return len(correction) > 1  # it holds drafts after the target's token
