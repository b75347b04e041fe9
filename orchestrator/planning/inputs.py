"""What a plan is given: the model, the machines, their links, the software's
costs, the draft's cost and behaviour. Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.config import PLAN_DRAFT_LENGTHS
from orchestrator.planning.costs import Link, Machine, MeasuredMachine, ModelShape, Software, StageCosts
from orchestrator.planning.simulation import DraftBehaviour
from stages.errors import SpecpipeError


class PlanError(SpecpipeError):
    """A setup that cannot be planned; the message is one line."""


@dataclass(frozen=True)
class Setup:
    """machines: in pipeline order (stage i on machines[i]). links[i] joins
    machine i and i + 1 (the last carries the chosen tokens back to machine 0); None for
    stages on the same machine. draft_seconds: per draft token on each machine
    (None: no speculation). draft_bytes: the draft model's memory on each
    machine. starts: a fixed split (None: search). one_host_parallel_stages:
    the machines are one host's stages (a profile's setup), which can compute
    only this many at once (its cores over each stage's threads)."""

    model: ModelShape
    machines: Sequence[Machine | MeasuredMachine]
    links: Sequence[Link | None]
    software: Software
    behaviour: DraftBehaviour | None
    draft_seconds: Sequence[float] | None = None
    draft_bytes: int = 0
    context: int = 4096
    max_tokens: int = 256
    starts: tuple[int, ...] | None = None
    draft_lengths: tuple[int, ...] = PLAN_DRAFT_LENGTHS
    one_host_parallel_stages: int | None = None  # all stages on one machine computing this many at once

    def costs(self, starts: tuple[int, ...]) -> StageCosts:
        shared = self.one_host_parallel_stages
        return StageCosts(self.model, self.machines, starts, self.links, self.software,
                          tuple(self.draft_seconds or (0.0,) * len(self.machines)),
                          hosts=(0,) * len(starts) if shared else None,
                          host_parallel_stages=shared)
