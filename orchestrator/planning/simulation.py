"""A discrete-event simulation of the coordinator's decoding loop.

It replays orchestrator.generate's schedule in virtual time, pass by pass:
the same draft-length rule (speculators.draft_length), the same async relay
of drafters at stage boundaries, the same pass started ahead after a fully
accepted pass, the same discarding of a pass started on a failed
speculation. Time comes from a cost model (``PipelineCosts``); no formula for
tokens/s is assumed anywhere: throughput is what the simulated clock shows.

Resources and their timelines:

* each stage runs one pass at a time, in submission order, on a free core of
  its machine (stages sharing a machine with fewer cores wait for one);
* a hop carries a pass from the coordinator to stage 0 (hop 0), from stage
  i - 1 to stage i (hop i), and the logits from the last stage back (hop n);
* the coordinator does its own work after each result (verification,
  bookkeeping) and waits on boundaries and results as the real loop does;
* one drafter per machine drafts from when it is told to speculate until it
  is collected, one token per ``draft_seconds``, stopping by itself (with
  probability ``1 - availability`` before its first token from the committed
  text, ``1 - continuation`` after each token) and after ``draft_max``.

Which drafts are proposed and right comes from the workload: drawn at random
from rates (``DraftBehaviour``: each draft token is right with probability
``acceptance`` when every token before it is right, the first one drafted
from the committed text with ``first_acceptance``; a token drafted after a
wrong one is wrong), or replayed from a real output (``DraftTrace``).
tests/test_planning.py checks that on traces it makes the same passes,
drafts, acceptances and discards as generate() itself. Pure Python, no Ray,
no llama.cpp.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from speculators.draft_length import next_draft_limit

SCHEDULES = ("plain", "sync", "async")


class PipelineCosts(Protocol):
    """Seconds for everything the schedule waits on."""

    stage_count: int

    def stage_seconds(self, stage: int, tokens: int) -> float:
        """One stage's compute for a pass of ``tokens`` tokens."""

    def hop_seconds(self, hop: int, tokens: int) -> float:
        """Hop ``hop`` (0: coordinator to stage 0; i: stage i-1 to i; n: last stage
        to the coordinator, carrying one row of logits per token)."""

    def coordinator_seconds(self, tokens: int) -> float:
        """The coordinator's own work on a result of ``tokens`` rows."""

    def draft_seconds(self, machine: int) -> float:
        """One draft token on the drafter beside stage ``machine``."""

    def draft_call_seconds(self) -> float:
        """The coordinator's round trip for one drafting request (speculate, then collect)."""

    def host(self, stage: int) -> int:
        """The machine stage ``stage`` runs on (stages may share one)."""

    def parallel_stages(self, host: int) -> int | None:
        """How many stages can compute at once on ``host`` (its cores over
        each stage's threads; None: as many as it holds); stages beyond that
        wait for one to finish."""


@dataclass(frozen=True)
class DraftBehaviour:
    """acceptance: probability that a draft token is right, given the tokens
    before it are right (bench: acceptance_later).
    first_acceptance: the same for the first token drafted from the committed
    text (bench: acceptance_first); None: as ``acceptance``. Prompt lookup's
    first guess is much less often right than its next ones: once it has found
    the passage being copied, it stays on it.
    availability: probability that drafting from the committed text proposes
    a token at all (bench: draft_availability; 1 for a draft model; below 1
    for prompt lookup, which finds no n-gram at some positions).
    continuation: probability that the drafter proposes a next token after
    one it proposed (bench: draft_continuation; prompt lookup, once it has
    found a passage, nearly always goes on)."""

    acceptance: float
    availability: float = 1.0
    first_acceptance: float | None = None
    continuation: float = 1.0

    def __post_init__(self):
        if not all(0.0 <= value <= 1.0 for value in (self.acceptance, self.first, self.availability, self.continuation)):
            raise ValueError("acceptances, availability and continuation are probabilities in [0, 1]")

    @property
    def first(self) -> float:
        return self.acceptance if self.first_acceptance is None else self.first_acceptance

    end = None  # random drafts say nothing of where the text ends

    def draw(self, position: int, prefix_right: bool, fresh: bool, rng: random.Random) -> bool | None:
        """The drafter's token at ``position``: None if it proposes none (and
        stops), else whether it is right. ``fresh``: the first token drafted
        from the committed text; ``prefix_right``: every token before it is right."""
        if rng.random() >= (self.availability if fresh else self.continuation):
            return None
        return prefix_right and rng.random() < (self.first if fresh else self.acceptance)


@dataclass(frozen=True)
class DraftTrace:
    """A measured workload instead of rates: proposals[p] is what the drafter
    proposes for generated token p given the true text before it (True: the
    right token, False: a wrong one, None: nothing). Made by replaying a
    drafter over a real output (benchmarks.calibrate does it for prompt
    lookup). After a wrong token the drafter is taken to go on proposing, and
    everything it proposes is wrong. The target ends the text after the last
    token (its end-of-generation token), as the traced output did."""

    proposals: tuple[bool | None, ...]

    SYMBOLS = {True: "R", False: "w", None: "."}

    @classmethod
    def replay(cls, propose: Callable[[list[int]], int | None], prompt: list[int], output: list[int]) -> DraftTrace:
        """Ask a drafter (``propose``: context -> next token or None) for each
        token of ``output`` given the prompt and the output before it."""
        proposals: list[bool | None] = [None]  # token 0 comes from the prompt's pass
        for position in range(1, len(output)):
            proposal = propose(prompt + output[:position])
            proposals.append(None if proposal is None else proposal == output[position])
        return cls(tuple(proposals))

    def as_text(self) -> str:
        """One character a token: R right, w wrong, . nothing proposed."""
        return "".join(self.SYMBOLS[proposal] for proposal in self.proposals)

    @classmethod
    def from_text(cls, text: str) -> DraftTrace:
        meaning = {symbol: proposal for proposal, symbol in cls.SYMBOLS.items()}
        unknown = set(text) - set(meaning)
        if unknown:
            raise ValueError(f"a draft trace holds only R, w and . (found {sorted(unknown)[0]!r})")
        return cls(tuple(meaning[symbol] for symbol in text))

    @property
    def end(self) -> int:
        """Where the target ends the text: after the last token of the trace."""
        return len(self.proposals)

    def draw(self, position: int, prefix_right: bool, fresh: bool, rng: random.Random) -> bool | None:
        if not prefix_right:
            return False
        return self.proposals[position] if position < len(self.proposals) else None


class DraftOutcomes(Protocol):
    end: int | None  # the generated position of the target's end-of-generation token, if known

    def draw(self, position: int, prefix_right: bool, fresh: bool, rng: random.Random) -> bool | None:
        """The drafter's token at generated position ``position`` (see DraftBehaviour.draw)."""


@dataclass(frozen=True)
class Mode:
    """schedule: plain (no drafts), sync or async; draft_max as ``--draft-max``."""

    schedule: str
    draft_max: int = 8

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r} (choose {', '.join(SCHEDULES)})")
        if self.draft_max < 1:
            raise ValueError("draft_max must be at least 1")


@dataclass
class SimulatedRun:
    """One simulated generation. tokens_per_second is measured like
    Generation.tokens_per_second: tokens after the first over their time."""

    tokens: int
    seconds: float
    passes: int = 0
    discarded_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    stage_busy_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return (self.tokens - 1) / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class Prediction:
    """Medians over simulated runs with different random draws."""

    mode: Mode
    tokens_per_second: float
    passes_per_token: float
    acceptance_rate: float
    discarded_passes_per_run: float
    stage_busy_fraction: tuple[float, ...]


@dataclass
class _Pass:
    first: int  # position of its first input (the last committed token, or a speculated one)
    drafts: list[bool]  # correctness of inputs[1:]
    first_input_right: bool
    boundaries: list[float]  # when it left each stage
    result_time: float


class _Stages:
    """The stages' timelines: each runs one pass at a time, in order, on a
    free core of its host."""

    def __init__(self, costs: PipelineCosts):
        self.costs = costs
        self.free_at = [0.0] * costs.stage_count
        self.busy = [0.0] * costs.stage_count
        hosts = {costs.host(stage) for stage in range(costs.stage_count)}
        self.cores_free_at = {host: [0.0] * (costs.parallel_stages(host) or costs.stage_count) for host in hosts}

    def run(self, submitted: float, tokens: int) -> tuple[list[float], float]:
        arrival = submitted + self.costs.hop_seconds(0, tokens)
        boundaries = []
        for stage in range(self.costs.stage_count):
            compute = self.costs.stage_seconds(stage, tokens)
            cores = self.cores_free_at[self.costs.host(stage)]
            core = min(range(len(cores)), key=cores.__getitem__)
            end = max(arrival, self.free_at[stage], cores[core]) + compute
            cores[core] = end
            self.free_at[stage] = end
            self.busy[stage] += compute
            boundaries.append(end)
            arrival = end + self.costs.hop_seconds(stage + 1, tokens)
        return boundaries, arrival


class _Drafter:
    """A drafter beside one stage: drafts from ``speculate`` until ``collect``."""

    def __init__(self, seconds_per_token: float, draft_max: int, outcomes: DraftOutcomes, rng: random.Random):
        self.seconds_per_token = seconds_per_token
        self.draft_max = draft_max
        self.outcomes = outcomes
        self.rng = rng
        self.started = 0.0
        self.tokens: list[bool] = []  # what it would draft before stopping by itself: right or wrong

    def speculate(self, at: float, position: int, prefix_right: bool, fresh: bool) -> None:
        """Start drafting generated tokens from ``position`` on."""
        self.started = at
        self.tokens = []
        right = prefix_right
        while len(self.tokens) < self.draft_max:
            token = self.outcomes.draw(position + len(self.tokens), right, fresh and not self.tokens, self.rng)
            if token is None:
                break
            right = right and token
            self.tokens.append(right)

    def collect(self, at: float, wait: bool) -> tuple[list[bool], float]:
        """(the tokens drafted by ``at``, right or wrong; when the reply is ready)."""
        if wait:
            return self.tokens, max(at, self.started + len(self.tokens) * self.seconds_per_token)
        if self.seconds_per_token <= 0:
            return self.tokens, at
        done = int(max(0.0, at - self.started) / self.seconds_per_token)
        return self.tokens[:done], at


def simulate(costs: PipelineCosts, mode: Mode, behaviour: DraftOutcomes, max_tokens: int, seed: int = 0) -> SimulatedRun:
    """One generation of max_tokens tokens, from the first generated token on
    (the prompt's pass is not simulated; its drafting fills the first speculation)."""
    rng = random.Random(seed)
    count = costs.stage_count
    stages = _Stages(costs)
    drafters = [_Drafter(costs.draft_seconds(machine), mode.draft_max, behaviour, rng) for machine in range(count)]
    run = SimulatedRun(tokens=1, seconds=0.0)

    def speculate(drafter: _Drafter, at: float, speculation: list[bool]) -> None:
        drafter.speculate(at, committed + len(speculation), all(speculation), fresh=not speculation)

    def submit(at: float, first: int, first_input_right: bool, drafts: list[bool]) -> _Pass:
        boundaries, result_time = stages.run(at, 1 + len(drafts))
        return _Pass(first, drafts, first_input_right, boundaries, result_time)

    def receive(now: float, head: _Pass, speculation: list[bool]) -> float:
        """The coordinator waits for ``head``, relaying drafters (async) meanwhile."""
        call = costs.draft_call_seconds()
        if mode.schedule == "async":
            speculate(drafters[1 % count], now, speculation)
            for stage in range(count - 1):
                now = max(now, head.boundaries[stage])
                speculation.extend(drafters[(stage + 1) % count].collect(now, wait=False)[0])
                now += call
                speculate(drafters[(stage + 2) % count], now, speculation)
        now = max(now, head.result_time)
        if mode.schedule == "async":
            speculation.extend(drafters[0].collect(now, wait=False)[0])
            now += call
        return now + costs.coordinator_seconds(1 + len(head.drafts))

    speculative = mode.schedule != "plain"
    draft_limit = mode.draft_max
    speculation: list[bool] = []  # beyond the committed text; True = right
    in_flight: deque[_Pass] = deque()
    now = 0.0
    committed = 1  # generated tokens; the first came from the prompt's pass at time 0
    if mode.schedule == "async":  # the drafters relayed during the prompt's pass
        speculate(drafters[0], 0.0, speculation)
        speculation.extend(drafters[0].collect(0.0, wait=True)[0])
    on_a_roll = False
    # The target's end-of-generation token, where the workload knows it (a trace):
    # generation stops once a pass has produced it, like the real loop (which
    # counts neither it nor the time after the last real token).
    tokens_wanted = max_tokens if behaviour.end is None else min(max_tokens, behaviour.end)
    last = max_tokens if behaviour.end is None or behaviour.end >= max_tokens else behaviour.end + 1
    last_token_time = 0.0
    while committed < last:
        room = max_tokens - committed - 1
        if not in_flight:
            if speculative and (mode.schedule == "sync" or not speculation):
                speculation = []
                speculate(drafters[0], now, speculation)
                drafted, now = drafters[0].collect(now, wait=True)
                now += costs.draft_call_seconds()
                speculation = list(drafted)
            limit = min(draft_limit, room) if speculative else 0
            in_flight.append(submit(now, committed - 1, True, speculation[:limit]))
        head = in_flight[0]
        if mode.schedule == "async" and on_a_roll and len(in_flight) == 1:
            offset = len(head.drafts)  # index in speculation of the ahead pass's first input
            limit = min(draft_limit, room - (offset + 1))
            if len(speculation) > offset and limit >= 0:
                in_flight.append(
                    submit(now, head.first + offset + 1, speculation[offset], speculation[offset + 1 : offset + 1 + limit])
                )
        now = receive(now, head, speculation)
        in_flight.popleft()
        run.passes += 1
        accepted = 0
        while accepted < len(head.drafts) and head.drafts[accepted]:
            accepted += 1
        if committed < tokens_wanted:
            last_token_time = now
        committed += min(accepted + 1, last - committed)
        run.drafted_tokens += len(head.drafts)
        run.accepted_tokens += accepted
        on_a_roll = bool(head.drafts) and accepted == len(head.drafts)
        if speculative:
            draft_limit = next_draft_limit(draft_limit, len(head.drafts), accepted, mode.draft_max)
        # The speculation survives if it agrees with all newly committed tokens.
        agrees = accepted == len(head.drafts) and len(speculation) > accepted and speculation[accepted]
        speculation = speculation[accepted + 1 :] if agrees else []
        finished = committed >= last
        while in_flight and (finished or in_flight[0].first != committed - 1 or not in_flight[0].first_input_right):
            now = max(now, in_flight.popleft().result_time)  # received and discarded
            run.passes += 1
            run.discarded_passes += 1
    run.tokens = min(committed, tokens_wanted)
    run.seconds = last_token_time
    run.stage_busy_seconds = list(stages.busy)
    return run


def predict(costs: PipelineCosts, mode: Mode, behaviour: DraftOutcomes, max_tokens: int, runs: int = 32) -> Prediction:
    """Medians over ``runs`` simulated generations with different random draws."""
    results = [simulate(costs, mode, behaviour, max_tokens, seed) for seed in range(runs)]
    drafted = sum(result.drafted_tokens for result in results)
    return Prediction(
        mode=mode,
        tokens_per_second=statistics.median(result.tokens_per_second for result in results),
        passes_per_token=sum(result.passes for result in results) / sum(result.tokens for result in results),
        acceptance_rate=sum(result.accepted_tokens for result in results) / drafted if drafted else 0.0,
        discarded_passes_per_run=sum(result.discarded_passes for result in results) / runs,
        stage_busy_fraction=tuple(
            statistics.median(result.stage_busy_seconds[stage] / result.seconds for result in results if result.seconds)
            for stage in range(costs.stage_count)
        ),
    )
