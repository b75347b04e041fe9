"""The decoding schedule: which windows the target runs, as pure decisions
(one sequence's here, SequenceState, whose windows are made in
window_making.py; many in flight: orchestrator.decoding.scheduler).

The real decoding loop (orchestrator.decoding.loop) and the planner's
simulation (orchestrator.planning.simulation) both follow these rules; they
differ only in what a pass and a draft cost. No I/O here. Terms (README,
"Glossary"): a sequence's *text* is its committed tokens and then its
*speculation* (drafts not yet verified); a *window* is the part of one
sequence a pass feeds; a *pass* carries the windows of one or more sequences.
docs/architecture.md ("Speculation") tells each rule at length:

* A first window (``first_window``) feeds the last committed token and the
  first ``draft_limit`` tokens of the speculation (the draft policy's
  choice, speculators.draft_length; with batching, one number of drafts for
  the chains that share a pass: Scheduler.shared_drafts).
* The loop waits for the drafter beside stage 0 before a pass
  (``drafts_first``) in sync always, in async only with nothing speculated.
  In async one drafter drafts while a pass runs (Scheduler.drafter_of), a
  draft model's also *corrections* at the head window's drafts (``forks``;
  speculators.corrections): after a rejection whose target token is one of
  them, its continuation is the speculation at once.
* A window started ahead (``window_ahead``, async, PipeInfer's idea) goes
  with the window it follows after a window that accepted all its drafts,
  assuming the one in flight commits them all. Where passes are flat and
  the draft fast (``branching``), *branch windows* replace it
  (orchestrator.decoding.branches: rooted at the committed text, up to one
  a stage in flight, kept across the rejections their rows cover).
* A window in flight is invalid when the committed text has left it, or the
  sequence finished (``verified``); its pass is cancelled once all its
  windows are (Scheduler.invalid_passes, PipeInfer's early cancellation).
  Without branch windows the sequence then waits for its result, its
  drafter beside stage 0 drafting meanwhile (``drafts_early``).
* A token tree (``drafted_tree``, ``tree_leaves`` > 1) has the policy's
  chain as its main chain and the side rows that pay (speculators.tree.
  choose_rows); the stages keep only the main chain's cells, so a window
  after a side branch was taken feeds it again (``refeed``; branch windows:
  from where the stages' cells leave the committed text, ``fed``).
* A prompt is prefilled in chunks that flow through the stages back to back
  (``prompt_chunk``, ``windows_ahead``), up to one in flight a stage: with S
  stages and k chunks the pipeline idles (S - 1) / (k + S - 1) of the
  prefill; chunks of a quarter of a stage's share keep that under a fifth,
  down to PREFILL_LEAST_CHUNK tokens.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.config import (BRANCHES_AHEAD_STEP, BRANCHES_DRAFT_PRICE, PREFILL_CHUNKS_PER_STAGE,
                                 PREFILL_LEAST_CHUNK, WINDOWS_DRAFTED_AHEAD)
from orchestrator.decoding.branches import fed_agreement, reaches
from orchestrator.decoding.speculation import Speculation
from orchestrator.decoding.stats import SpeculationStats
from orchestrator.decoding.window_making import WindowMaking
from orchestrator.decoding.windows import Window
from speculators.corrections import Corrections
from speculators.draft_length import DRAFTER_CALL_COST, PRIOR_STEP, DraftPolicy, DraftPrices
from speculators.sampling import SamplingSettings
from speculators.tree import DraftTree, accepted_rows
from stages.cost_curve import BatchCurve
from stages.tree_shape import main_chain_length


class Schedule(enum.Enum):
    """How a generation drafts: ``plain`` (no drafts), ``sync`` (draft, then
    verify) or ``async`` (draft on machines while their stage is idle, and
    start windows ahead)."""

    PLAIN = "plain"
    SYNC = "sync"
    ASYNC = "async"

    @property
    def speculative(self) -> bool:
        return self is not Schedule.PLAIN

    @property
    def asynchronous(self) -> bool:
        """Drafting goes on while a pass runs, and windows start ahead."""
        return self is Schedule.ASYNC




def prompt_chunk(prompt_length: int, stage_count: int, n_batch: int) -> int:
    """The most tokens of one prompt chunk: n_batch for one stage (nothing
    overlaps); through S stages, about a (4 S)-th of the prompt, so its chunks
    pipeline (module docstring), within [PREFILL_LEAST_CHUNK, n_batch]."""
    if stage_count <= 1:
        return n_batch
    share = -(-prompt_length // (PREFILL_CHUNKS_PER_STAGE * stage_count))
    return max(1, min(n_batch, max(share, PREFILL_LEAST_CHUNK)))



@dataclass
class SequenceState(WindowMaking):
    """One sequence being decoded: its text, its windows in flight, its draft
    length, and how a verified window changes them; the windows it sends
    next are made by its part WindowMaking (window_making.py).

    committed: the prompt and the tokens generated so far (prompt_length of them the prompt).
    prompt_from: the position of the prompt's next chunk, until the last is
    submitted (None from the start for a sequence that begins after its
    prompt's pass); prompt_chunk: the most tokens of a chunk (0: no limit);
    prompt_depth: the most chunks in flight at once (one per stage: they pipeline).
    sampling: how its tokens are chosen, given to its windows (Window.sampling)
    for the target to choose them; None: the target returns logits.
    logprobs, grammar: given to its windows (Window.logprobs, Window.grammar).
    cached: its leading committed tokens whose KV every stage holds and no
    pass in flight changes (windows ahead and discarded ones begin after
    them): what another sequence may copy (orchestrator.decoding.prefix_cache).
    A sequence that begins with a copied prefix starts with it and prompt_from there.
    """

    sequence: int
    committed: list[int]
    prompt_length: int
    max_tokens: int
    schedule: Schedule = Schedule.PLAIN
    draft_max: int = 1
    prompt_from: int | None = None
    prompt_chunk: int = 0
    prompt_depth: int = 1
    sampling: SamplingSettings | None = None
    logprobs: int | None = None
    grammar: str | None = None
    cached: int = 0
    speculation: Speculation = field(default_factory=Speculation)  # draft tokens not yet verified, and beside them
    in_flight: deque[Window] = field(default_factory=deque)
    discards_pending: int = 0  # windows found invalid in flight, whose results are still to come
    draft_limit: int = 0  # the next window's most drafts: the policy's choice after every verified window
    awaited_limit: int = 0  # async: ... when nothing is speculated and the loop waits for the drafts
    policy: DraftPolicy | None = None  # speculators.draft_length; made from draft_max and the costs below
    draft_call_cost: float = DRAFTER_CALL_COST  # asking the drafter, in one-token passes (0: in process)
    draft_step: float = PRIOR_STEP  # each extra token of a pass, in one-token passes (measured by a run)
    draft_prices: DraftPrices = DraftPrices()  # what drafting a token costs, awaited and relayed (measured by a run)
    accepted_whole: bool = False  # the last verified window accepted all its drafts
    tree_leaves: int = 1  # the most leaves a window's token tree may have (1: chains only)
    side_row_step: float | None = None  # what the tree rule prices a side row at (None: the curve, or draft_step)
    pass_curve: BatchCurve | None = None  # a pass's seconds by width, measured (the tree rule reads it at every width)
    coupled: bool = True  # when sampling, the drafters sample with the target's seeded uniforms (draft_sampling)
    branches: bool = False  # async: windows kept across rejections where passes are flat (branching)
    stages: int = 1  # the target's stages: a branching sequence keeps up to this many windows in flight
    refeed: int = 0  # committed tokens before the last whose cells the stages dropped: fed again next
    finished: bool = False
    stopped_by: str = "length"
    passes: int = 0  # passes that carried a window of it after the prompt (discarded ones too)
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    def __post_init__(self):
        if self.draft_max < 1:
            raise ValueError("draft_max must be at least 1")
        if self.tree_leaves < 1:
            raise ValueError("tree_leaves must be at least 1")
        self.policy = self.policy or DraftPolicy(self.draft_max, step=self.draft_step, call_cost=self.draft_call_cost,
                                                 prices=self.draft_prices)
        if not self.draft_limit:
            self._choose_limits()
        self.awaited_limit = self.awaited_limit or self.draft_limit
        # what the stages' cells hold after the windows submitted so far (branches.fed_agreement)
        self.fed: list[int] = list(self.committed[:self.cached if self.prompt_from is not None else -1])

    @property
    def branching(self) -> bool:
        """Its windows are branch windows (orchestrator.decoding.branches):
        async, where a pass's extra token costs at most BRANCHES_AHEAD_STEP of
        a one-token pass (the rows of the windows in flight verified again cost
        little) and a draft token at most BRANCHES_DRAFT_PRICE (the drafter,
        not the pipeline, limits a slower draft's tokens), without logprobs
        (they are given for a window's own tokens)."""
        return (self.branches and self.schedule.asynchronous and self.logprobs is None
                and self.policy.step <= BRANCHES_AHEAD_STEP and self.draft_prices.awaited <= BRANCHES_DRAFT_PRICE)

    def _choose_limits(self) -> None:
        """The policy's draft lengths for the next window: sync waits for
        every draft; async drafts while passes run (draft_limit) and waits only
        when nothing is speculated, at the start and after a rejection (awaited_limit)."""
        self.awaited_limit = self.policy.limit(awaited=True)
        self.draft_limit = self.policy.limit(awaited=False) if self.schedule.asynchronous else self.awaited_limit

    @property
    def text(self) -> list[int]:
        return self.committed + self.speculation.tokens

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_length

    @property
    def room(self) -> int:
        """Drafts a window may still carry: it commits up to drafts + 1 tokens."""
        return self.max_tokens - self.generated - 1

    @property
    def speculation_room(self) -> int:
        """Tokens a drafter may still add to the speculation (the speculation
        budget): no further than the tokens the sequence may still produce
        (its last token is always the target's own), nor than the next
        WINDOWS_DRAFTED_AHEAD windows can take: the windows in flight feed the text up to some
        position, and when the oldest comes back the next window and one
        started ahead of it are submitted at once, each one token and at most
        the draft policy's draft_limit drafts (the policy's choice now; it
        grows by evidence, a window at a time). Drafting further is never
        verified before the drafters are asked again, and where drafters share
        cores with the stages it would slow them for nothing."""
        fed = max((window.first + window.main_rows for window in self.in_flight if not window.prompt),
                  default=len(self.committed) - 1)
        usable = min(fed + WINDOWS_DRAFTED_AHEAD * (1 + self.draft_limit), self.prompt_length + self.max_tokens - 1)
        return max(0, usable - len(self.text))

    @property
    def drafts_wanted(self) -> int:
        """Drafts its next window may carry: the policy's limit, within the room
        left; awaited drafts (nothing speculated, or sync) priced with their wait."""
        limit = self.awaited_limit if self.schedule.asynchronous and not self.speculation.tokens else self.draft_limit
        return max(0, min(limit, self.room))

    @property
    def prefilling(self) -> bool:
        """Its prompt is not all cached yet, and will be (it goes on)."""
        return not self.finished and self.cached < self.prompt_length

    @property
    def ready(self) -> bool:
        """Nothing of it in flight or awaited: its next window may be submitted."""
        return not self.finished and not self.in_flight and (not self.discards_pending or self.branching)

    @property
    def drafts_first(self) -> bool:
        """Before its next window, the drafter beside stage 0 drafts from the
        committed text until it stops by itself, and the loop waits for it."""
        return self.ready and self._drafts_from_committed

    @property
    def drafts_early(self) -> bool:
        """It waits only for the results of windows a rejection made invalid,
        and will then wait for drafts from the committed text (drafts_first):
        the committed text is known, so that drafting may start now, while
        the discarded passes come back."""
        return (not self.finished and not self.in_flight and self.discards_pending > 0 and not self.branching
                and self._drafts_from_committed)

    @property
    def _drafts_from_committed(self) -> bool:
        return (self.prompt_from is None and self.schedule.speculative and self.drafts_wanted > 0
                and (self.schedule is Schedule.SYNC or not self.speculation.tokens))

    def drafted_first(self, tokens: list[int], candidates: DraftTree | None = None) -> None:
        """What the drafter beside stage 0 drafted when awaited (``drafts_first``)."""
        self.policy.observe_ask(bool(tokens))
        self.stats.awaited(len(tokens), self.draft_max)
        self.speculation.awaited(tokens, candidates)

    def drafted_tree(self, tree: DraftTree) -> None:
        """What the drafter beside stage 0 drafted when awaited, as a tree:
        its main chain is the speculation, its side rows candidates for the next window."""
        self.drafted_first(tree.drafts[: main_chain_length(tree.parents) - 1], None if tree.is_chain else tree)

    def drafted(self, tokens: list[int], corrections: Corrections | None = None) -> None:
        """Tokens a drafter added to the end of the speculation while a pass
        ran, and the corrections it drafted at the head window's positions
        (``forks``; speculators.corrections)."""
        self.stats.collected_tokens += len(tokens)
        self.speculation.extend(tokens, corrections)

    def gives_token(self, window: Window) -> bool:
        """Its logits are verified: a decoding window, or the prompt's last chunk
        (an earlier chunk only fills the cache)."""
        return not window.prompt or window.first + len(window.inputs) >= self.prompt_length

    def cancel(self) -> None:
        """Stop now (the client went away, or a stop string matched): the windows
        in flight become discards; nothing more is submitted."""
        if not self.finished:
            self.finished, self.stopped_by = True, "cancelled"
        self.discards_pending += len(self.in_flight)
        self.in_flight.clear()

    @property
    def settled(self) -> bool:
        """Finished, with no result of it still to come: its KV may be freed."""
        return self.finished and not self.in_flight and not self.discards_pending

    def is_head(self, window: Window) -> bool:
        """The window is its oldest valid one in flight (the next to verify)."""
        return bool(self.in_flight) and self.in_flight[0] is window

    def verified(self, window: Window, new_tokens: list[int], is_end: Callable[[int], bool]) -> list[int]:
        """The head window's verification gave new_tokens (accepted drafts, then
        the target's own token; a branch window's from its root, so first those
        already committed, which must match). Commits the rest up to an end
        token or max_tokens, keeps the speculation that still extends the
        committed text, and drops the windows in flight that became invalid.
        Returns the tokens committed."""
        self.in_flight.popleft()
        if window.prompt:
            self.cached = window.first + len(window.inputs)
        if not self.gives_token(window):  # a prompt chunk before the last: it only filled the cache
            return []
        kept, known = None, 0  # kept: positions the stages keep after a decoding window (main chain's accepted end)
        if not window.prompt:
            known = len(self.committed) - 1 - window.first - window.refed  # committed after its root (a branch window)
            if new_tokens[:known] != self.committed[len(self.committed) - known:]:
                self.stats.mismatched_windows += 1  # its rows computed otherwise than the ones that committed
                self.passes += 1
                self.stats.discarded_passes += 1
                self._drop_invalid_branches(stale=window.first)
                return []
            kept = self._observe(window, new_tokens, known)
        committed = self._commit(new_tokens[known:], is_end)
        if self.branching and not window.prompt:
            self._drop_invalid_branches()
            self.cached = min([fed_agreement(self.fed, self.committed), *(held.first for held in self.in_flight)])
            return committed
        if kept is not None:
            self.cached = min(kept, len(self.committed))
        self.refeed = 0 if kept is None else max(0, len(self.committed) - 1 - kept)
        # a window in flight after one that left its main chain sits on cells the stages drop
        while self.in_flight and (self.finished or self.refeed or self.in_flight[0].first != len(self.committed) - 1
                                  or self.in_flight[0].inputs[0] != self.committed[-1]):
            self.in_flight.popleft()  # computed on a speculation that failed
            self.discards_pending += 1
        return committed

    def _observe(self, window: Window, tokens: list[int], known: int) -> int:
        """A decoding window's verification told to the stats, the rank
        acceptance and the draft policy; returns the positions the stages keep
        (its main chain's accepted end). The policy and the chain counts see
        the main chain beyond the ``known`` tokens already committed (none
        where those left it); a tree's side rows are counted apart."""
        drafts = window.main_drafts  # filler left out: the stats and the policy see the drafter's drafts
        path = accepted_rows(window.inputs[window.refed:], window.parents, tokens)
        kept = window.first + window.refed + 1 + sum(row < len(drafts) + window.filler + 1 for row in path)
        accepted = sum(row < len(drafts) + 1 for row in path)
        on_main = path[:known] == list(range(1, known + 1))
        chain, taken = (max(0, len(drafts) - known), max(0, accepted - known)) if on_main else (0, 0)
        self.passes += 1
        tree = window.parents is not None
        self.stats.verified(chain, taken, len(tokens) - known, len(window.inputs), window.refed,
                            len(window.drafts) - len(drafts) if tree else None, len(path) - accepted)
        if tree:
            self.speculation.ranks.observe(DraftTree(list(window.inputs[window.refed:]), list(window.parents),
                                                     list(window.ranks)), tokens)
        self.accepted_whole = bool(chain) and taken == chain and accepted == len(path)
        if self.schedule.speculative and (chain or not known):
            self.policy.observe_window(chain, taken)
            self._choose_limits()
        return kept

    def _drop_invalid_branches(self, stale: int | None = None) -> None:
        """A branching sequence's windows in flight that can no longer give a
        token (branches.reaches; all once it finished) become discards, and so
        does every one after them that fed from a later position (it trusted
        their cells); the stages' cells from an invalid window's first position
        on are then unknown (``fed``). stale: such a position already known."""
        if stale is not None:
            del self.fed[stale:]
        held: deque[Window] = deque()
        for window in self.in_flight:
            if self.finished or (stale is not None and window.first > stale) or not reaches(window, self.committed):
                self.discards_pending += 1
                stale = window.first if stale is None else min(stale, window.first)
                del self.fed[window.first:]
            else:
                held.append(window)
        self.in_flight = held

    def discarded(self) -> None:
        """The result of a window found invalid in flight has arrived."""
        self.discards_pending -= 1
        self.passes += 1
        self.stats.discarded_passes += 1

    def _commit(self, new_tokens: list[int], is_end: Callable[[int], bool]) -> list[int]:
        committed: list[int] = []
        for token in new_tokens:
            if is_end(token):
                self.finished, self.stopped_by = True, "end"
                break
            self.committed.append(token)
            committed.append(token)
            if self.generated == self.max_tokens:
                self.finished = True
                break
        # where the speculation went wrong, the correction drafted there for the target's token, if any
        self.stats.corrected_windows += self.speculation.committed(
            committed, len(self.committed) - 1, None if self.finished else self.committed[-1])
        return committed
