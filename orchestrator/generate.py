"""The decoding loop: the schedule's decisions (orchestrator.schedule) carried
out against a real target and real drafters, plus the bookkeeping of each
generation (tokens, times, callbacks).

Each window feeds [last committed token, draft_1, ..., draft_k] at positions
len(committed) - 1 onward; every stage first drops cached positions from there
on (rolling back whatever the previous pass speculated). The window's logit
rows are verified (speculators.verify; a pipeline does it beside its last
stage, so only token ids come back) and the accepted drafts plus the
target's own token are committed. Plain decoding is the case k = 0. Several sequences may
be decoded at once (``generate_many``), their windows sharing passes; one
generation is the case of one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


from orchestrator.interfaces import Drafter, Target, committed_tokens
from orchestrator.schedule import Schedule, Scheduler, SequenceState, SpeculationStats, relay
from speculators.draft_length import DRAFTER_CALL_COST, PRIOR_STEP
from speculators.sampling import SamplingSettings


@dataclass(frozen=True)
class Drafting:
    """How a generation drafts: drafters[i] sits beside stage i (one per
    stage), the schedule, and the most drafts a window carries.

    first: the drafter the loop waits for before a window (the schedule's
    drafts_first); None: the one beside stage 0. Prompt lookup runs here, in
    this process: it costs microseconds, where asking an actor costs a round
    trip each window.
    call_cost: what that ask costs, in one-token passes (the draft policy's).
    step: what each extra token of a pass costs, in one-token passes
    (Pipeline.draft_step measures it before a run).
    tree_leaves: above 1, ``first`` drafts token trees of up to that many
    leaves (an InstantDrafter's collect_tree; the stages need as many
    tree_sequences less one), and the schedule verifies the rows that pay.
    side_row_step: what the tree rule prices a side row at, in one-token
    passes (None: ``step``, as any row; the bench's tree-all mode: 0).
    """

    drafters: Sequence[Drafter]
    schedule: Schedule
    draft_max: int
    first: Drafter | None = None
    call_cost: float = DRAFTER_CALL_COST
    step: float = PRIOR_STEP
    tree_leaves: int = 1
    side_row_step: float | None = None


@dataclass
class Generation:
    """What one generation produced and how long it took.

    tokens: generated ids (an end-of-generation token is not included).
    prefill_seconds: from start to the first generated token.
    decode_seconds: from the first generated token to the last.
    passes: target passes that carried it after the prompt (discarded ones too);
    stage_seconds: each stage's busy seconds over the passes that carried it.
    """

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    passes: int = 0
    stage_seconds: list[float] = field(default_factory=list)
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

    def account(self, stage_seconds: Sequence[float]) -> None:
        if not self.stage_seconds:
            self.stage_seconds = [0.0] * len(stage_seconds)
        for index, seconds in enumerate(stage_seconds):
            self.stage_seconds[index] += seconds


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


class _Decoding:
    """The I/O side of one sequence: its request, its generation, its clock."""

    def __init__(self, index: int, request: Request, prompt_chunk: int):
        self.request = request
        self.result = Generation(list(request.prompt_tokens))
        self.started = time.perf_counter()
        self.first_token_time: float | None = None
        drafting = request.drafting
        self.state = SequenceState(
            index, list(request.prompt_tokens), len(request.prompt_tokens), request.max_tokens,
            drafting.schedule if drafting is not None else Schedule.PLAIN,
            drafting.draft_max if drafting is not None else 1,
            prompt_from=0, prompt_chunk=prompt_chunk, sampling=request.sampling,
            draft_call_cost=drafting.call_cost if drafting is not None else DRAFTER_CALL_COST,
            draft_step=drafting.step if drafting is not None else PRIOR_STEP,
            tree_leaves=drafting.tree_leaves if drafting is not None else 1,
            side_row_step=drafting.side_row_step if drafting is not None else None,
        )
        self.result.speculation = self.state.stats

    def committed(self, tokens: list[int]) -> None:
        for token in tokens:
            now = time.perf_counter()
            if self.first_token_time is None:
                self.first_token_time = now
                self.result.prefill_seconds = now - self.started
            self.result.decode_seconds = now - self.first_token_time
            self.result.tokens.append(token)
            if self.request.on_token is not None:
                self.request.on_token(token)


def generate_many(target: Target, requests: list[Request], is_end: Callable[[int], bool]) -> list[Generation]:
    """Decode several sequences at once through ``target``, each as ``generate`` would."""
    if any(not request.prompt_tokens for request in requests):
        raise ValueError("the prompt is empty")
    decodings = [_Decoding(index, request, target.n_batch) for index, request in enumerate(requests)]
    scheduler = Scheduler(decoding.state for decoding in decodings)
    while not scheduler.done:
        for state in scheduler.drafting_first():
            drafting = decodings[state.sequence].request.drafting
            drafter = drafting.first or drafting.drafters[0]  # type: ignore[union-attr]
            drafter.speculate(state.committed, state.drafts_wanted)
            if state.tree_leaves > 1:
                state.drafted_tree(drafter.collect_tree(state.tree_leaves))  # type: ignore[union-attr]
            else:
                state.drafted_first(drafter.collect(wait=True))
        for target_pass in scheduler.next_passes():
            target.submit(target_pass)
        reply = _receive_relaying(target, scheduler, decodings)
        for state, window, rows in scheduler.received():
            decoding = decodings[state.sequence]
            decoding.result.account(reply.stage_seconds)
            if rows is None:
                continue
            if not state.gives_token(window):  # an earlier chunk of the prompt: it only filled the cache
                state.verified(window, [], is_end)
                continue
            new_tokens = committed_tokens(reply, window, rows, decoding.request.sampling)
            decoding.committed(state.verified(window, new_tokens, is_end))
            decoding.result.passes = state.passes
            if not window.prompt and decoding.request.on_pass is not None:
                decoding.request.on_pass(decoding.result, len(new_tokens))
        for target_pass in scheduler.invalid_passes():  # a rejection invalidated them: stop computing them
            target.cancel(target_pass)
    for decoding in decodings:
        decoding.result.stopped_by = decoding.state.stopped_by
        decoding.result.passes = decoding.state.passes
    return [decoding.result for decoding in decodings]


def _receive_relaying(target: Target, scheduler: Scheduler, decodings: list[_Decoding]):
    """The oldest pass's result; meanwhile async sequences hand drafting from
    machine to machine as the pass leaves each stage (schedule.relay)."""
    relaying = scheduler.relaying()
    if not relaying:
        return target.receive()
    drafters = [decodings[state.sequence].request.drafting.drafters for state in relaying]  # type: ignore[union-attr]
    handoffs = relay(len(drafters[0]))
    reply = None
    for moment, handoff in enumerate(handoffs):
        if moment == len(handoffs) - 1:
            reply = target.receive()
        elif moment > 0:
            target.await_boundary(moment - 1)
        for state, machines in zip(relaying, drafters):
            if handoff.collect is not None:
                state.drafted(machines[handoff.collect].collect())
            if handoff.start is not None:
                machines[handoff.start].speculate(state.text)
    return reply
