"""Placement edges found by mutation testing: the one-line messages a user reads,
and the limits of --place and of advertised stages."""

import pytest

from orchestrator.cluster.placement import NodeInfo, PlacementError, advertised_stages, parse_place, plan_placement

pytestmark = pytest.mark.pure

A = NodeInfo("aaaaaaaa1111", "10.0.0.1", 1)
B = NodeInfo("bbbbbbbb2222", "10.0.0.2", 1)


def test_an_empty_cluster_says_so():
    with pytest.raises(PlacementError, match=r"^the Ray cluster has no alive nodes$"):
        plan_placement([], 2, "local")


def test_two_nodes_carry_two_stages_one_each():
    assert plan_placement([A, B], 2, A.node_id).strategy == "spread"


def test_place_names_a_stage_past_the_last():
    with pytest.raises(PlacementError, match=r"^--place names stage 2, but stages are 0\.\.1$"):
        plan_placement([A, B], 2, A.node_id, {0: A.address, 1: B.address, 2: B.address})


@pytest.mark.parametrize("text", ["0=", "x=10.0.0.1", "a=10.0.0.1", "=10.0.0.1", "0"])
def test_malformed_place_entries_are_one_placement_error(text):
    with pytest.raises(PlacementError, match=r"is not STAGE=NODE"):
        parse_place(text)


def test_a_stage_placed_twice_is_named():
    with pytest.raises(PlacementError, match=r"^--place names stage 0 twice$"):
        parse_place("0=10.0.0.1, 0=10.0.0.2")


def test_unknown_node_lists_the_alive_ones_by_address_and_short_id():
    with pytest.raises(PlacementError) as error:
        plan_placement([A, B], 2, A.node_id, {0: "10.9.9.9", 1: B.address})
    assert str(error.value) == "no alive node '10.9.9.9'; alive nodes: 10.0.0.1 (aaaaaaaa), 10.0.0.2 (bbbbbbbb)"


def test_only_positive_stage_resources_with_the_prefix_count():
    node = NodeInfo("n", "10.0.0.1", 1, {"specpipe-stage-1": 0.0, "another-prefix-2": 1.0, "specpipe-stage-3": 1.0})
    assert advertised_stages(node) == [3]


def test_a_stage_advertised_twice_names_both_holders():
    a = NodeInfo("aaaaaaaa1111", "10.0.0.1", 1, {"specpipe-stage-0": 1.0})
    b = NodeInfo("bbbbbbbb2222", "10.0.0.2", 1, {"specpipe-stage-0": 1.0, "specpipe-stage-1": 1.0})
    with pytest.raises(PlacementError) as error:
        plan_placement([a, b], 2, a.node_id)
    assert str(error.value) == ("specpipe-stage-0 is advertised by more than one node "
                                "(10.0.0.1 (aaaaaaaa), 10.0.0.2 (bbbbbbbb)); give --place")


def test_a_stage_nobody_advertises_lists_what_is_advertised():
    a = NodeInfo("aaaaaaaa1111", "10.0.0.1", 1, {"specpipe-stage-0": 1.0, "specpipe-stage-2": 1.0})
    b = NodeInfo("bbbbbbbb2222", "10.0.0.2", 1, {"specpipe-stage-3": 1.0})
    with pytest.raises(PlacementError) as error:
        plan_placement([a, b], 2, a.node_id)
    assert str(error.value).startswith(
        "no alive node advertises specpipe-stage-1 (advertised: 10.0.0.1 stage 0,2, 10.0.0.2 stage 3); ")
