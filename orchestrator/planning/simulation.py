"""A discrete-event simulation of the coordinator's decoding loop.

It turns the real decoding loop (orchestrator.decoding.loop) against
simulated stages and drafters: the same windows, drafting, discards, cancels
and draft policy; only time is virtual, from a cost model (``PipelineCosts``).
No formula for tokens/s is assumed: throughput is what the simulated clock
shows. Several sequences may share passes (``simulate_many``).

Resources and their timelines:

* each stage runs one pass at a time, in submission order, on a free core of
  its machine (stages sharing a machine with fewer cores wait for one);
* hop 0 carries a pass to stage 0, hop i from stage i - 1 to stage i, hop n
  the result back; the coordinator then does its own work;
* a cancelled pass reaches every stage at once: one that has not started
  it skips it, the one running it stops, and the cancellation travels on at
  the hops' one-token cost; only the pass last submitted is cancelled so;
* one drafter per machine drafts from ``speculate`` until collected, a
  token per ``draft_seconds``, stopping by itself (``availability``,
  ``continuation``) and after ``chain_reach(draft_max)``.

Which drafts are right comes from the workload: rates (``DraftBehaviour``),
or a real output replayed (``DraftTrace``; tests/pure/test_planning.py
checks it makes the same passes, drafts and discards as generate()). Token
trees (``Mode.tree_leaves`` > 1) come from a trace's record of prompt
lookup's other candidates (``DraftTrace.forks``; where the right token is
among them, those ranked after it are not counted; off the true text, no
fork is offered). Branch windows (``Mode.branches``) are chains: corrections
are not simulated. Pure Python, no Ray, no llama.cpp.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.config import DRAFT_MAX, chain_reach
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import Decoding, DecodingLoop, Listener, sequence_state
from orchestrator.decoding.schedule import Schedule, SequenceState
from orchestrator.decoding.windows import TargetPass, Window
from speculators.draft_length import DRAFTER_CALL_COST, DraftPrices, step_from_timings
from speculators.tree import DraftTree, lookup_tree

class PipelineCosts(Protocol):
    """Seconds for everything the schedule waits on."""

    stage_count: int

    def stage_seconds(self, stage: int, tokens: int) -> float:
        """One stage's compute for a pass of ``tokens`` tokens."""

    def hop_seconds(self, hop: int, tokens: int) -> float:
        """Hop ``hop`` (0: coordinator to stage 0; i: stage i-1 to i; n: last stage
        to the coordinator, carrying the tokens chosen beside the last stage)."""

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
    forks: tuple[tuple[int, int], ...] = ()  # by position: (other candidates, which of them is right, 0: none)

    SYMBOLS = {True: "R", False: "w", None: "."}
    MOST_FORKS = 9

    @classmethod
    def replay(cls, propose: Callable[[list[int]], int | None], prompt: list[int], output: list[int],
               candidates: Callable[[list[int]], list[int]] | None = None) -> DraftTrace:
        """Ask a drafter (``propose``: context -> next token or None) for each
        token of ``output`` given the prompt and the output before it; with
        ``candidates`` (context -> ranked tokens, the first ``propose``'s), also
        its other candidates there (``forks``)."""
        proposals: list[bool | None] = [None]  # token 0 comes from the prompt's pass
        forks: list[tuple[int, int]] = [(0, 0)]
        for position in range(1, len(output)):
            context = prompt + output[:position]
            proposal = propose(context)
            proposals.append(None if proposal is None else proposal == output[position])
            if candidates is not None:
                others = [token for token in candidates(context) if token != proposal][: cls.MOST_FORKS]
                right = others.index(output[position]) + 1 if output[position] in others else 0
                forks.append((right if right else len(others), right))
        return cls(tuple(proposals), tuple(forks) if candidates is not None else ())

    def as_text(self) -> str:
        """One character a token: R right, w wrong, . nothing proposed; with
        forks, then "|" and one character a token: the number of other
        candidates when none is right, else a letter for the right one (a:
        the first other candidate)."""
        text = "".join(self.SYMBOLS[proposal] for proposal in self.proposals)
        if not self.forks:
            return text
        return text + "|" + "".join(chr(ord("a") + right - 1) if right else str(count) for count, right in self.forks)

    @classmethod
    def from_text(cls, text: str) -> DraftTrace:
        proposals_text, _, forks_text = text.partition("|")
        meaning = {symbol: proposal for proposal, symbol in cls.SYMBOLS.items()}
        unknown = set(proposals_text) - set(meaning)
        if unknown:
            raise ValueError(f"a draft trace holds only R, w and . (found {sorted(unknown)[0]!r})")
        forks = []
        for symbol in forks_text:
            if symbol.isdigit():
                forks.append((int(symbol), 0))
            elif "a" <= symbol < chr(ord("a") + cls.MOST_FORKS):
                right = ord(symbol) - ord("a") + 1
                forks.append((right, right))
            else:
                raise ValueError(f"a draft trace's forks hold only digits and a-i (found {symbol!r})")
        if forks and len(forks) != len(proposals_text):
            raise ValueError(f"a draft trace of {len(proposals_text)} tokens with {len(forks)} forks")
        return cls(tuple(meaning[symbol] for symbol in proposals_text), tuple(forks))

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
    """A schedule (a ``Schedule`` or its name), its draft_max, and what the
    draft policy prices (orchestrator.decoding.loop.Drafting): asking the drafter
    before a window (call_cost), and each extra token of a pass, in one-token
    passes (step; None: from the costs, as a run measures it before it
    starts, ``pass_step``)."""

    schedule: Schedule
    draft_max: int = DRAFT_MAX
    call_cost: float = DRAFTER_CALL_COST
    step: float | None = None
    tree_leaves: int = 1  # above 1: prompt lookup's token trees (from a trace's forks)
    side_row_step: float | None = None  # the tree rule's price of a side row (None: the step)
    draft_prices: DraftPrices | None = None  # a draft token's (None: awaited from the costs, ``wait_cost``; relayed 0)
    branches: bool = False  # async windows kept across rejections where passes are flat (Drafting.branches)

    def __post_init__(self):
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.draft_max < 1:
            raise ValueError("draft_max must be at least 1")
        if self.tree_leaves < 1:
            raise ValueError("tree_leaves must be at least 1")


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
    tree_passes: int = 0
    side_accepted: int = 0

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


class _Stages:
    """The stages' timelines: each runs one pass at a time, in order, on a
    free core of its host."""

    def __init__(self, costs: PipelineCosts):
        self.costs = costs
        self.free_at = [0.0] * costs.stage_count
        self.busy = [0.0] * costs.stage_count
        hosts = {costs.host(stage) for stage in range(costs.stage_count)}
        self.cores_free_at = {host: [0.0] * (costs.parallel_stages(host) or costs.stage_count) for host in hosts}

        self._last: _Timeline | None = None  # the pass submitted last, while it can still be cancelled

    def run(self, submitted: float, tokens: int) -> _Timeline:
        arrival = submitted + self.costs.hop_seconds(0, tokens)
        timeline = _Timeline([], 0.0, [], [], [])
        for stage in range(self.costs.stage_count):
            compute = self.costs.stage_seconds(stage, tokens)
            cores = self.cores_free_at[self.costs.host(stage)]
            ready = max(arrival, self.free_at[stage])  # the core it starts on soonest, of those the one free latest
            core = min(range(len(cores)), key=lambda core: (max(ready, cores[core]), -cores[core]))
            start = max(ready, cores[core])
            end = start + compute
            timeline.before.append((self.free_at[stage], cores[core]))
            timeline.starts.append(start)
            timeline.cores.append(core)
            cores[core] = end
            self.free_at[stage] = end
            self.busy[stage] += compute
            timeline.boundaries.append(end)
            arrival = end + self.costs.hop_seconds(stage + 1, tokens)
        timeline.result = arrival
        self._last = timeline
        return timeline

    def cancel(self, timeline: _Timeline, at: float) -> _Timeline:
        """The pass of ``timeline`` is cancelled at ``at``: what it becomes
        (unchanged unless it is the pass submitted last and not done by then)."""
        if timeline is not self._last or timeline.result <= at:
            return timeline
        self._last = None
        stages = range(self.costs.stage_count)
        done = [end <= at for end in timeline.boundaries]
        stopped = [not done[stage] and timeline.starts[stage] < at for stage in stages]
        for stage in reversed(stages):  # undone in reverse, as stages sharing a core took it in order
            if done[stage]:
                continue
            cores = self.cores_free_at[self.costs.host(stage)]
            end = timeline.boundaries[stage]
            if stopped[stage]:
                self.busy[stage] -= end - at
                self.free_at[stage] = cores[timeline.cores[stage]] = at
            else:
                self.busy[stage] -= end - timeline.starts[stage]
                self.free_at[stage], cores[timeline.cores[stage]] = timeline.before[stage]
        cancelled = _Timeline([], 0.0, timeline.starts, timeline.cores, timeline.before)
        arrival = at  # where the cancellation is, once it has left the stage that dropped or stopped it
        for stage in stages:
            if done[stage]:
                cancelled.boundaries.append(timeline.boundaries[stage])
                continue
            leaves = max(arrival, self.free_at[stage])  # a stopped stage: at, as it is free from then on
            cancelled.boundaries.append(leaves)
            arrival = leaves + self.costs.hop_seconds(stage + 1, 1)
        cancelled.result = arrival
        return cancelled


@dataclass
class _Timeline:
    """A pass's times: when it left each stage (boundaries) and when its result
    came back; and, to undo it, where it started on each stage, on which core,
    and when that stage and core were free before it."""

    boundaries: list[float]
    result: float
    starts: list[float]
    cores: list[int]
    before: list[tuple[float, float]]


# The simulated text: the true token at generated position p is _TRUE + p, a
# wrong draft is _WRONG (a tree's other wrong candidates 2 .. _TRUE - 1), and
# the target ends the text with _END (traces only).
_END, _WRONG, _TRUE = 0, 1, 16


def _on_truth(context: list[int]) -> bool:
    """Whether every token of ``context`` is the true one. Only its last is
    looked at: a wrong token (below _TRUE) is only ever followed by wrong ones
    (the drafters and the lookup draw nothing right after it, and the target's
    choices are committed after true text only), so a context whose last token
    is true is true throughout. Checking all of it made the planner's search
    quadratic in the text's length (26 million comparisons in one plan; the
    405B plan took 10.8 s, now 9.5 s here, its output byte-identical)."""
    return not context or context[-1] == _TRUE + len(context) - 1


class _TraceLookup:
    """Prompt lookup over the simulated text as a trace recorded it, for
    speculators.tree.lookup_tree: ``extend`` and ``candidates``."""

    def __init__(self, trace: DraftTrace):
        self.trace = trace

    def extend(self, context: list[int]) -> int | None:
        if not _on_truth(context):
            return _WRONG  # after a wrong token, only wrong ones (as DraftTrace.draw)
        position = len(context)
        proposal = self.trace.proposals[position] if position < len(self.trace.proposals) else None
        return None if proposal is None else _TRUE + position if proposal else _WRONG

    def candidates(self, context: list[int]) -> list[int]:
        main = self.extend(context)
        if main is None or not _on_truth(context):
            return [] if main is None else [main]
        position = len(context)
        count, right = self.trace.forks[position] if position < len(self.trace.forks) else (0, 0)
        return [main, *(_TRUE + position if rank == right else _WRONG + rank for rank in range(1, count + 1))]


@dataclass
class _Clock:
    """The simulation's virtual time, shared by its target, its drafters and the loop."""

    now: float = 0.0


class _SimulatedDrafter:
    """A drafter beside one stage, in virtual time: drafts from ``speculate``
    until ``collect``, one token per ``seconds_per_token``; every collect
    costs the coordinator a round trip (``call_seconds``)."""

    def __init__(self, clock: _Clock, seconds_per_token: float, call_seconds: float, draft_max: int,
                 outcomes: DraftOutcomes, rng: random.Random):
        self.clock = clock
        self.seconds_per_token = seconds_per_token
        self.call_seconds = call_seconds
        self.draft_max = draft_max
        self.outcomes = outcomes
        self.rng = rng
        self.state: SequenceState | None = None  # the sequence it drafts for (set once made)
        self.started = 0.0
        self.context: list[int] = []
        self.most: int | None = None
        self.tokens: list[int] = []  # what it would draft before stopping by itself

    def speculate(self, context: list[int], most: int | None = None, sampling=None, tree=None) -> None:
        """Start drafting after ``context`` (the committed text, or it and the speculation)."""
        fresh = len(context) == len(self.state.committed)  # type: ignore[union-attr]
        right = _on_truth(context)
        self.started, self.context, self.most = self.clock.now, list(context), most
        self.tokens = []
        reach = chain_reach(self.draft_max)
        while len(self.tokens) < min(reach, most or self.draft_max):
            drawn = self.outcomes.draw(len(context) + len(self.tokens), right, fresh and not self.tokens, self.rng)
            if drawn is None:
                break
            right = right and drawn
            self.tokens.append(_TRUE + len(context) + len(self.tokens) if right else _WRONG)

    def ask(self) -> None:
        pass  # its collect's round trip is priced at the collect

    def peek(self, everything: bool = False) -> list[int]:
        """The tokens drafted by now (everything: all it will), drafting on; a round trip."""
        step = self.seconds_per_token
        count = len(self.tokens) if everything or step <= 0 else int(max(0.0, self.clock.now - self.started) / step)
        self.clock.now += self.call_seconds
        return list(self.tokens[:count])

    def collect(self, wait: bool = False) -> list[int]:
        """The tokens drafted by now (with ``wait``: all, once drafted); the
        speculation ends here, as a drafter stops at a collect: another
        collect without a speculate in between gets nothing."""
        if wait:
            self.clock.now = max(self.clock.now, self.started + len(self.tokens) * self.seconds_per_token)
        drafted, self.tokens = self.peek(everything=wait), []
        return drafted

    def collect_tree(self, leaves: int) -> DraftTree:
        """A token tree from the committed text, as InstantDrafter.collect_tree drafts it."""
        limit = min(self.draft_max, self.most or self.draft_max)
        tree = lookup_tree(_TraceLookup(self.outcomes), self.context, limit, 2 * limit, leaves - 1)  # type: ignore[arg-type]
        self.clock.now += (len(tree.tokens) - 1) * self.seconds_per_token + self.call_seconds
        return tree


@dataclass(frozen=True)
class _Result:
    """A simulated pass's result: each stage's seconds on it (its tokens come from the text: _target_tokens)."""

    stage_seconds: tuple[float, ...] = ()
    stage_started: tuple[float, ...] = ()


class _SimulatedTarget:
    """The stages in virtual time: a pass's result comes when its timeline says."""

    n_batch = 1 << 30

    def __init__(self, costs: PipelineCosts, clock: _Clock):
        self.stages = _Stages(costs)
        self.stage_count = costs.stage_count
        self.clock = clock
        self.timings: deque[tuple[TargetPass, _Timeline]] = deque()  # each pass in flight, in submission order

    def submit(self, target_pass: TargetPass) -> None:
        self.timings.append((target_pass, self.stages.run(self.clock.now, target_pass.tokens)))

    def cancel(self, target_pass: TargetPass) -> None:
        index = next(index for index, (flying, _) in enumerate(self.timings) if flying is target_pass)
        self.timings[index] = (target_pass, self.stages.cancel(self.timings[index][1], self.clock.now))

    def result_within(self, seconds: float) -> bool:
        """Whether the oldest result comes within ``seconds``; if not, those seconds pass."""
        if self.timings[0][1].result <= self.clock.now + seconds:
            return True
        self.clock.now += seconds
        return False

    def receive(self) -> _Result:
        _, timeline = self.timings.popleft()
        self.clock.now = max(self.clock.now, timeline.result)
        return _Result(tuple(end - start for end, start in zip(timeline.boundaries, timeline.starts)))

    def release(self, sequence: int) -> None:
        """Nothing to free."""

    def copy(self, source: int, destination: int, length: int) -> None:
        """Nothing to copy."""


class _Timekeeper(Listener):
    """The coordinator's own work after each verified window, and when a sequence's last token came."""

    def __init__(self, costs: PipelineCosts, clock: _Clock):
        self.costs = costs
        self.clock = clock
        self.last_token_time = 0.0

    def verified(self, window: Window, tokens: list[int]) -> None:
        self.clock.now += self.costs.coordinator_seconds(len(window.inputs))
        if tokens:
            self.last_token_time = self.clock.now


def _pass_seconds(costs: PipelineCosts, tokens: int) -> float:
    """The wall time of a pass of ``tokens`` tokens: its hops and stages."""
    return (sum(costs.hop_seconds(hop, tokens) for hop in range(costs.stage_count + 1))
            + sum(costs.stage_seconds(stage, tokens) for stage in range(costs.stage_count)))


def pass_step(costs: PipelineCosts, batch: int = 8) -> float:
    """What each extra token costs a pass, in one-token passes, as Pipeline.draft_step measures it."""
    return step_from_timings([_pass_seconds(costs, 1)], [_pass_seconds(costs, batch)], batch)


def wait_cost(costs: PipelineCosts) -> float:
    """A draft token of the drafter beside stage 0, in one-token passes, as a run prices it awaited (draft_prices)."""
    return costs.draft_seconds(0) / _pass_seconds(costs, 1)


def _target_tokens(window, end: int | None) -> list[int]:
    """What verifying a window commits: the drafts on the true text (a
    tree's path along it), then the target's own token."""
    rows = window.inputs[window.refed:]
    parents = window.parents or tuple(range(-1, len(rows) - 1))
    committed, row = [], 0
    position = window.first + window.refed + 1  # what the root row predicts
    while end is None or position < end:
        following = next((child for child in range(row + 1, len(rows))
                          if parents[child] == row and rows[child] == _TRUE + position), None)
        if following is None:
            break
        committed.append(rows[following])
        row, position = following, position + 1
    return [*committed, _END if end is not None and position >= end else _TRUE + position]


def simulate(costs: PipelineCosts, mode: Mode, behaviour: DraftOutcomes, max_tokens: int, seed: int = 0) -> SimulatedRun:
    """One generation of max_tokens tokens (see simulate_many)."""
    return simulate_many(costs, mode, [behaviour], max_tokens, seed)[0]


def simulate_many(costs: PipelineCosts, mode: Mode, workloads: list[DraftOutcomes], max_tokens: int,
                  seed: int = 0) -> list[SimulatedRun]:
    """Generations of max_tokens tokens, one per workload, decoded at once
    (their windows share passes), from the first generated token on: the
    prompt's pass is not simulated; as in the real loop, the first window
    waits for the drafter beside stage 0.
    The loop is orchestrator.decoding.loop's own, turned against simulated
    stages and drafters in virtual time."""
    if max_tokens < 2:  # the first token is where the simulation starts: it would never end
        raise ValueError(f"max_tokens must be at least 2, not {max_tokens}")
    rng = random.Random(seed)
    clock = _Clock()
    target = _SimulatedTarget(costs, clock)
    step = pass_step(costs) if mode.step is None else mode.step
    prices = DraftPrices(awaited=wait_cost(costs)) if mode.draft_prices is None else mode.draft_prices
    ends = [workload.end for workload in workloads]
    loop = DecodingLoop(target, lambda token: token == _END, clock=lambda: clock.now,
                        choose=lambda reply, window, rows: _target_tokens(window, ends[window.sequence]))
    keepers = []
    for index, workload in enumerate(workloads):
        tree_leaves = mode.tree_leaves if mode.tree_leaves > 1 and getattr(workload, "forks", ()) else 1
        drafters = [_SimulatedDrafter(clock, costs.draft_seconds(machine), costs.draft_call_seconds(), mode.draft_max,
                                      workload, rng) for machine in range(costs.stage_count)]
        drafting = Drafting(drafters, mode.schedule, mode.draft_max, call_cost=mode.call_cost, step=step,
                            tree_leaves=tree_leaves, side_row_step=mode.side_row_step, draft_prices=prices,
                            branches=mode.branches)
        state = sequence_state(index, [_TRUE], max_tokens, None, drafting, target, begun=True)
        for drafter in drafters:
            drafter.state = state
        keepers.append(_Timekeeper(costs, clock))
        loop.add(Decoding(state, drafting if mode.schedule.speculative else None, keepers[-1]))
    loop.run()
    return [
        SimulatedRun(tokens=state.generated, seconds=keeper.last_token_time, passes=state.passes,
                     discarded_passes=state.stats.discarded_passes, drafted_tokens=state.stats.drafted_tokens,
                     accepted_tokens=state.stats.accepted_tokens, stage_busy_seconds=list(target.stages.busy),
                     tree_passes=state.stats.tree_passes, side_accepted=state.stats.side_accepted)
        for state, keeper in zip((decoding.state for decoding in loop.decodings.values()), keepers)
    ]


def predict(costs: PipelineCosts, mode: Mode, behaviour: DraftOutcomes, max_tokens: int, runs: int = 32) -> Prediction:
    """Medians over ``runs`` simulated generations with different random draws."""
    if runs < 1:
        raise ValueError(f"a prediction needs at least one run, not {runs}")
    results = [simulate(costs, mode, behaviour, max_tokens, seed) for seed in range(runs)]
    drafted = sum(result.drafted_tokens for result in results)
    return Prediction(
        mode=mode, tokens_per_second=statistics.median(result.tokens_per_second for result in results),
        passes_per_token=sum(result.passes for result in results) / sum(result.tokens for result in results),
        acceptance_rate=sum(result.accepted_tokens for result in results) / drafted if drafted else 0.0,
        discarded_passes_per_run=sum(result.discarded_passes for result in results) / runs,
        stage_busy_fraction=tuple(
            statistics.median(result.stage_busy_seconds[stage] / result.seconds for result in results if result.seconds)
            for stage in range(costs.stage_count)
        ),
    )
