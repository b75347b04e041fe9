"""Modes run side by side in one run: the repetition loop every probe shares
(benchmarks.probe), and the draft step the bench measures.

The loop: a warm-up of every mode where the caller gives one, then for each
repetition every mode in turn, starting one mode later each time (so no mode
always runs first on a warm machine, and a slow spell of the machine falls
on all of them alike). Each run gives its figures (name -> value) and, where
the modes must agree, an output, checked against the first mode's of the
same repetition. Every figure is reported the same way: its median over the
repetitions and their range, ``median (min-max)``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field


def draft_steps(pipeline) -> dict[bool, float]:
    """The draft policy's batch cost, measured as the bench measures it: for
    stages pinned as for passes that do not overlap (False) and that do (True)."""
    steps = {}
    for overlapping in (False, True):
        pipeline.pin_stages(overlapping)
        steps[overlapping] = pipeline.draft_step()
    return steps


@dataclass(frozen=True)
class Outcome:
    """One run of one mode: its figures and, where modes must agree, its output."""

    figures: dict[str, float]
    output: object = None


@dataclass
class Samples:
    """Every figure of every mode, one value per repetition, in repetition order."""

    modes: list[str]
    repetitions: int = 0
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # mode -> figure -> values

    def add(self, mode: str, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            self.values.setdefault(mode, {}).setdefault(name, []).append(value)

    def of(self, mode: str, figure: str) -> list[float]:
        return self.values[mode][figure]

    def figures(self, mode: str) -> list[str]:
        return list(self.values.get(mode, {}))

    def median(self, mode: str, figure: str) -> float:
        return statistics.median(self.of(mode, figure))

    def spread(self, mode: str, figure: str, scale: float = 1.0, digits: int = 2) -> str:
        return spread(self.of(mode, figure), scale, digits)

    def as_json(self) -> dict:
        return {mode: {name: {"median": statistics.median(values), "min": min(values), "max": max(values),
                              "values": values}
                       for name, values in figures.items()}
                for mode, figures in self.values.items()}


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``median (min-max)`` of values times scale."""
    scaled = [value * scale for value in values]
    return f"{statistics.median(scaled):.{digits}f} ({min(scaled):.{digits}f}-{max(scaled):.{digits}f})"


def side_by_side(modes: list[str], repetitions: int, run: Callable[[str, int], Outcome],
                 warm_up: Callable[[str], object] | None = None) -> Samples:
    """run(mode, repetition) -> Outcome, for every mode in every repetition,
    the order rotating by one mode a repetition. SystemExit if two modes'
    outputs (those not None) differ within a repetition."""
    if warm_up is not None:
        for mode in modes:
            warm_up(mode)
    samples = Samples(list(modes), repetitions)
    for repetition in range(repetitions):
        shift = repetition % len(modes)
        outputs = {}
        for mode in modes[shift:] + modes[:shift]:
            outcome = run(mode, repetition)
            samples.add(mode, outcome.figures)
            if outcome.output is not None:
                outputs[mode] = outcome.output
        first = next((outputs[mode] for mode in modes if mode in outputs), None)
        if any(output != first for output in outputs.values()):
            raise SystemExit(f"repetition {repetition + 1}: the modes produced different outputs")
    return samples
