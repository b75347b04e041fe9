"""Which CPUs stage processes are pinned to: the pure rule, and a real pipeline's processes."""

import os

import pytest

from orchestrator.cluster.stage_cpus import stage_cpu_sets


@pytest.mark.pure
def test_stages_sharing_a_machine_share_one_core_while_one_pass_runs_at_a_time():
    assert stage_cpu_sets(["a", "a"], {"a": [1, 0]}, 1, overlapping=False) == [(0,), (0,)]
    assert stage_cpu_sets(["a", "a", "a"], {"a": [0, 1, 2, 3]}, 2, overlapping=False) == [(0, 1)] * 3


@pytest.mark.pure
def test_overlapping_stages_get_a_core_each_when_the_machine_has_enough():
    assert stage_cpu_sets(["a", "a"], {"a": [0, 1]}, 1, overlapping=True) == [(0,), (1,)]
    assert stage_cpu_sets(["a", "a"], {"a": [4, 5, 6, 7]}, 2, overlapping=True) == [(4, 5), (6, 7)]
    # three one-thread stages on two cores: the kernel shares them out
    assert stage_cpu_sets(["a", "a", "a"], {"a": [0, 1]}, 1, overlapping=True) == [None] * 3


@pytest.mark.pure
def test_a_stage_alone_on_its_machine_is_not_pinned_and_machines_are_decided_apart():
    assert stage_cpu_sets(["a", "b"], {"a": [0, 1], "b": [0, 1]}, 1, overlapping=False) == [None, None]
    assert stage_cpu_sets(["a", "b", "a"], {"a": [2, 3], "b": [0]}, 1, overlapping=True) == [(2,), None, (3,)]


@pytest.mark.pure
def test_more_threads_than_the_machine_has_pins_nothing():
    assert stage_cpu_sets(["a", "a"], {"a": [0, 1]}, 4, overlapping=False) == [None, None]
    with pytest.raises(ValueError):
        stage_cpu_sets(["a"], {"a": [0]}, 0, overlapping=False)


def _allowed_cpus(process_id: int) -> set[frozenset[int]]:
    """The CPU set of every thread of a process (one entry per distinct set)."""
    sets = set()
    for thread in os.listdir(f"/proc/{process_id}/task"):
        try:
            sets.add(frozenset(os.sched_getaffinity(int(thread))))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return sets


@pytest.mark.ray
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
