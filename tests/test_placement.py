import pytest

from orchestrator.placement import NodeInfo, PlacementError, parse_place, plan_placement

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
