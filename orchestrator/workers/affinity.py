"""Which CPUs a stage process runs on, where the OS lets a process say.

Linux has per-thread affinity (``os.sched_getaffinity``, ``sched_setaffinity``,
a thread list in /proc/self/task); macOS and Windows have none of them. There a
process may run on every CPU and pinning is skipped (the stages of one machine
then share its cores as the OS schedules them), so nothing else changes.
"""

from __future__ import annotations

import os

THREADS = "/proc/self/task"


def process_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on: its affinity, else all the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and os.path.isdir(THREADS)


def pin_threads(cpus: tuple[int, ...]) -> bool:
    """Run every thread of this process on ``cpus`` (threads made later inherit
    their creator's set). False, and nothing done, where the OS cannot."""
    if not can_pin():
        return False
    for thread in os.listdir(THREADS):
        try:
            os.sched_setaffinity(int(thread), set(cpus))
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            pass
    return True
