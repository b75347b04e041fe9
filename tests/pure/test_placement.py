import pytest

from orchestrator.cluster.placement import (NodeInfo, PlacementError, PlacementPlan, advertised_stages, parse_place,
                                            plan_placement, replacement_node, stage_resource)

NODES = [NodeInfo("aaaa1111", "10.0.0.1", 1), NodeInfo("bbbb2222", "10.0.0.2", 1), NodeInfo("cccc3333", "10.0.0.3", 1)]


def test_one_node_runs_every_stage_locally():
    plan = plan_placement(NODES[:1], 3, "aaaa1111")
    assert plan.strategy == "local" and plan.node_ids == ("aaaa1111",) * 3


def test_several_nodes_spread_one_stage_per_node():
    assert plan_placement(NODES, 2, "aaaa1111").strategy == "spread"


def test_fewer_nodes_than_stages_is_refused():
    with pytest.raises(PlacementError, match="3 stages need 3 nodes"):
        plan_placement(NODES[:2], 3, "aaaa1111")


def test_explicit_placement_by_address_or_id_prefix():
    plan = plan_placement(NODES, 2, "aaaa1111", parse_place("0=10.0.0.3, 1=bbbb"))
    assert plan.strategy == "explicit" and plan.node_ids == ("cccc3333", "bbbb2222")


@pytest.mark.parametrize(
    "text, message",
    [("0=10.9.9.9,1=10.0.0.1", "no alive node"), ("0=10.0.0.1", "no node for stage 1"), ("0=10.0.0.1,5=10.0.0.2", "stage 5")],
)
def test_bad_explicit_placement(text, message):
    with pytest.raises(PlacementError, match=message):
        plan_placement(NODES, 2, "aaaa1111", parse_place(text))


def test_malformed_place_text():
    with pytest.raises(PlacementError, match="STAGE=NODE"):
        parse_place("first:10.0.0.1")


def holding(node: NodeInfo, *stages: int) -> NodeInfo:
    """The node, advertising the stage resources of ``stages`` (as cluster.yaml starts it)."""
    resources = {"CPU": node.cpus, "node:" + node.address: 1.0} | {stage_resource(stage): 1.0 for stage in stages}
    return NodeInfo(node.node_id, node.address, node.cpus, resources)


def test_nodes_advertising_stage_resources_hold_those_stages():
    nodes = [holding(NODES[0], 1), holding(NODES[1]), holding(NODES[2], 0)]
    plan = plan_placement(nodes, 2, "aaaa1111")
    assert plan.strategy == "explicit" and plan.node_ids == ("cccc3333", "aaaa1111")


def test_one_node_may_advertise_every_stage():
    plan = plan_placement([holding(NODES[0], 0, 1, 2)], 3, "aaaa1111")
    assert plan.node_ids == ("aaaa1111",) * 3


def test_place_wins_over_stage_resources():
    nodes = [holding(NODES[0], 0), holding(NODES[1], 1)]
    plan = plan_placement(nodes, 2, "aaaa1111", parse_place("0=10.0.0.2,1=10.0.0.1"))
    assert plan.node_ids == ("bbbb2222", "aaaa1111")


def test_a_stage_no_node_advertises_is_refused_with_a_hint():
    # e.g. the head is up but the worker holding stage 1 has not joined yet
    with pytest.raises(PlacementError, match=r"no alive node advertises specpipe-stage-1 \(advertised: 10.0.0.1 stage 0\)"):
        plan_placement([holding(NODES[0], 0)], 2, "aaaa1111")


def test_a_stage_advertised_twice_is_refused():
    with pytest.raises(PlacementError, match="specpipe-stage-0 is advertised by more than one node"):
        plan_placement([holding(NODES[0], 0), holding(NODES[1], 0, 1)], 2, "aaaa1111")


def test_resources_that_are_not_stages_are_ignored():
    nodes = [NodeInfo(node.node_id, node.address, 1, {"specpipe-stage-x": 1.0, "specpipe-stage-": 1.0}) for node in NODES]
    assert plan_placement(nodes, 2, "aaaa1111").strategy == "spread"


def test_an_ambiguous_node_id_prefix_is_refused_not_taken_first():
    nodes = [NodeInfo("abcd1111", "10.0.0.1", 1), NodeInfo("abcd2222", "10.0.0.2", 1)]
    with pytest.raises(PlacementError, match="node 'abcd' is ambiguous; alive nodes: 10.0.0.1 \\(abcd1111\\), 10.0.0.2 \\(abcd2222\\)"):
        plan_placement(nodes, 2, "abcd1111", parse_place("0=abcd,1=10.0.0.2"))
    # a longer prefix that is unique picks its node, whichever comes first in the list
    assert plan_placement(nodes, 2, "abcd1111", parse_place("0=abcd2,1=abcd1")).node_ids == ("abcd2222", "abcd1111")


# -- the one-line messages a user reads, and the limits of --place and of advertised stages

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


def test_more_drafter_nodes_than_stages_is_refused_before_ray_is_asked():
    """A drafter node drafts in place of the one beside stage i: one stage takes one node."""
    from orchestrator.cluster.drafters import drafter_nodes

    with pytest.raises(PlacementError, match="^--drafter-node given 2 times, but the pipeline has 1 stage: "):
        drafter_nodes(("10.0.0.2", "10.0.0.3"), 1)


def test_a_drafter_node_lost_since_the_start_is_left_out_and_told_where_the_start_refuses_it(monkeypatch):
    """A serve coordinator started again after its --drafter-node was lost
    drafts beside the stage (None here) and says why; the driver's check
    before the start still refuses a node not alive. Before, every later
    coordinator failed to start (the chaos soak's drafter-node fault)."""
    from orchestrator.cluster import drafters

    monkeypatch.setattr(drafters, "alive_nodes", lambda: [NodeInfo("aaaa", "10.0.0.2", 2)])
    told = []
    assert drafters.drafter_nodes(("10.0.0.9", "10.0.0.2"), 2, lost=told.append) == [None, NodeInfo("aaaa", "10.0.0.2", 2)]
    assert len(told) == 1 and "no alive node '10.0.0.9'" in told[0]
    with pytest.raises(PlacementError, match="no alive node '10.0.0.9'"):
        drafters.drafter_nodes(("10.0.0.9",), 2)


def test_nodes_chosen_before_are_kept_but_movable_and_pins_win_over_them():
    nodes = [NodeInfo("aaaa", "10.0.0.1", 2), NodeInfo("bbbb", "10.0.0.2", 2), NodeInfo("cccc", "10.0.0.3", 2)]
    chosen = plan_placement(nodes, 2, "aaaa", prefer={0: "cccc", 1: "aaaa"})
    assert chosen == PlacementPlan("explicit", ("cccc", "aaaa"), movable=True)
    pinned = plan_placement(nodes, 2, "aaaa", place={0: "10.0.0.2", 1: "10.0.0.1"}, prefer={0: "cccc", 1: "aaaa"})
    assert pinned == PlacementPlan("explicit", ("bbbb", "aaaa"), movable=False)
    assert plan_placement(nodes, 3, "aaaa") == PlacementPlan("spread")
    moved = plan_placement(nodes, 2, "aaaa", prefer={0: "gone", 1: "aaaa"})  # lost before the replica started
    assert moved == PlacementPlan("explicit", ("bbbb", "aaaa"), movable=True)
    with pytest.raises(PlacementError, match="stage 0's node gone is not alive and no other node has room"):
        plan_placement(nodes[:1], 2, "aaaa", prefer={0: "gone", 1: "aaaa"})


def test_a_lost_stage_moves_to_a_node_holding_no_stage_or_nowhere():
    spare, busy = NodeInfo("spare", "10.0.0.3", 1), NodeInfo("busy", "10.0.0.2", 4)
    no_cpu = NodeInfo("head", "10.0.0.9", 0)
    # stage 0's node "gone" is not alive; stage 1 runs on busy
    assert replacement_node([no_cpu, busy, spare], ("gone", "busy"), 0) == spare
    assert replacement_node([no_cpu, busy], ("gone", "busy"), 0) is None  # no room: it waits, never doubles up
    own = NodeInfo("gone", "10.0.0.1", 1)  # its node is alive again (the process died, not the node): stays there
    assert replacement_node([spare, busy, own], ("gone", "busy"), 0) == own
    assert replacement_node([own], ("gone", "gone"), 1) == own  # one machine runs both: its process died, not it
