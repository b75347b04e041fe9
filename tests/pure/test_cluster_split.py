"""The split chosen for a cluster's nodes (orchestrator.planning.cluster_split
over stages.plan.balanced_starts): what fits each node's free memory, the
bytes balanced, or the profiled speeds (pure)."""

from __future__ import annotations

import pytest

from orchestrator.planning.cluster_split import MIB, NodeMemory, choose_cluster_split, stage_memory
from orchestrator.planning.costs import ModelShape
from orchestrator.planning.inputs import PlanError
from stages.plan import balanced_starts


# 20 blocks of 10 MiB, a 20 MiB embedding table, a 20 MiB head; 1 KiB of KV per block and position.
SHAPE = ModelShape(name="toy", blocks=20, width=64, vocab=1000, block_bytes=(10 * MIB,) * 20, head_bytes=20 * MIB,
                   embedding_bytes=20 * MIB, block_parameters=1, head_parameters=1, kv_bytes_per_token=1024)
EVERY = list(range(1, 20))


def nodes(*free_mib: float) -> list[NodeMemory]:
    return [NodeMemory(f"10.0.0.{index + 1}", f"node{index}", int(free * MIB)) for index, free in enumerate(free_mib)]


def profile(seconds_per_block: float) -> dict:
    """An `orchestrate profile` reduced to what the speed needs (blocks of 1 MB read in that time)."""
    return {"machine": {"host": "profiled", "memory_bytes": 1}, "batch_sizes": [1, 2],
            "block_seconds": [seconds_per_block, 2 * seconds_per_block], "head_seconds": [0.0, 0.0],
            "fixed_seconds": [0.0, 0.0], "model_shape": {"block_bytes": [1_000_000] * 4}}


def test_alike_nodes_with_room_get_the_bytes_balanced():
    split = choose_cluster_split(SHAPE, nodes(10_000, 10_000), context=1024, draft_bytes=0, boundaries=EVERY)
    assert split.starts == (0, 10)
    assert split.needed == (20 * MIB + 100 * MIB + 10 * 1024 * 1024,) * 2  # table + blocks + KV


def test_a_small_node_gets_the_stage_that_fits_it():
    """Node 0 has 100 MiB free: 90 % of it holds the table and at most 6 blocks (11 MiB each with KV for 1024)."""
    split = choose_cluster_split(SHAPE, nodes(100, 10_000), context=1024, draft_bytes=0, boundaries=EVERY)
    assert split.starts == (0, 6)
    assert all(need <= 0.9 * node.available_bytes for need, node in zip(split.needed, nodes(100, 10_000)))
    assert stage_memory(SHAPE, 0, 7, 1024, 0) > 0.9 * 100 * MIB  # one more block would not fit


def test_kv_and_the_draft_model_count_against_the_memory():
    roomy = choose_cluster_split(SHAPE, nodes(150, 10_000), context=16, draft_bytes=0, boundaries=EVERY)
    with_kv = choose_cluster_split(SHAPE, nodes(150, 10_000), context=20_000, draft_bytes=0, boundaries=EVERY)
    with_draft = choose_cluster_split(SHAPE, nodes(150, 10_000), context=16, draft_bytes=40 * MIB, boundaries=EVERY)
    assert with_kv.starts[1] < roomy.starts[1] and with_draft.starts[1] < roomy.starts[1]


def test_only_boundaries_that_split_exactly_are_used():
    split = choose_cluster_split(SHAPE, nodes(10_000, 10_000), context=16, draft_bytes=0, boundaries=[4, 8, 12, 16])
    assert split.starts in {(0, 8), (0, 12)}


def test_profiled_speeds_give_the_faster_node_more_blocks():
    fast, slow = profile(0.001), profile(0.003)  # node 0 reads three times as fast
    split = choose_cluster_split(SHAPE, nodes(10_000, 10_000), context=16, draft_bytes=0, boundaries=EVERY,
                                 profiles={"10.0.0.1": fast, "10.0.0.2": slow})
    assert split.starts == (0, 15)
    assert "GB/s" in split.reason


def test_a_missing_profile_is_refused():
    with pytest.raises(PlanError, match="no profile for node 10.0.0.2"):
        choose_cluster_split(SHAPE, nodes(10_000, 10_000), context=16, draft_bytes=0, boundaries=EVERY,
                             profiles={"10.0.0.1": profile(0.001)})


def test_a_model_that_fits_no_split_is_refused_with_the_numbers():
    with pytest.raises(PlanError) as refused:
        choose_cluster_split(SHAPE, nodes(100, 100), context=1024, draft_bytes=0, boundaries=EVERY)
    message = str(refused.value)
    assert "fits no split over 2 node(s)" in message
    assert "10.0.0.1 100 MiB" in message and "10.0.0.2 100 MiB" in message
    assert f"{stage_memory(SHAPE, 0, 20, 1024, 0) / MIB:.0f} MiB in all" in message


def test_the_lines_name_each_stage_its_node_and_its_memory():
    chosen = nodes(10_000, 10_000)
    split = choose_cluster_split(SHAPE, chosen, context=16, draft_bytes=0, boundaries=EVERY)
    lines = split.lines(SHAPE.blocks, chosen)
    assert lines[0].startswith("split: ")
    assert lines[1].startswith("  stage 0: blocks [0, 10) on 10.0.0.1: needs 120 MiB of 10000 MiB")
    assert lines[2].startswith("  stage 1: blocks [10, 20) on 10.0.0.2")


def test_balanced_starts_weighs_speeds_and_skips_what_does_not_fit():
    costs = [1] * 12
    assert balanced_starts(costs, 2, list(range(1, 12))) == [0, 6]
    assert balanced_starts(costs, 2, list(range(1, 12)), speeds=[2.0, 1.0]) == [0, 8]
    assert balanced_starts(costs, 3, list(range(1, 12)), fits=lambda stage, first, end: end - first <= 3 or stage == 2) \
        == [0, 3, 6]
    with pytest.raises(ValueError, match="no split"):
        balanced_starts(costs, 2, list(range(1, 12)), fits=lambda stage, first, end: end - first <= 5)
    with pytest.raises(ValueError, match="does not fit"):
        balanced_starts(costs, 1, [], fits=lambda stage, first, end: False)


def test_the_reasons_say_how_the_split_was_chosen():
    alike = choose_cluster_split(SHAPE, nodes(10_000, 10_000), context=16, draft_bytes=0, boundaries=EVERY)
    assert alike.reason == ("of the splits that fit, the one with the block bytes most even "
                            "(no --profile: nodes taken as alike)")
    fast, slow = profile(0.001), profile(0.003)
    profiled = choose_cluster_split(SHAPE, nodes(10_000, 10_000), context=16, draft_bytes=0, boundaries=EVERY,
                                    profiles={"10.0.0.1": fast, "10.0.0.2": slow})
    assert profiled.reason == ("of the splits that fit, the one whose slowest stage is fastest, at the speeds "
                               "profiled (10.0.0.1 1.00 GB/s, 10.0.0.2 0.33 GB/s)")


def test_a_nodes_speed_is_its_block_bytes_over_a_one_token_pass():
    from orchestrator.planning.cluster_split import node_speed

    uneven = {**profile(0.002), "block_seconds": [0.002, 0.0025]}  # a wider batch is not what counts
    assert node_speed(uneven) == pytest.approx(1_000_000 / 0.002)


@pytest.mark.parametrize("change", [{"block_seconds": [0.0, 0.0]}, {"model_shape": {"block_bytes": []}}])
def test_a_profile_without_block_timing_is_refused(change):
    from orchestrator.planning.cluster_split import node_speed

    with pytest.raises(PlanError, match="has no block timing; run `orchestrate profile` again"):
        node_speed({**profile(0.001), **change})


def test_a_stage_that_fills_exactly_ninety_percent_fits():
    draft = 7  # makes the stage's need a multiple of 9, so that 90 % of the node is exactly it
    need = stage_memory(SHAPE, 0, 6, 1024, draft)
    assert need % 9 == 0
    exact = [NodeMemory("10.0.0.1", "node0", need * 10 // 9), NodeMemory("10.0.0.2", "node1", 10_000 * MIB)]
    assert 0.9 * exact[0].available_bytes == need
    split = choose_cluster_split(SHAPE, exact, context=1024, draft_bytes=draft, boundaries=EVERY)
    assert split.starts == (0, 6)


@pytest.mark.parametrize("draft_bytes, named", [(0, False), (MIB, True)])
def test_the_refusal_lists_every_node_and_names_the_draft_model_when_there_is_one(draft_bytes, named):
    with pytest.raises(PlanError) as refused:
        choose_cluster_split(SHAPE, nodes(100, 100), context=1024, draft_bytes=draft_bytes, boundaries=EVERY)
    message = str(refused.value)
    assert "(10.0.0.1 100 MiB, 10.0.0.2 100 MiB)" in message
    assert ("KV for 1024 positions, draft model), and" in message) == named
    assert ("KV for 1024 positions), and" in message) == (not named)


def test_one_stage_is_checked_against_its_node_whole():
    assert balanced_starts([1] * 12, 1, [], fits=lambda stage, first, end: (stage, first, end) == (0, 0, 12)) == [0]
    with pytest.raises(ValueError, match="^the model does not fit its one node$"):
        balanced_starts([1] * 12, 1, [], fits=lambda stage, first, end: (stage, first, end) != (0, 0, 12))


def test_of_equally_slow_splits_the_earliest_cut_wins():
    assert balanced_starts([1, 10, 1], 2, [1, 2]) == [0, 1]  # [1] + [10, 1] and [1, 10] + [1] both cost 11


def test_a_stage_offloaded_whole_must_fit_its_nodes_gpu_memory():
    """Host memory aplenty, but node 0's GPUs have 100 MiB free: offloaded, it takes the stage
    that fits them (6 blocks, as in test_a_small_node_gets_the_stage_that_fits_it); not offloaded,
    or on a node without GPUs, host memory counts."""
    gpu_nodes = [NodeMemory("10.0.0.1", "node0", 10_000 * MIB, offload_bytes=100 * MIB),
                 NodeMemory("10.0.0.2", "node1", 10_000 * MIB, offload_bytes=10_000 * MIB)]
    offloaded = choose_cluster_split(SHAPE, gpu_nodes, context=1024, draft_bytes=0, boundaries=EVERY, offloaded=True)
    assert offloaded.starts == (0, 6)
    assert "of 100 MiB GPU memory available" in offloaded.lines(20, gpu_nodes, offloaded=True)[1]
    on_the_host = choose_cluster_split(SHAPE, gpu_nodes, context=1024, draft_bytes=0, boundaries=EVERY)
    assert on_the_host.starts == (0, 10)
    assert "of 10000 MiB available" in on_the_host.lines(20, gpu_nodes)[1]
    cpu_nodes = nodes(10_000, 10_000)  # no GPUs (offload_bytes 0): host memory, offloaded or not
    assert choose_cluster_split(SHAPE, cpu_nodes, context=1024, draft_bytes=0, boundaries=EVERY,
                                offloaded=True).starts == (0, 10)


def test_a_model_too_big_for_the_gpus_is_refused_naming_their_memory():
    gpu_nodes = [NodeMemory(f"10.0.0.{index}", f"node{index}", 10_000 * MIB, offload_bytes=50 * MIB)
                 for index in (1, 2)]
    with pytest.raises(PlanError, match="10.0.0.1 50 MiB GPU memory, 10.0.0.2 50 MiB GPU memory"):
        choose_cluster_split(SHAPE, gpu_nodes, context=1024, draft_bytes=0, boundaries=EVERY, offloaded=True)
