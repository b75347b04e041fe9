"""Which CPUs stage processes are pinned to (orchestrator.cluster.stage_cpus): the rule (a real pipeline's
processes: tests/ray/test_stage_pinning.py)."""

import pytest

from orchestrator.cluster.stage_cpus import stage_cpu_sets


def test_stages_sharing_a_machine_share_one_core_while_one_pass_runs_at_a_time():
    assert stage_cpu_sets(["a", "a"], {"a": [1, 0]}, 1, overlapping=False) == [(0,), (0,)]
    assert stage_cpu_sets(["a", "a", "a"], {"a": [0, 1, 2, 3]}, 2, overlapping=False) == [(0, 1)] * 3


def test_overlapping_stages_get_a_core_each_when_the_machine_has_enough():
    assert stage_cpu_sets(["a", "a"], {"a": [0, 1]}, 1, overlapping=True) == [(0,), (1,)]
    assert stage_cpu_sets(["a", "a"], {"a": [4, 5, 6, 7]}, 2, overlapping=True) == [(4, 5), (6, 7)]
    # three one-thread stages on two cores: the kernel shares them out
    assert stage_cpu_sets(["a", "a", "a"], {"a": [0, 1]}, 1, overlapping=True) == [None] * 3


def test_a_stage_alone_on_its_machine_is_not_pinned_and_machines_are_decided_apart():
    assert stage_cpu_sets(["a", "b"], {"a": [0, 1], "b": [0, 1]}, 1, overlapping=False) == [None, None]
    assert stage_cpu_sets(["a", "b", "a"], {"a": [2, 3], "b": [0]}, 1, overlapping=True) == [(2,), None, (3,)]


def test_more_threads_than_the_machine_has_pins_nothing():
    assert stage_cpu_sets(["a", "a"], {"a": [0, 1]}, 4, overlapping=False) == [None, None]
    with pytest.raises(ValueError):
        stage_cpu_sets(["a"], {"a": [0]}, 0, overlapping=False)
