"""Where a generation's time goes, machine by machine: timeline.png.

One bench run per pipelined mode (the first prompt's first repetition) is
drawn as a row per machine: the passes its stage computed (from each
stage's own start time and busy seconds, PassTimes; those whose result was
discarded apart) and what its drafter drafted (from when the loop asked it
to, for the drafting seconds it reported). Whatever is not drawn is idle.
The stages' start times are their machines' clocks: on one machine (this
bench) they agree with the coordinator's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import Generation


@dataclass
class DraftTimes:
    """What one drafter drafted: (machine, start, seconds) intervals, machine
    i beside stage i (-1: the coordinator's own, prompt lookup in process)."""

    intervals: list[tuple[int, float, float]] = field(default_factory=list)


class _TimedDrafter:
    """A Drafter that notes, for each speculate, when it began and the seconds
    drafted until its collect: the drafter's own busy seconds where it reports
    them (an actor's), else the collect's wall time (drafting in place)."""

    def __init__(self, drafter, machine: int, times: DraftTimes):
        self.drafter, self.machine, self.times = drafter, machine, times
        self._started: float | None = None
        self._busy_before = 0.0

    def _busy(self) -> float | None:
        client = getattr(self.drafter, "client", None)
        return None if client is None else client.busy_seconds

    def speculate(self, context, most=None, sampling=None, tree=None, **more) -> None:
        """more: what a drafter of corrections also takes (forks), passed on as given."""
        self._started, self._busy_before = time.time(), self._busy() or 0.0
        self.drafter.speculate(context, most, sampling=sampling, tree=tree, **more)

    def ask(self) -> None:
        self.drafter.ask()

    def peek(self) -> list[int]:
        return self.drafter.peek()

    def corrections(self):
        return self.drafter.corrections()

    def collect(self, wait: bool = False) -> list[int]:
        return self._timed(lambda: self.drafter.collect(wait))

    def collect_tree(self, leaves: int):
        return self._timed(lambda: self.drafter.collect_tree(leaves))

    def _timed(self, collect):
        called = time.time()
        result = collect()
        busy = self._busy()
        if self._started is not None:
            seconds = time.time() - called if busy is None else busy - self._busy_before
            start = called if busy is None else self._started
            if seconds > 0:
                self.times.intervals.append((self.machine, start, seconds))
        self._started = None
        return result


def timed(drafting: Drafting | None) -> tuple[Drafting | None, DraftTimes]:
    """``drafting`` with every drafter timed, and where their intervals go."""
    times = DraftTimes()
    if drafting is None:
        return None, times
    drafters = [_TimedDrafter(drafter, machine, times) for machine, drafter in enumerate(drafting.drafters)]
    first = None if drafting.first is None else _TimedDrafter(drafting.first, -1, times)
    return dataclasses.replace(drafting, drafters=drafters, first=first), times


def record(generation: Generation, started: float, drafts: DraftTimes) -> dict | None:
    """A run's timeline as results.json keeps it (seconds from ``started``,
    the generation's start, time.time()); None where the stages did not time their passes."""
    if not generation.timeline or not all(times.stage_started for times in generation.timeline):
        return None
    passes = [[stage, round(begun - started, 5), round(seconds, 5), times.discarded]
              for times in generation.timeline
              for stage, (begun, seconds) in enumerate(zip(times.stage_started, times.stage_seconds)) if seconds > 0]
    drafting = [[machine, round(begun - started, 5), round(seconds, 5)] for machine, begun, seconds in drafts.intervals]
    return {"seconds": round(generation.seconds, 5), "passes": passes, "drafting": drafting}


def draw(results: dict, path: Path) -> None:
    """A panel per (scenario, mode) with a timeline: a row per machine,
    its stage's passes (useful, discarded) above its drafting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(scenario, row) for scenario in results["scenarios"] for row in scenario["modes"] if row.get("timeline")]
    height = max(2.5, sum(1.0 + 0.55 * scenario["stages"] for scenario, _ in panels))
    figure, axes = plt.subplots(max(1, len(panels)), 1, figsize=(11, height), squeeze=False)
    for axis, (scenario, row) in zip(axes[:, 0], panels):
        timeline, machines = row["timeline"], scenario["stages"]
        for machine in range(machines):
            base = machines - 1 - machine
            useful = [(begun, seconds) for stage, begun, seconds, discarded in timeline["passes"]
                      if stage == machine and not discarded]
            wasted = [(begun, seconds) for stage, begun, seconds, discarded in timeline["passes"]
                      if stage == machine and discarded]
            drafting = [(begun, seconds) for drafter, begun, seconds in timeline["drafting"] if drafter == machine]
            axis.broken_barh(useful, (base + 0.45, 0.45), color="tab:blue", label="pass" if machine == 0 else None)
            axis.broken_barh(wasted, (base + 0.45, 0.45), color="tab:orange",
                             label="pass discarded" if machine == 0 else None)
            axis.broken_barh(drafting, (base + 0.0, 0.4), color="tab:green", label="drafting" if machine == 0 else None)
        coordinator = [(begun, seconds) for drafter, begun, seconds in timeline["drafting"] if drafter < 0]
        if coordinator:
            axis.broken_barh(coordinator, (-0.5, 0.4), color="tab:olive", label="drafting (coordinator)")
        axis.set_yticks([machines - 1 - machine + 0.45 for machine in range(machines)],
                        [f"machine {machine}" for machine in range(machines)])
        axis.set_xlim(0, timeline["seconds"])
        axis.set_title(f"{scenario['scenario']}: {row['mode']} ({row['tokens_per_second']['median']:.1f} tokens/s)",
                       fontsize=9)
        axis.legend(loc="upper right", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds from the generation's start (first prompt, first repetition); blank: idle")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
