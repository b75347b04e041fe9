"""What a Setup hands the simulation (orchestrator.planning.inputs.Setup.costs).

Guards the draft times when none are given (free, one per machine), the
draft times when given, and a profile's setup whose stages all run on one
host that computes only so many at once (every stage on host 0, that many
in parallel) against separate machines (stage i on host i, no limit).
"""

from __future__ import annotations

from orchestrator.planning.costs import Link, Machine, ModelShape, Software
from orchestrator.planning.inputs import PLAN_DRAFT_LENGTHS, Setup
from orchestrator.planning.simulation import DraftBehaviour

MODEL = ModelShape("toy", 6, 8, 16, (10,) * 6, 5, 5, 100, 50, 2)
MACHINES = [Machine(f"m{index}", 1e9, 1e9, 1e12) for index in range(3)]
SOFTWARE = Software(0.001, 0.002, 0.0001)


def make_setup(**options) -> Setup:
    return Setup(MODEL, MACHINES, [Link(0.001, 1e9)] * 3, SOFTWARE, DraftBehaviour(0.5), **options)


def test_without_draft_times_every_machine_drafts_for_free():
    costs = make_setup().costs((0, 2, 4))
    assert costs.draft_seconds_per_token == (0.0, 0.0, 0.0)
    assert [costs.draft_seconds(machine) for machine in range(3)] == [0.0, 0.0, 0.0]


def test_given_draft_times_are_each_machines():
    costs = make_setup(draft_seconds=[0.5, 0.25, 0.125]).costs((0, 2, 4))
    assert costs.draft_seconds_per_token == (0.5, 0.25, 0.125)
    assert [costs.draft_seconds(machine) for machine in range(3)] == [0.5, 0.25, 0.125]


def test_separate_machines_are_separate_hosts_with_no_limit():
    costs = make_setup().costs((0, 2, 4))
    assert [costs.host(stage) for stage in range(3)] == [0, 1, 2]
    assert [costs.parallel_stages(host) for host in range(3)] == [None, None, None]


def test_one_hosts_stages_all_run_on_host_zero_that_many_at_once():
    costs = make_setup(one_host_parallel_stages=2).costs((0, 2, 4))
    assert [costs.host(stage) for stage in range(3)] == [0, 0, 0]
    assert costs.parallel_stages(0) == 2


def test_the_costs_carry_the_setup_and_the_split():
    costs = make_setup().costs((0, 1, 3))
    assert costs.starts == (0, 1, 3) and costs.stage_count == 3
    assert costs.model is MODEL and costs.software is SOFTWARE
    assert [costs.stage_range(stage) for stage in range(3)] == [(0, 1), (1, 3), (3, 6)]
    assert make_setup().draft_lengths == PLAN_DRAFT_LENGTHS == (1, 2, 3, 4, 6, 8, 12, 16)
