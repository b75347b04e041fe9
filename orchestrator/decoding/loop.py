"""The one decoding loop: the schedule's decisions (orchestrator.decoding.schedule)
carried out against a target and its drafters.

``orchestrate run`` (``generate``), ``orchestrate serve``'s service
(orchestrator.decoding.service) and the planner's simulation
(orchestrator.planning.simulation) all turn this loop; they differ only in
the target it drives (a socket pipeline, stages in this process, simulated
stages in virtual time) and where its sequences come from. One turn
(``DecodingLoop.step``):

    drafters beside stage 0 draft for the sequences that wait for them
    -> submit the passes the schedule makes (first windows, windows ahead)
    -> wait for the oldest pass while async sequences draft on (a branching
       one also submits a branch window each time stage 0 is done)
    -> verify each window it carried and commit its tokens
    -> cancel the passes a rejection made worthless, and start the drafter
       beside stage 0 for a sequence that waits only for such passes

Each window feeds [last committed token, draft_1, ..., draft_k] at positions
len(committed) - 1 onward; every stage first drops cached positions from there
on (rolling back whatever the previous pass speculated). The window's logit
rows are verified (speculators.tree.verify_rows; a pipeline does it beside its
last stage, so only token ids come back) and the accepted drafts plus the
target's own token are committed. Plain decoding is the case k = 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.config import BRANCH_LOOKS_PER_STAGE
from orchestrator.decoding.schedule import SequenceState, prompt_chunk
from orchestrator.decoding.scheduler import Batching, Scheduler
from orchestrator.decoding.stats import SpeculationStats
from orchestrator.decoding.windows import Window
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.targets import Target, committed_logprobs, committed_tokens
from speculators.logprobs import TokenLogprobs
from speculators.sampling import SamplingSettings
from speculators.tree import TreeAsk


def sequence_state(sequence: int, prompt_tokens: list[int], max_tokens: int, sampling: SamplingSettings | None,
                   drafting: Drafting | None, target: Target, cached: int = 0,
                   logprobs: int | None = None, grammar: str | None = None, *, begun: bool = False) -> SequenceState:
    """The schedule's state of a new sequence that drafts as ``drafting`` says
    (None: plain); its prompt goes through ``target`` in chunks that pipeline
    (schedule.prompt_chunk), from position ``cached`` on (the stages already
    hold the prompt's first ``cached`` tokens in its KV sequence: a copied prefix);
    logprobs: None, or how many alternatives each token's logprobs carry;
    grammar: None, or its tokens are chosen under this grammar.
    begun: the prompt's pass is done and gave the prompt's last token, the
    first generated one: decoding starts at once (the planner's simulation,
    which starts at the first generated token)."""
    if begun:
        prefill = dict(sampling=sampling, logprobs=logprobs, grammar=grammar)
        prompt_length = len(prompt_tokens) - 1
    elif not 0 <= cached < len(prompt_tokens):
        raise ValueError(f"a cached prefix of {cached} tokens for a prompt of {len(prompt_tokens)}")
    else:
        prefill = dict(prompt_from=cached, cached=cached, prompt_depth=target.stage_count, sampling=sampling,
                       logprobs=logprobs, grammar=grammar,
                       prompt_chunk=prompt_chunk(len(prompt_tokens) - cached, target.stage_count, target.n_batch))
        prompt_length = len(prompt_tokens)
    if drafting is None:
        return SequenceState(sequence, list(prompt_tokens), prompt_length, max_tokens, **prefill)
    return SequenceState(
        sequence, list(prompt_tokens), prompt_length, max_tokens, drafting.schedule, drafting.draft_max,
        draft_call_cost=drafting.call_cost, draft_step=drafting.step, tree_leaves=drafting.tree_leaves,
        side_row_step=drafting.side_row_step, draft_prices=drafting.draft_prices, pass_curve=drafting.pass_curve,
        coupled=drafting.coupled, branches=drafting.branches, stages=target.stage_count,
        **prefill,
    )


@dataclass(frozen=True)
class PassTimes:
    """What a pass that came back cost each stage: its busy seconds, when each
    began it (its machine's time.time(); empty where the target does not
    say: in process, simulated), and whether its result was discarded (its
    window computed on a speculation that failed, or cancelled)."""

    stage_seconds: tuple[float, ...]
    stage_started: tuple[float, ...] = ()
    discarded: bool = False


class Listener:
    """What the loop tells about one sequence as it goes; these defaults do nothing."""

    def pass_returned(self, times: PassTimes) -> None:
        """A pass that carried a window of it came back (discarded ones too)."""

    def verified(self, window: Window, tokens: list[int]) -> None:
        """A window that gives tokens was verified; ``tokens`` it committed (maybe none, at the end)."""

    def scored(self, logprobs: TokenLogprobs) -> None:
        """The logprobs of the tokens ``verified`` is told of next (only for windows that ask, Window.logprobs)."""


@dataclass
class Decoding:
    """One sequence in the loop: its schedule state, how it drafts (None:
    plain decoding), and who hears of its passes and tokens."""

    state: SequenceState
    drafting: Drafting | None = None
    listener: Listener = field(default_factory=Listener)


TokensOf = Callable[[object, Window, slice], list[int]]
"""(a pass's result, one of its windows, that window's rows) -> the tokens it commits."""


class DecodingLoop:
    """The sequences being decoded through one target, and the turns that decode them.

    window_per_pass: a pass carries one window, so a pipeline's stages work on
    different sequences at once; batching: windows of several sequences share
    passes where it pays (schedule.Batching). choose: how a result's window becomes tokens (the
    real targets': ``committed_tokens``; the simulation knows its text).
    clock: seconds, to tell when stage 0 is done with the passes submitted
    (the simulation's is virtual).
    """

    def __init__(self, target: Target, is_end: Callable[[int], bool], *, window_per_pass: bool = False,
                 batching: Batching | None = None, choose: TokensOf = committed_tokens,
                 clock: Callable[[], float] = time.perf_counter):
        self.target = target
        self.is_end = is_end
        self.choose = choose
        self.clock = clock
        self._stage_zero = 0.0  # what stage 0 took for the last pass that came back (seconds; 0: not known)
        self._submitted = 0.0  # when the last pass was submitted (clock)
        self.scheduler = Scheduler(window_per_pass=window_per_pass, batching=batching)
        self.decodings: dict[int, Decoding] = {}
        self._early: dict[int, TreeAsk | None] = {}  # sequences whose drafter 0 drafts already (_draft_early)

    def add(self, decoding: Decoding) -> None:
        self.scheduler.add(decoding.state)
        self.decodings[decoding.state.sequence] = decoding

    def remove(self, sequence: int) -> Decoding:
        """Forget a settled sequence (its id may then be reused)."""
        self.scheduler.remove(sequence)
        self._drop_early(sequence)
        return self.decodings.pop(sequence)

    @property
    def done(self) -> bool:
        """Every sequence finished, nothing in flight."""
        return self.scheduler.done

    def run(self) -> None:
        """Turn until every sequence has finished."""
        while not self.done:
            self.step()

    def step(self) -> bool:
        """One turn; False if nothing was in flight (every sequence idle or finished)."""
        self._draft_first()
        for target_pass in self.scheduler.next_passes():
            self._submit(target_pass)
        if not self.scheduler.in_flight:
            return False
        reply = self._receive_drafting()
        for state, window, rows in self.scheduler.received():
            if rows is not None and not window.prompt and reply.stage_seconds:
                self._stage_zero = reply.stage_seconds[0]  # a decoding pass's, computed whole
            decoding = self.decodings[state.sequence]
            decoding.listener.pass_returned(PassTimes(tuple(reply.stage_seconds), tuple(reply.stage_started),
                                                      rows is None))
            if rows is None:
                continue
            if not state.gives_token(window):  # an earlier chunk of the prompt: it only filled the cache
                state.verified(window, [], self.is_end)
                continue
            committed = state.verified(window, self.choose(reply, window, rows), self.is_end)
            if window.logprobs is not None:
                decoding.listener.scored(committed_logprobs(reply, window, rows, committed))
            decoding.listener.verified(window, committed)
        self.cancel_invalid()
        self._draft_early()
        return True

    def _submit(self, target_pass) -> None:
        self.target.submit(target_pass)
        self._submitted = self.clock()

    def cancel_invalid(self) -> None:
        """Stop computing the passes whose every window a rejection or a cancel made invalid."""
        for target_pass in self.scheduler.invalid_passes():
            self.target.cancel(target_pass)

    def _draft_early(self) -> None:
        """Start the drafter beside stage 0 for the sequences that will wait
        for it once their discarded passes are back (schedule.drafts_early):
        a rejection made the committed text known, so drafting need not wait
        for those passes. _draft_first collects it."""
        for state in self.scheduler.drafting_early():
            if state.sequence not in self._early:
                self._early[state.sequence] = self._speculate_first(state)
        for sequence in [sequence for sequence in self._early if self.scheduler.sequences[sequence].finished]:
            self._drop_early(sequence)

    def _drop_early(self, sequence: int) -> None:
        """A sequence that finished with drafting started early: its drafter's tokens are dropped."""
        if self._early.pop(sequence, False) is not False:
            self.decodings[sequence].drafting.drafter_first.collect(wait=True)  # type: ignore[union-attr]

    def _speculate_first(self, state: SequenceState) -> TreeAsk | None:
        """Start the drafter beside stage 0 on the committed text; the tree it grows, or None for a chain."""
        tree = state.tree_ask
        self.decodings[state.sequence].drafting.drafter_first.speculate(  # type: ignore[union-attr]
            state.committed, state.drafts_wanted, sampling=state.draft_sampling, tree=tree)
        return tree

    def _draft_first(self) -> None:
        """The sequences whose next window waits for the drafter beside stage 0 (schedule.drafts_first)."""
        for state in self.scheduler.drafting_first():
            drafter = self.decodings[state.sequence].drafting.drafter_first  # type: ignore[union-attr]
            tree = self._early.pop(state.sequence) if state.sequence in self._early else self._speculate_first(state)
            if tree is not None:
                state.drafted_tree(drafter.collect_tree(tree.leaves))
            else:
                state.drafted_first(drafter.collect(wait=True))

    def _receive_drafting(self):
        """The oldest pass's result; meanwhile each async sequence's drafter
        extends its speculation (Scheduler.drafting_during: one machine for the
        whole pass, Scheduler.drafter_of)."""
        drafting = self.scheduler.drafting_during()
        if not drafting:
            return self.target.receive()
        crowded = self.scheduler.crowded
        ways = [self.decodings[state.sequence].drafting for state in drafting]
        chosen = [way.drafters[self.scheduler.drafter_of(state, len(way.drafters), crowded)]  # type: ignore[union-attr]
                  for state, way in zip(drafting, ways)]
        for state, way, drafter in zip(drafting, ways, chosen):
            if (room := state.speculation_room) > 0 and way.corrects:  # type: ignore[union-attr]
                drafter.speculate(state.text, room, sampling=state.draft_sampling, forks=state.forks)
            elif room > 0:
                drafter.speculate(state.text, room, sampling=state.draft_sampling)
        peeked = [0] * len(drafting)  # tokens each drafter handed to branch windows already
        if len(drafting) == 1 and not crowded:
            peeked[0] = self._branch_while_waiting(drafting[0], chosen[0], ways[0].corrects)  # type: ignore[union-attr]
        reply = self.target.receive()
        for drafter in chosen:
            drafter.ask()
        for state, way, drafter, handed in zip(drafting, ways, chosen, peeked):
            tokens = drafter.collect()[handed:]
            state.drafted(tokens, drafter.corrections() if way.corrects else None)  # type: ignore[union-attr]
        return reply

    def _branch_while_waiting(self, state: SequenceState, drafter, corrects: bool) -> int:
        """A branching sequence's branch windows while its oldest pass runs: each
        time stage 0 is done with the passes submitted (by the last pass's
        seconds there) before the oldest result is in, what the drafter has
        drafted by then (chain and corrections; Drafter.peek: it drafts on)
        makes the next window (SequenceState.branch_window), submitted at
        once; where it makes none yet, the drafter is looked at again
        BRANCH_LOOKS_PER_STAGE times a stage's time, up to that many times.
        Returns how many of the drafter's tokens it took."""
        peeked, looks = 0, 0
        deadline = self._submitted + self._stage_zero
        while (state.branching and 0 < len(state.in_flight) < state.stages and self._stage_zero > 0
               and looks < BRANCH_LOOKS_PER_STAGE):
            if self.target.result_within(max(0.0, deadline - self.clock())):
                break
            tokens = drafter.peek()
            state.drafted(tokens[peeked:], drafter.corrections() if corrects else None)
            peeked = max(peeked, len(tokens))
            window = state.branch_window()
            if window is None:
                looks += 1
                deadline = self.clock() + self._stage_zero / BRANCH_LOOKS_PER_STAGE
            else:
                self._submit(self.scheduler.submit_alone(window))
                looks, deadline = 0, self._submitted + self._stage_zero
        return peeked


# -- orchestrate run: a fixed set of sequences, each with its Generation ------

@dataclass
class Generation:
    """What one generation produced and how long it took.

    tokens: generated ids (an end-of-generation token is not included).
    prefill_seconds: from start to the first generated token.
    decode_seconds: from the first generated token to the last.
    passes: target passes that carried it after the prompt (discarded ones too);
    stage_seconds: each stage's busy seconds over the passes that carried it,
    discarded_seconds: those of them on passes whose result was discarded;
    timeline: every such pass's PassTimes, in the order they came back.
    """

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    passes: int = 0
    stage_seconds: list[float] = field(default_factory=list)
    discarded_seconds: list[float] = field(default_factory=list)
    timeline: list[PassTimes] = field(default_factory=list)
    stopped_by: str = "length"
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generation phase: tokens after the first over the time they took."""
        if len(self.tokens) < 2 or self.decode_seconds <= 0:
            return 0.0
        return (len(self.tokens) - 1) / self.decode_seconds

    @property
    def busy_fractions(self) -> list[float]:
        """Each stage's busy seconds over the generation's wall time."""
        return [seconds / self.seconds if self.seconds > 0 else 0.0 for seconds in self.stage_seconds]

    @property
    def discarded_shares(self) -> list[float]:
        """Each stage's share of its busy seconds spent on passes discarded (or cancelled)."""
        return [discarded / busy if busy > 0 else 0.0 for discarded, busy in zip(self.discarded_seconds, self.stage_seconds)]

    def account(self, times: PassTimes) -> None:
        if not self.stage_seconds:
            self.stage_seconds = [0.0] * len(times.stage_seconds)
            self.discarded_seconds = [0.0] * len(times.stage_seconds)
        for index, seconds in enumerate(times.stage_seconds):
            self.stage_seconds[index] += seconds
            self.discarded_seconds[index] += seconds if times.discarded else 0.0
        self.timeline.append(times)


@dataclass
class Request:
    """One sequence to decode: its prompt, how many tokens, how they are chosen
    and drafted. on_token: called with each committed token; on_pass: called
    after each verified window with the running Generation and the tokens it committed."""

    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingSettings
    drafting: Drafting | None = None
    on_token: Callable[[int], None] | None = None
    on_pass: Callable[[Generation, int], None] | None = None


class _Recorder(Listener):
    """A Generation kept as the loop goes: tokens, clocks, stage seconds, callbacks."""

    def __init__(self, request: Request, state: SequenceState):
        self.request = request
        self.state = state
        self.result = Generation(list(request.prompt_tokens), speculation=state.stats)
        self.started = time.perf_counter()
        self.first_token_time: float | None = None

    def pass_returned(self, times: PassTimes) -> None:
        self.result.account(times)

    def verified(self, window: Window, tokens: list[int]) -> None:
        for token in tokens:
            now = time.perf_counter()
            if self.first_token_time is None:
                self.first_token_time = now
                self.result.prefill_seconds = now - self.started
            self.result.decode_seconds = now - self.first_token_time
            self.result.tokens.append(token)
            if self.request.on_token is not None:
                self.request.on_token(token)
        self.result.passes = self.state.passes
        if not window.prompt and self.request.on_pass is not None:
            self.request.on_pass(self.result, len(tokens))

    def finish(self) -> Generation:
        self.result.stopped_by = self.state.stopped_by
        self.result.passes = self.state.passes
        return self.result


def generate(
    target: Target,
    prompt_tokens: list[int],
    max_tokens: int,
    sampling: SamplingSettings,
    is_end: Callable[[int], bool],
    *,
    on_token: Callable[[int], None] | None = None,
    on_pass: Callable[[Generation, int], None] | None = None,
    drafting: Drafting | None = None,
) -> Generation:
    """Decode up to max_tokens after the prompt through ``target`` (a Pipeline)."""
    request = Request(list(prompt_tokens), max_tokens, sampling, drafting, on_token, on_pass)
    return generate_many(target, [request], is_end)[0]


def generate_many(target: Target, requests: list[Request], is_end: Callable[[int], bool]) -> list[Generation]:
    """Decode several sequences at once through ``target``, each as ``generate`` would (their windows share passes)."""
    if any(not request.prompt_tokens for request in requests):
        raise ValueError("the prompt is empty")
    loop = DecodingLoop(target, is_end)
    recorders = []
    for index, request in enumerate(requests):
        state = sequence_state(index, request.prompt_tokens, request.max_tokens, request.sampling, request.drafting,
                               target)
        recorders.append(_Recorder(request, state))
        loop.add(Decoding(state, request.drafting, recorders[-1]))
    loop.run()
    return [recorder.finish() for recorder in recorders]

