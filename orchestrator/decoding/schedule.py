"""The decoding schedule: which windows the target runs, as pure decisions
(one sequence's here, SequenceState; many in flight: orchestrator.decoding.scheduler).

The real decoding loop (orchestrator.decoding.loop) and the planner's simulation
(orchestrator.planning.simulation) both follow these rules; they differ only
in what a pass and a draft cost (real I/O, or virtual time). No I/O here: no
Ray, no sockets, no llama.cpp.

Terms (README, "Glossary"; docs/architecture.md): a sequence's *text* is its committed tokens
followed by its *speculation* (draft tokens not yet verified). A *window* is
the part of one sequence a target pass feeds: the last committed token (or,
for a window started ahead, a speculated one) and the drafts after it. A
*pass* carries the windows of one or more sequences, one after the other.

The rules:

* Which window a pass feeds (``SequenceState.first_window``): the last
  committed token, then the first ``draft_limit`` tokens of the speculation
  (no more than the tokens still wanted allow).
* When the drafter beside stage 0 drafts before a pass and the loop waits for
  it (``SequenceState.drafts_first``): every pass in ``sync``; in ``async``
  only when no speculation is pending (at the start, or after a rejection),
  since stage 0 is idle until the pass starts and a pass without drafts
  wastes the target.
* Who drafts while an ``async`` pass runs (``Scheduler.drafter_of``): one
  drafter for the whole pass, collected with its result: a lone sequence's
  is the drafter beside stage 0, which drafted the window and keeps it in its
  cache; sequences sharing passes spread over the machines. A sequence whose
  draft policy takes no drafts does not draft meanwhile. A draft model's
  drafter (Drafting.corrects) also drafts *corrections* at the head window's
  drafts meanwhile (``SequenceState.forks``; speculators.corrections): its
  runners-up there and what it drafts after each. After a rejection whose
  target token is such a runner-up, that correction's continuation is the
  speculation at once (``SequenceState.verified``), so the next window need
  not wait for the drafter.
* When a window is started ahead (``SequenceState.window_ahead``, ``async``
  only, PipeInfer's idea): while one window of the sequence is in flight,
  the next window of the speculation, assuming the one in flight commits
  its whole window, submitted at a turn's start with the window it follows,
  so stage 0 computes it while the later stages compute the one before;
  only after a window that accepted all its drafts (``accepted_whole``), since
  after a rejection the speculation is gone.
* When a window in flight is invalid (``SequenceState.verified``): when it
  does not start at the last committed token (the window before it did not
  commit all it carried, or its own token differs), or the sequence is
  finished. Its result is discarded when it arrives, and the sequence submits
  nothing new until then (the next pass's rollback drops its cache entries);
  but where its next window waits for drafts from the committed text, the
  drafter beside stage 0 starts them at once (``SequenceState.drafts_early``).
* When a pass in flight is cancelled (``Scheduler.invalid_passes``,
  PipeInfer's early cancellation): as soon as every window it carries is
  invalid. Stages that have not started it drop it, and the one running it
  stops; its result, whatever comes back, is discarded as above.
* How many drafts a window carries (``draft_limit``, none included: then
  the drafter is not even asked): ``speculators.draft_length.DraftPolicy``,
  from the acceptance by draft position and the cost of a longer pass. With
  continuous batching, chains ready at once carry one number of drafts, so
  that they share passes: the one, up to the most any of them has, that
  commits the most tokens per cost of their passes on the measured curve,
  a chain short of drafts padded with filler (``Scheduler.shared_drafts``);
  while two or more sequences decode, no window is started ahead (it would
  go in a pass of its own), nobody waits for drafts, each drafts on one
  machine for its whole pass, and drafting pauses while shared passes take
  no drafts (``Scheduler.drafting_during``).
* When a window is a token tree (``SequenceState.drafted_tree``, a sequence
  with ``tree_leaves`` > 1 whose drafter proposes one): the draft policy's
  chain is its main chain, and ``speculators.tree.choose_rows`` adds the side
  rows that pay for themselves (acceptance by candidate rank, the pass's
  cost). Windows started ahead stay chains: they extend the main chain. A
  window whose accepted path left the main chain commits it, but the stages
  keep only the main chain's cells; the next window feeds the rest again
  (``SequenceState.refeed``).
* How a prompt is prefilled (``prompt_chunk``, ``SequenceState.windows_ahead``):
  in chunks that flow through the stages back to back, up to one chunk in
  flight per stage, so stage 0 computes chunk 2 while stage 1 computes
  chunk 1. With S stages and k chunks the pipeline idles (S - 1) / (k + S - 1)
  of the prefill; chunks of a quarter of a stage's share keep that under a
  fifth, down to PREFILL_LEAST_CHUNK tokens.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.config import PREFILL_CHUNKS_PER_STAGE, PREFILL_LEAST_CHUNK, WINDOWS_DRAFTED_AHEAD
from speculators.corrections import Corrections, Forks
from speculators.draft_length import DRAFTER_CALL_COST, PRIOR_STEP, DraftPolicy, DraftPrices
from speculators.sampling import SamplingSettings
from speculators.tree import (DraftTree, PassCost, TreeAsk, accepted_rows, choose_rows, curve_cost,
                              linear_cost, offered_rows, MAX_TREE_ROWS)
from stages.tree_shape import main_chain_length
from stages.cost_curve import BatchCurve
from orchestrator.decoding.stats import SpeculationStats
from orchestrator.decoding.speculation import Speculation
from orchestrator.decoding.windows import Window


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
class SequenceState:
    """One sequence being decoded: its text, its windows in flight, its draft length.

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
        return not self.finished and not self.in_flight and not self.discards_pending

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
        return (not self.finished and not self.in_flight and self.discards_pending > 0
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

    @property
    def forks(self) -> Forks | None:
        """Where corrections may be drafted while the head window is verified
        (speculators.corrections): at its drafts, within the rounds its pass
        lasts (its cost on the policy's line, in awaited draft steps: 0 where
        the draft's price is not measured); None unless the head window is a
        chain of drafts starting at the last committed token."""
        head = self.in_flight[0] if self.in_flight else None
        if (head is None or head.prompt or head.parents is not None or head.refed
                or head.first != len(self.committed) - 1 or not head.main_drafts):
            return None
        drafts, price = len(head.main_drafts), self.draft_prices.awaited
        rounds = self.policy.cost(drafts, awaited=False) / price if price > 0 else 0.0
        return Forks(len(self.committed), drafts, rounds)

    def _prompt_window(self) -> Window:
        """The prompt's next chunk."""
        end = min(self.prompt_from + self.prompt_chunk, self.prompt_length) if self.prompt_chunk else None
        last = end is None or end >= self.prompt_length  # only the last chunk gives a token: the others choose none
        window = Window(self.sequence, self.prompt_from, tuple(self.committed[self.prompt_from:end]), prompt=True,
                        sampling=self.sampling, logprobs=self.logprobs if last else None,
                        **(self._constrained(self.prompt_length) if last else {}))
        self.prompt_from = end if end is not None and end < self.prompt_length else None
        return window

    def first_window(self, shared: int | None = None) -> Window:
        """The window of its next pass (it must be ``ready``); shared: exactly
        this many drafts (Scheduler.shared_drafts): its speculation's, then
        filler (Window.filler); None: as its policy says."""
        if self.prompt_from is not None:
            window = self._prompt_window()
        else:
            shared = shared if self.tree_leaves == 1 else None  # a tree goes in a pass of its own
            limit = self.drafts_wanted if self.schedule.speculative else 0
            limit = limit if shared is None else min(shared, max(self.room, 0))
            first = len(self.committed) - 1 - self.refeed
            drafts = self.speculation.tokens[:limit]
            filler = 0 if shared is None else limit - len(drafts)
            tree = DraftTree.chain(self.committed[-1], drafts + [(drafts or self.committed)[-1]] * filler)
            candidates = self.speculation.take_candidates()
            if candidates is not None and limit > 0:
                tree = choose_rows(candidates, self.policy.acceptances(), self.speculation.ranks, self._row_cost(),
                                   forced=min(limit, len(self.speculation.tokens)))
            window = Window(self.sequence, first, (*self.committed[first:-1], *tree.tokens), sampling=self.sampling,
                            logprobs=self.logprobs, refed=self.refeed, **self._constrained(len(self.committed)),
                            parents=None if tree.is_chain else tuple(tree.parents),
                            ranks=None if tree.is_chain else tuple(tree.ranks), filler=filler)
        self.in_flight.append(window)
        return window

    def _row_cost(self) -> PassCost:
        """What the tree rule prices a pass of n rows at: side_row_step if
        set (the bench's tree-all mode), else the measured curve at every
        width, else the policy's line through two widths."""
        if self.side_row_step is not None:
            return linear_cost(self.side_row_step)
        if self.pass_curve is not None:
            return curve_cost(self.pass_curve, self.refeed)
        return linear_cost(self.policy.step)

    @property
    def draft_sampling(self) -> SamplingSettings | None:
        """What its drafters sample with: its own sampling when coupled and
        not greedy (speculators.model_tree), else None (their top choices)."""
        return self.sampling if self.coupled and self.sampling is not None and not self.sampling.greedy else None

    @property
    def tree_ask(self) -> TreeAsk | None:
        """The tree its drafter grows before its next window: as many rows as
        a pass twice a one-token one's can verify on its curve, each row's
        growth priced as an awaited draft token (speculators.tree.offered_rows),
        within one batch beside the tokens fed again; tree_leaves leaves (no
        more than its rows); the draft policy's acceptance along a chain, mean
        over its positions. None: a chain, also where side rows do not pay
        for their growth (_side_rows_pay)."""
        if self.tree_leaves == 1:
            return None
        cost, grow = self._row_cost(), self.draft_prices.awaited
        acceptances = self.policy.acceptances()
        if self.side_row_step is None and not self._side_rows_pay(acceptances, grow):
            return None
        rows = offered_rows(lambda rows: cost(rows) + grow * rows, max(1, self.drafts_wanted),
                            MAX_TREE_ROWS - self.refeed)
        return TreeAsk(rows, min(self.tree_leaves, rows), sum(acceptances) / len(acceptances))

    def _side_rows_pay(self, acceptances: list[float], grow: float) -> bool:
        """Whether a tree's best side row (the root's second choice, taken
        when the target declines the first: its rank's measured share) brings
        more tokens than its growth costs while the pass waits for it: grow
        passes at the tokens a pass of the chain is expected to commit."""
        best_side = (1.0 - acceptances[0]) * self.speculation.ranks.share(2)
        return best_side > grow * self.policy.expected_committed(max(1, self.drafts_wanted))

    def windows_ahead(self, speculative: bool = True) -> list[Window]:
        """Windows to start while one of it is in flight: the prompt's next
        chunks, up to prompt_depth in flight; or (speculative) the next window of the speculation."""
        if self.prompt_from is None:
            window = self.window_ahead() if speculative else None
            return [] if window is None else [window]
        chunks = []
        while self.prompt_from is not None and self.in_flight and len(self.in_flight) < self.prompt_depth \
                and not self.finished:
            chunks.append(self._prompt_window())
            self.in_flight.append(chunks[-1])
        return chunks

    def window_ahead(self) -> Window | None:
        """The next window of the speculation, started while one is in flight,
        or None. Only after a window that accepted all its drafts (accepted_whole):
        the window in flight is then the only one, valid, and drafted on by
        the drafter during the last pass; after a rejection the speculation
        is gone and its next window waits for the drafter."""
        if not (self.schedule.asynchronous and self.accepted_whole and len(self.in_flight) == 1
                and not self.finished):
            return None
        head = self.in_flight[0]
        first = head.first + head.main_rows
        ahead = first - (len(self.committed) - 1)  # tokens the head must commit first
        limit = min(self.draft_limit, self.room - ahead)
        text = self.text
        if len(text) <= first or limit < 0:
            return None
        window = Window(self.sequence, first, tuple(text[first : first + 1 + limit]), sampling=self.sampling,
                        logprobs=self.logprobs, **self._constrained(first + 1))
        self.in_flight.append(window)
        return window

    def _constrained(self, through: int) -> dict:
        """A window's grammar fields: its grammar and the text generated before
        position ``through`` (row 0's input the last of it); none without a grammar."""
        if self.grammar is None:
            return {}
        return {"grammar": self.grammar, "generated": tuple(self.text[self.prompt_length:through])}

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
        the target's own token). Commits them up to an end token or max_tokens,
        keeps the speculation that still extends the committed text, and drops
        the windows in flight that became invalid. Returns the tokens committed."""
        self.in_flight.popleft()
        if window.prompt:
            self.cached = window.first + len(window.inputs)
        if not self.gives_token(window):  # a prompt chunk before the last: it only filled the cache
            return []
        kept = None  # positions the stages keep after a decoding window: up to its main chain's accepted end
        if not window.prompt:
            # the policy and the chain counts see the main chain; a tree's side rows are counted apart
            drafts = window.main_drafts  # filler left out: the stats and the policy see the drafter's drafts
            path = accepted_rows(window.inputs[window.refed:], window.parents, new_tokens)
            kept = window.first + window.refed + 1 + sum(row < len(drafts) + window.filler + 1 for row in path)
            accepted = sum(row < len(drafts) + 1 for row in path)
            self.passes += 1
            tree = window.parents is not None
            self.stats.verified(len(drafts), accepted, len(new_tokens), len(window.inputs), window.refed,
                                len(window.drafts) - len(drafts) if tree else None, len(path) - accepted)
            if tree:
                self.speculation.ranks.observe(DraftTree(list(window.inputs[window.refed:]), list(window.parents),
                                                         list(window.ranks)), new_tokens)
            self.accepted_whole = bool(drafts) and accepted == len(drafts) == len(path)
            if self.schedule.speculative:
                self.policy.observe_window(len(drafts), accepted)
                self._choose_limits()
        committed = self._commit(new_tokens, is_end)
        if kept is not None:
            self.cached = min(kept, len(self.committed))
        self.refeed = 0 if kept is None else max(0, len(self.committed) - 1 - kept)
        # a window in flight after one that left its main chain sits on cells the stages drop
        while self.in_flight and (self.finished or self.refeed or self.in_flight[0].first != len(self.committed) - 1
                                  or self.in_flight[0].inputs[0] != self.committed[-1]):
            self.in_flight.popleft()  # computed on a speculation that failed
            self.discards_pending += 1
        return committed

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
