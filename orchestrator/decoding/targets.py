"""What the decoding loop (orchestrator.decoding.loop) assumes of a target and of a drafter.

The loop never knows who computes or who drafts: a ``Pipeline`` of Ray
actors, or a stand-in (``InstantTarget`` below; tests/fakes.py has more); drafter
actors, or a speculator called in this process (``InstantDrafter`` below).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from orchestrator.config import chain_reach
from orchestrator.transport.messages import Cancelled, PassResult, TokenChoice
from orchestrator.decoding.windows import TargetPass, Window
from speculators.logprobs import TokenLogprobs, window_logprobs
from speculators.sampling import SamplingSettings
from speculators.tree import DraftTree, TreeAsk, lookup_tree, verify_rows
from stages.errors import SpecpipeError
from stages.tree_shape import depths


class TargetWaiting(SpecpipeError):
    """The target lost a part it cannot replace yet (a stage whose machine is
    gone, and no machine with room for it): what it held is lost, and
    ``Target.resume`` brings it back, holding nothing, once it can. The
    message names what was lost."""


class Target(Protocol):
    """The target model, split in stages or not."""

    n_batch: int  # the most tokens one pass carries
    stage_count: int  # passes in flight at once keep this many stages busy (a prompt's chunks pipeline)

    def submit(self, target_pass: TargetPass) -> None:
        """Start a pass; results come back in submission order through receive().
        A pass may be submitted while others are in flight."""

    def cancel(self, target_pass: TargetPass) -> None:
        """A pass in flight is no longer wanted (Scheduler.invalid_passes): the
        target may stop computing it. Its receive() still comes, in order."""

    def result_within(self, seconds: float) -> bool:
        """Whether the oldest pass's result is in within ``seconds`` (waiting
        that long at most); a target that computes a pass when it is submitted
        says True at once."""

    def receive(self) -> PassResult | Cancelled:
        """The oldest pass's result: the tokens its window commits, chosen
        beside the target's last stage (a window with ``sampling``), or its
        logits float32[rows, n_vocab], the windows' logit rows in order
        (committed_tokens verifies those here); for a cancelled pass, maybe
        a ``Cancelled`` instead (only its stage_seconds are read)."""

    def release(self, sequence: int) -> None:
        """Free a KV sequence in every stage, after the passes submitted before."""

    def copy(self, source: int, destination: int, length: int) -> None:
        """Make KV sequence ``destination`` hold the first ``length`` positions of
        ``source`` in every stage (a shared prefix), after the passes submitted before."""

    def resume(self) -> bool:
        """After a TargetWaiting (only a target that raises it is asked): run
        again if the lost part can be replaced now, holding no sequence; False
        while it cannot."""


@dataclass(frozen=True)
class PassReplies:
    """What a batched pass (several sequences' windows, one each) gives back:
    each window's result, in the pass's order (a PassResult, or for a
    cancelled pass maybe a Cancelled). stage_seconds, stage_started: the
    first's (the windows shared every stage's computation)."""

    replies: tuple[PassResult | Cancelled, ...]
    sequences: tuple[int, ...]

    @property
    def stage_seconds(self) -> tuple[float, ...]:
        return self.replies[0].stage_seconds

    @property
    def stage_started(self) -> tuple[float, ...]:
        return self.replies[0].stage_started

    def of(self, sequence: int) -> PassResult | Cancelled:
        return self.replies[self.sequences.index(sequence)]


def choice_of(window: Window) -> TokenChoice | None:
    """What the target's last stage needs to choose a window's tokens beside it
    (messages.TokenChoice), or None: the window has no sampling, its logits come back."""
    if window.sampling is None:
        return None
    return TokenChoice(
        np.asarray(window.drafts, np.int32), window.first + window.logit_rows[0] + 1, window.sampling,
        None if window.parents is None else np.asarray(window.parents, np.int32),
        -1 if window.logprobs is None else window.logprobs, window.grammar,
        None if window.generated is None else np.asarray(window.generated, np.int32))


def committed_tokens(reply: PassResult | PassReplies, window: Window, rows: slice) -> list[int]:
    """What a verified window commits: the tokens the target chose, or, from
    a target that returns logits (the stand-ins), those its rows verify to
    under the window's sampling. From a batched pass's replies, its own."""
    if isinstance(reply, PassReplies):
        reply, rows = reply.of(window.sequence), slice(0, len(window.logit_rows))
    if reply.tokens is not None:
        return reply.tokens.tolist()
    return verify_rows(window.drafts, window.parents, reply.logits[rows], window.first + window.logit_rows[0] + 1,
                       window.sampling)


def committed_logprobs(reply: PassResult | PassReplies, window: Window, rows: slice,
                       tokens: list[int]) -> TokenLogprobs:
    """The logprobs of what a verified window commits (``tokens``, all it chose
    or fewer): those the target sent with its tokens, or, from a target that
    returns logits, computed here from the rows that chose them."""
    if isinstance(reply, PassReplies):
        reply, rows = reply.of(window.sequence), slice(0, len(window.logit_rows))
    if reply.logprobs is not None:
        return reply.logprobs.first(len(tokens))
    return window_logprobs(reply.logits[rows], window.drafts, window.parents, tokens, window.logprobs or 0)


class Drafter(Protocol):
    """The drafter beside one stage: drafts in the background, best effort, never raises."""

    def speculate(self, context: list[int], most: int | None = None, sampling: SamplingSettings | None = None,
                  tree: TreeAsk | None = None) -> None:
        """Go on drafting after ``context`` (committed text + speculation) from
        now on, by at most ``most`` tokens (None: as many as it may);
        sampling: coupled drafting, the draft sampling with the target's
        seeded uniforms (speculators.model_tree; None: its top choices);
        tree: grow a token tree (collect_tree), not a chain. A drafter that
        drafts corrections (Drafting.corrects: the drafter actors of
        orchestrator.cluster.drafters) also takes ``forks`` (a
        speculators.corrections.Forks: draft them at those context positions,
        within the rounds the pass lasts), and has
        ``corrections()``, those its last reply brought."""

    def collect(self, wait: bool = False) -> list[int]:
        """The tokens drafted since the last speculate ([] if none); with ``wait``,
        first let the drafting stop by itself."""

    def collect_tree(self, leaves: int) -> DraftTree:
        """The token tree drafted since a speculate asked for one (waiting for
        it), of at most ``leaves`` leaves; a chain where it drafts none."""

    def ask(self) -> None:
        """Ask now for what a collect() (without wait) will return, and stop
        drafting there: a drafter behind a socket sends the question, and the
        collect only reads the answer, so asking several drafters costs one
        round trip, not one each. Nothing for a drafter in this process."""

    def peek(self) -> list[int]:
        """What a collect() would return now, the drafting going on: the next
        collect returns these tokens and those drafted after them (a branch
        window takes what the drafter has when stage 0 is done)."""


class InstantTarget:
    """A target that answers every pass at once: timing the loop against it
    leaves the coordinator's own time (``orchestrate profile``); tests give it
    the text to predict. Row r of a window at position p predicts the token at
    p + r + 1: ``next_token(sequence, position)``, or token 0 when not given."""

    n_batch = 512

    def __init__(self, vocab: int, next_token: Callable[[int, int], int] | None = None, stage_count: int = 1):
        self.vocab = vocab
        self.next_token = next_token
        self.stage_count = stage_count
        self.pending: deque[np.ndarray] = deque()
        self.submitted: list[TargetPass] = []
        self.released: list[int] = []
        self.copied: list[tuple[int, int, int]] = []

    def submit(self, target_pass: TargetPass) -> None:
        self.submitted.append(target_pass)
        rows = [(window.sequence, window.first + row_depths[row] + 1) for window in target_pass.windows
                for row_depths in [_row_depths(window)] for row in window.logit_rows]
        logits = np.zeros((len(rows), self.vocab), dtype=np.float32)
        if self.next_token is not None:
            for row, (sequence, position) in enumerate(rows):
                logits[row, self.next_token(sequence, position)] = 1.0
        self.pending.append(logits)

    def cancel(self, target_pass: TargetPass) -> None:
        """Nothing to stop: every pass was answered when submitted."""

    def result_within(self, seconds: float) -> bool:
        return True

    def receive(self) -> PassResult:
        return PassResult(0, self.pending.popleft(), (0.0,) * self.stage_count)

    def release(self, sequence: int) -> None:
        self.released.append(sequence)

    def copy(self, source: int, destination: int, length: int) -> None:
        self.copied.append((source, destination, length))


def _row_depths(window: Window) -> list[int]:
    """Each input row's distance from the window's first (its depth in a tree)."""
    parents = window.batch_parents
    return list(range(len(window.inputs))) if parents is None else depths(parents).tolist()


class InPlaceDrafter:
    """A drafter that drafts at collect, in this process, as if it had drafted
    all along: up to ``most`` tokens of the request (None: draft_max), never
    more than chain_reach(draft_max) (two windows' worth)."""

    draft_max: int
    context: list[int] | None = None
    most: int | None = None

    def speculate(self, context: list[int], most: int | None = None, sampling: SamplingSettings | None = None,
                  tree: TreeAsk | None = None) -> None:
        self.context, self.most = list(context), most

    def ask(self) -> None:
        pass

    def collect(self, wait: bool = False) -> list[int]:
        drafted = self.peek()
        self.context = None
        return drafted

    def peek(self) -> list[int]:
        if self.context is None:
            return []
        return self.draft(self.context, min(chain_reach(self.draft_max), self.most or self.draft_max))

    def draft(self, context: list[int], limit: int) -> list[int]:
        """At most ``limit`` tokens extending ``context``."""
        raise NotImplementedError


class InstantDrafter(InPlaceDrafter):
    """A speculator called in this process: up to chain_reach(draft_max) tokens, or until it
    stops by itself. Prompt lookup costs microseconds a token, so the service
    drafts with it in the coordinator, one per request."""

    def __init__(self, speculator, draft_max: int):
        self.speculator = speculator
        self.draft_max = draft_max

    def collect_tree(self, leaves: int) -> DraftTree:
        """What collect would draft, as a token tree of at most ``leaves``
        leaves (speculators.tree.lookup_tree: the other matches' continuations
        as side branches, at most as many rows as the chain)."""
        context, self.context = self.context, None
        if context is None:
            return DraftTree([0], [-1], [0])
        limit = min(self.draft_max, self.most or self.draft_max)
        return lookup_tree(self.speculator, context, limit, budget=2 * limit, branches=leaves - 1)

    def draft(self, context: list[int], limit: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < limit:
            token = self.speculator.extend(context + tokens)
            if token is None:
                break
            tokens.append(token)
        return tokens
