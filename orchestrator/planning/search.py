"""Choose a split and a draft length by simulating each candidate.

A ``Setup`` says what is given: the model, the machines in pipeline order,
the links between them, this project's software costs, the draft's cost on
each machine and how often its tokens are right. ``recommend`` searches the
splits that fit in every machine's memory, simulates the plain pipeline and
both speculative schedules for each draft length, and returns the best. Pure
Python over orchestrator.planning.simulation; no Ray, no llama.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.config import (MEMORY_HEADROOM, PLAN_EVERY_SPLIT_LIMIT, PLAN_FINAL_RUNS, PLAN_GRID_SPLITS,
                                 PLAN_SEARCH_RUNS, PLAN_TIE)
from orchestrator.decoding.schedule import Schedule
from orchestrator.planning.inputs import PlanError, Setup
from orchestrator.planning.simulation import DraftBehaviour, Mode, Prediction, predict


@dataclass(frozen=True)
class Recommendation:
    """The chosen split (starts of each stage) and, per mode, the prediction at
    its best draft length. memory: bytes needed on each machine."""

    starts: tuple[int, ...]
    blocks_per_machine: tuple[int, ...]
    memory_needed: tuple[int, ...]
    predictions: dict[str, Prediction]

    @property
    def best(self) -> Prediction:
        return max(self.predictions.values(), key=lambda prediction: prediction.tokens_per_second)


def memory_needed(setup: Setup, starts: tuple[int, ...]) -> tuple[int, ...]:
    costs = setup.costs(starts)
    return tuple(costs.memory_needed(stage, setup.context, setup.draft_bytes) for stage in range(len(starts)))


def fits(setup: Setup, starts: tuple[int, ...]) -> bool:
    return all(need <= MEMORY_HEADROOM * machine.memory_bytes
               for need, machine in zip(memory_needed(setup, starts), setup.machines))


def candidate_splits(blocks: int, machines: int, step: int) -> list[tuple[int, ...]]:
    """Every split into ``machines`` non-empty stages whose boundaries are
    multiples of ``step`` (1 gives every split)."""
    if machines == 1:
        return [(0,)]
    splits: list[tuple[int, ...]] = []

    def extend(starts: tuple[int, ...], remaining: int) -> None:
        if remaining == 0:
            splits.append(starts)
            return
        lowest = starts[-1] + 1
        highest = blocks - remaining
        for start in range(lowest, highest + 1):
            if start % step == 0:
                extend(starts + (start,), remaining - 1)

    extend((0,), machines - 1)
    return splits


def _modes(setup: Setup, draft_max: int) -> list[Mode]:
    modes = [Mode(Schedule.PLAIN)]
    if setup.behaviour is not None:
        modes += [Mode(Schedule.SYNC, draft_max), Mode(Schedule.ASYNC, draft_max)]
    return modes


def _score(setup: Setup, starts: tuple[int, ...], runs: int) -> float:
    """Best tokens/s over the modes, at the middle draft length."""
    costs = setup.costs(starts)
    behaviour = setup.behaviour or DraftBehaviour(0.0)
    middle = sorted(setup.draft_lengths)[len(setup.draft_lengths) // 2]
    return max(predict(costs, mode, behaviour, setup.max_tokens, runs).tokens_per_second
               for mode in _modes(setup, middle))


def memory_proportional(setup: Setup) -> tuple[int, ...]:
    """Blocks in proportion to each machine's memory (a starting point that fits
    where anything does, when a coarse grid misses every fitting split)."""
    total = sum(machine.memory_bytes for machine in setup.machines)
    starts, held = [0], 0.0
    for machine in setup.machines[:-1]:
        held += machine.memory_bytes
        starts.append(max(starts[-1] + 1, round(setup.model.blocks * held / total)))
    return tuple(starts)


def choose_split(setup: Setup) -> tuple[int, ...]:
    """The fitting split with the highest simulated throughput: a coarse grid
    of boundaries, then single-boundary moves around the best of it."""
    count, blocks = len(setup.machines), setup.model.blocks
    if setup.starts is not None:
        if len(setup.starts) != count:
            raise PlanError(f"the split has {len(setup.starts)} stages but the setup has {count} machines")
        if not fits(setup, setup.starts):
            raise PlanError(f"the split {list(setup.starts)} does not fit in the machines' memory")
        return setup.starts
    if blocks < count:
        raise PlanError(f"{blocks} blocks cannot be split over {count} machines")
    step = 1  # boundaries on multiples of step: a grid of at most PLAN_GRID_SPLITS splits
    while math.comb((blocks - 1) // step, count - 1) > PLAN_GRID_SPLITS:
        step += 1
    grid = [starts for starts in [*candidate_splits(blocks, count, step), memory_proportional(setup)]
            if fits(setup, starts)]
    if not grid and math.comb(blocks - 1, count - 1) <= PLAN_EVERY_SPLIT_LIMIT:
        grid = [starts for starts in candidate_splits(blocks, count, 1) if fits(setup, starts)][:200]
    if not grid:
        largest = max(machine.memory_bytes for machine in setup.machines)
        total = memory_needed(setup, (0,))[0] if count == 1 else sum(memory_needed(setup, tuple(range(count))))
        raise PlanError(
            f"{setup.model.name} does not fit: no split of {blocks} blocks over {count} machines leaves each within "
            f"{MEMORY_HEADROOM:.0%} of its memory (largest machine {largest / 1e9:.0f} GB; about "
            f"{total / 1e9:.0f} GB needed in all with KV cache and drafts)"
        )
    scored = {starts: _score(setup, starts, PLAN_SEARCH_RUNS) for starts in grid}
    # Then move one boundary at a time within a grid step of the best, while that helps.
    for _ in range(3):
        best = max(scored, key=scored.get)
        for boundary in range(1, count):
            for start in range(best[boundary] - step + 1, best[boundary] + step):
                starts = best[:boundary] + (start,) + best[boundary + 1:]
                if starts not in scored and list(starts) == sorted(set(starts)) and 0 < start < blocks \
                        and fits(setup, starts):
                    scored[starts] = _score(setup, starts, PLAN_SEARCH_RUNS)
        if max(scored, key=scored.get) == best:
            break
    # Splits within PLAN_TIE of the fastest are equal within the simulation's noise
    # (a one-pass-at-a-time pipeline costs the sum of its stages wherever the
    # cut is): take the one that leaves the most memory free on its fullest machine.
    fastest = max(scored.values())
    close = [starts for starts, score in scored.items() if score >= fastest * (1 - PLAN_TIE)]
    return min(close, key=lambda starts: max(
        need / machine.memory_bytes for need, machine in zip(memory_needed(setup, starts), setup.machines)))


def predict_modes(setup: Setup, starts: tuple[int, ...], runs: int = PLAN_FINAL_RUNS) -> dict[str, Prediction]:
    """Plain pipeline, and each speculative schedule at its best draft length."""
    costs = setup.costs(starts)
    behaviour = setup.behaviour or DraftBehaviour(0.0)
    predictions = {Schedule.PLAIN.value: predict(costs, Mode(Schedule.PLAIN), behaviour, setup.max_tokens, runs)}
    if setup.behaviour is not None:
        for schedule in (Schedule.SYNC, Schedule.ASYNC):
            options = [predict(costs, Mode(schedule, length), behaviour, setup.max_tokens, runs)
                       for length in setup.draft_lengths]
            predictions[schedule.value] = max(options, key=lambda prediction: prediction.tokens_per_second)
    return predictions


def recommend(setup: Setup) -> Recommendation:
    starts = choose_split(setup)
    blocks = tuple(end - first for first, end in (setup.costs(starts).stage_range(stage) for stage in range(len(starts))))
    return Recommendation(starts, blocks, memory_needed(setup, starts), predict_modes(setup, starts))
