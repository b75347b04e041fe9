"""Which CPUs each stage process may run on: a pure decision.

Measured on the 2-core VMs this project is built on (``python -m
benchmarks.probe where-time-goes``, docs/measurements.md, "Where the per-token
time goes"): two stages in one
process take about what the whole model takes, but as two Ray actors on the
same quiet machine each stage's compute took 25-35 % longer, with its CPU
time equal to its wall time (it was not descheduled: it ran slower). Pinning
both stage processes to one core brought their compute back to the
in-process figures (pipeline / whole 0.76 -> 0.94, consecutive runs). What
the kernel and the hypervisor do to an unpinned stage is not established:
the same stages as plain subprocesses (pipes or TCP) did not slow down, and
the slowdown vanished while other work kept both cores busy; the likeliest
cause is a stage waking on a core that sat idle (a halted KVM vCPU) and
cold. The benchmark measures pinned against unpinned side by side, so the
choice is checked where it is made.

Sharing a core is right only while at most one stage computes at a time: a
plain pipeline, or synchronous speculation, one request. When passes overlap
(asynchronous speculation starts the next pass while the last stage runs;
a service has many requests in the pipeline), co-located stages get
disjoint cores instead, when the machine has enough of them. A stage alone
on its machine is left to the kernel (nothing to share a core with).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

CpuSet = tuple[int, ...]


def stage_cpu_sets(
    stage_machines: Sequence[str], machine_cpus: Mapping[str, Sequence[int]], threads: int, overlapping: bool
) -> list[CpuSet | None]:
    """The CPUs for each stage's process, or None (no pinning: any CPU).

    stage_machines: the machine of each stage, in stage order: its address
    (several Ray nodes may share a machine, as in the tests).
    machine_cpus: the CPUs a stage process may use on each machine (its affinity at start).
    threads: llama.cpp threads per stage.
    overlapping: whether several stages compute at once (see the module text).
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    sets: list[CpuSet | None] = [None] * len(stage_machines)
    for machine in dict.fromkeys(stage_machines):
        stages = [index for index, stage_machine in enumerate(stage_machines) if stage_machine == machine]
        cpus = sorted(machine_cpus[machine])
        if len(stages) < 2:
            continue
        if not overlapping:
            if threads <= len(cpus):
                for index in stages:
                    sets[index] = tuple(cpus[:threads])
        elif threads * len(stages) <= len(cpus):
            for order, index in enumerate(stages):
                sets[index] = tuple(cpus[order * threads:(order + 1) * threads])
    return sets
