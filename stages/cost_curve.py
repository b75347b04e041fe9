"""What a pass costs as a function of its width: measured batch curves, and
the emulated cost curve of the machines a huge model runs on. Pure Python.

This 2-core CPU is compute-bound (a pass of 8 tokens costs 4-6x one); the
machines a 405B runs on are memory-bound (8-64 tokens cost about what one
does). To measure the loop in that regime here, a stage can be given a
``CostCurve``: every pass then lasts at least the curve's time for its width
and context, the stage sleeping the rest after llama.cpp's real compute
(``orchestrator.workers.stage_server``), and a draft model's step likewise.
The tokens are untouched: only time is added. Every figure made so says
"emulated" and names the curve (``CostCurve.name``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from stages.errors import SpecpipeError


@dataclass(frozen=True)
class BatchCurve:
    """Seconds for a batch of n tokens, measured at ``sizes``; linear in n
    between them and beyond the largest (a batch's cost grows with n once the
    arithmetic, not the weight reads, dominates)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if len(self.sizes) != len(self.seconds) or not self.sizes or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError("a batch curve needs increasing sizes, one time each")

    def at(self, tokens: int) -> float:
        sizes, seconds = self.sizes, self.seconds
        if len(sizes) == 1 or tokens <= sizes[0]:
            return seconds[0]
        index = min(bisect.bisect_left(sizes, tokens), len(sizes) - 1)
        low, high = index - 1, index
        slope = (seconds[high] - seconds[low]) / (sizes[high] - sizes[low])
        return seconds[low] + slope * (tokens - sizes[low])

    def scaled(self, factor: float) -> BatchCurve:
        return BatchCurve(self.sizes, tuple(value * factor for value in self.seconds))


@dataclass(frozen=True)
class StageCurve:
    """One stage's emulated pass: ``batch`` gives seconds for a pass of n
    tokens (summed over its sequences), plus ``context_seconds`` for every
    position of context the pass attends to (the KV cache read once per
    pass, as on a memory-bound machine)."""

    batch: BatchCurve
    context_seconds: float = 0.0

    def seconds(self, tokens: int, context: int) -> float:
        """The least time a pass of ``tokens`` tokens ending at position
        ``context`` - 1 takes; a pass of no tokens (a release) takes none."""
        if tokens <= 0:
            return 0.0
        return self.batch.at(tokens) + self.context_seconds * context

    def scaled(self, factor: float) -> StageCurve:
        return StageCurve(self.batch.scaled(factor), self.context_seconds * factor)


class CostCurveError(SpecpipeError):
    """A cost curve that does not fit the pipeline it is given to."""


@dataclass(frozen=True)
class CostCurve:
    """The emulated costs of a pipeline (orchestrator.planning.curves reads one).

    name: what every figure made under it names (e.g. "llama-405b-two-machines
    at 40 ms"); stages: one curve per stage, in pipeline order, or one for
    every stage; whole: instead, the whole model's curve, each of n stages
    taking 1/n of it (a device check's t(n), measured on the whole model);
    draft_seconds: a draft model's step (one drafted token)."""

    name: str
    stages: tuple[StageCurve, ...] = ()
    whole: StageCurve | None = None
    draft_seconds: float = 0.0

    def __post_init__(self):
        if bool(self.stages) == (self.whole is not None):
            raise ValueError("a cost curve has per-stage curves or the whole model's, one of the two")

    def check(self, stage_count: int) -> None:
        """Raise CostCurveError unless the curve can time a pipeline of ``stage_count`` stages."""
        if self.whole is None and len(self.stages) not in (1, stage_count):
            raise CostCurveError(f"the cost curve {self.name!r} has {len(self.stages)} stages, the pipeline "
                                 f"{stage_count}")

    def stage(self, index: int, count: int) -> StageCurve:
        """Stage ``index``'s curve in a pipeline of ``count`` stages."""
        self.check(count)
        if self.whole is not None:
            return self.whole.scaled(1.0 / count)
        return self.stages[0] if len(self.stages) == 1 else self.stages[index]
