"""A real pipeline's stage processes pinned to CPUs, every thread of each, as the rule
(orchestrator.cluster.stage_cpus, tests/pure/test_stage_cpus.py) says."""

import os

import pytest


def _allowed_cpus(process_id: int) -> set[frozenset[int]]:
    """The CPU set of every thread of a process (one entry per distinct set)."""
    sets = set()
    for thread in os.listdir(f"/proc/{process_id}/task"):
        try:
            sets.add(frozenset(os.sched_getaffinity(int(thread))))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return sets


def test_a_pipeline_pins_every_thread_of_its_stage_processes(ray_cluster, splits):
    from orchestrator.cluster.pipeline import Pipeline
    from stages.settings import StageSettings

    every = frozenset(os.sched_getaffinity(0))
    if len(every) < 2:
        pytest.skip("needs two CPUs")
    first, second = sorted(every)[:2]
    with Pipeline(splits[2], StageSettings(n_ctx=64)) as pipeline:  # one pass at a time
        processes = [stage.process_id for stage in pipeline.stages]
        assert [_allowed_cpus(process) for process in processes] == [{frozenset({first})}] * 2
        pipeline.pin_stages(overlapping=True)
        assert [_allowed_cpus(process) for process in processes] == [{frozenset({first})}, {frozenset({second})}]
        pipeline.set_stage_cpus([None, None])
        assert [_allowed_cpus(process) for process in processes] == [{every}] * 2
