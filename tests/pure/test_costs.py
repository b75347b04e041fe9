"""The cost model (orchestrator.planning.costs): batch-cost curves (one measured
size, two, past the largest), model shapes, roofline and measured stages, hops
over links and on one machine, memory, and the split profile."""

import pytest

from orchestrator.planning.costs import (BatchCurve, Link, Machine, MeasuredMachine, ModelShape, Software, StageCosts,
                                         split_costs)


def test_a_curve_needs_one_time_per_size_in_increasing_order():
    for sizes, seconds in (((1, 2), (0.1,)), ((), ()), ((2, 1), (0.1, 0.2)), ((1, 1), (0.1, 0.2))):
        with pytest.raises(ValueError, match=r"^a batch curve needs increasing sizes, one time each$"):
            BatchCurve(sizes, seconds)


def test_one_measured_size_costs_the_same_for_any_batch():
    assert BatchCurve((4,), (0.5,)).at(1) == 0.5
    assert BatchCurve((4,), (0.5,)).at(64) == 0.5


def test_between_and_beyond_the_measured_sizes_the_curve_is_linear_by_segment():
    two = BatchCurve((1, 5), (1.0, 3.0))
    assert two.at(1) == 1.0 and two.at(3) == pytest.approx(2.0) and two.at(9) == pytest.approx(5.0)
    three = BatchCurve((1, 2, 4), (1.0, 2.0, 10.0))
    assert three.at(3) == pytest.approx(6.0)  # on the segment 2..4
    assert three.at(8) == pytest.approx(26.0)  # past 4: along the last segment


# -- model shapes, machines and a pipeline's costs, on numbers small enough to check by hand

# four blocks of 10, 20, 30 and 40 bytes; embedding table 300 bytes, head 500
SHAPE = ModelShape("toy", blocks=4, width=8, vocab=16, block_bytes=(10, 20, 30, 40), head_bytes=500,
                   embedding_bytes=300, block_parameters=7, head_parameters=11, kv_bytes_per_token=3)


def test_stage_bytes_add_the_embedding_to_the_first_stage_and_the_head_to_the_last():
    assert SHAPE.stage_bytes(0, 4) == 10 + 20 + 30 + 40 + 300 + 500
    assert SHAPE.stage_bytes(0, 2) == 10 + 20 + 300
    assert SHAPE.stage_bytes(1, 3) == 20 + 30
    assert SHAPE.stage_bytes(2, 4) == 30 + 40 + 500


def test_a_shape_from_its_size_puts_two_tables_aside_and_splits_the_rest_evenly_in_blocks():
    # tables of 10 x 4 = 40 weights; (1000 - 2 * 40) / 4 = 230 weights a block; 4 bits a weight: half a byte
    shape = ModelShape.from_parameters("small", blocks=4, width=4, vocab=10, parameters=1000, bits_per_weight=4,
                                       kv_heads_width=6)
    assert shape == ModelShape("small", blocks=4, width=4, vocab=10, block_bytes=(115, 115, 115, 115), head_bytes=20,
                               embedding_bytes=20, block_parameters=230, head_parameters=40,
                               kv_bytes_per_token=2 * 6 * 2)  # a key and a value, 6 wide, 2 bytes each
    wide = ModelShape.from_parameters("small", blocks=4, width=4, vocab=10, parameters=1000, bits_per_weight=4,
                                      kv_heads_width=6, kv_bytes_per_value=4)
    assert wide.kv_bytes_per_token == 2 * 6 * 4


def test_a_size_that_leaves_no_weight_for_the_blocks_is_refused_and_one_weight_a_block_is_not():
    with pytest.raises(ValueError, match=r"^80 parameters cannot hold two 10 x 4 tables and 4 blocks$"):
        ModelShape.from_parameters("none", blocks=4, width=4, vocab=10, parameters=80, bits_per_weight=8,
                                   kv_heads_width=6)
    one = ModelShape.from_parameters("one", blocks=4, width=4, vocab=10, parameters=84, bits_per_weight=8,
                                     kv_heads_width=6)
    assert one.block_parameters == 1 and one.block_bytes == (1, 1, 1, 1)


def test_a_compute_bound_roofline_stage_counts_its_blocks_weights_and_the_heads_on_the_last_stage():
    # 2 flops a weight a token at 2 flops/s: seconds = weights x tokens, plus the fixed 0.5 s;
    # the weight reads (at most 570 bytes at 1000 bytes/s) take under a second
    machine = Machine("m", memory_bytes=1e9, bytes_per_second=1000.0, flops_per_second=2.0, pass_overhead_seconds=0.5)
    assert machine.stage_seconds(SHAPE, 1, 3, 5) == 0.5 + 2 * 7 * 5
    assert machine.stage_seconds(SHAPE, 2, 4, 5) == 0.5 + (2 * 7 + 11) * 5


def test_a_memory_bound_roofline_stage_reads_its_weights_once_per_pass():
    machine = Machine("m", memory_bytes=1e9, bytes_per_second=10.0, flops_per_second=1e12, pass_overhead_seconds=0.5)
    assert machine.stage_seconds(SHAPE, 2, 4, 5) == pytest.approx(0.5 + (30 + 40 + 500) / 10.0)


def test_a_measured_stage_pays_the_fixed_time_its_blocks_and_on_the_last_stage_the_head():
    # each curve measured at 1 and 3 tokens; at 2 tokens it is halfway
    machine = MeasuredMachine("measured", 1e9, block=BatchCurve((1, 3), (10.0, 30.0)),
                              head=BatchCurve((1, 3), (100.0, 300.0)), fixed=BatchCurve((1, 3), (1.0, 3.0)))
    assert machine.stage_seconds(SHAPE, 1, 3, 2) == pytest.approx(2.0 + 2 * 20.0)
    assert machine.stage_seconds(SHAPE, 2, 4, 2) == pytest.approx(2.0 + 2 * 20.0 + 200.0)
    assert machine.stage_seconds(SHAPE, 0, 1, 3) == pytest.approx(3.0 + 30.0)


def _costs(links, hosts=None) -> StageCosts:
    """Three stages of SHAPE: blocks [0, 1), [1, 3), [3, 4)."""
    machine = Machine("m", 1e9, 1e9, 1e12)
    software = Software(hop_seconds=0.5, coordinator_pass_seconds=1.0, coordinator_row_seconds=0.25,
                        local_bytes_per_second=64.0, draft_call_seconds=0.125)
    return StageCosts(SHAPE, [machine] * 3, (0, 1, 3), links, software, (0.01, 0.02, 0.03), hosts=hosts)


def test_each_stage_runs_from_its_start_to_the_next_stage_start_and_the_last_to_the_end():
    costs = _costs([None, None, None])
    assert costs.stage_count == 3
    assert [costs.stage_range(stage) for stage in range(3)] == [(0, 1), (1, 3), (3, 4)]


def test_a_hop_over_a_link_pays_the_software_hop_the_latency_and_the_bytes_at_the_links_rate():
    costs = _costs([Link(0.25, 32.0), Link(0.125, 64.0), Link(0.0625, 128.0)])
    assert costs.hop_seconds(0, 5) == 0.5  # coordinator to stage 0: the software hop alone
    assert costs.hop_seconds(1, 5) == 0.5 + 0.25 + 5 * 8 * 4 / 32.0  # 5 rows of 8 floats
    assert costs.hop_seconds(2, 5) == 0.5 + 0.125 + 5 * 8 * 4 / 64.0
    assert costs.hop_seconds(3, 5) == 0.5 + 0.0625 + 5 * 4 / 128.0  # back: 5 token ids, not logits


def test_a_hop_on_one_machine_pays_the_software_hop_and_every_row_after_the_first_at_the_socket_rate():
    # links[0] joins stages 0 and 1; stages 1 and 2 share a machine, and no link is given back to the coordinator
    costs = _costs([Link(0.25, 32.0), None])
    assert costs.hop_seconds(1, 5) == 0.5 + 0.25 + 5 * 8 * 4 / 32.0
    assert costs.hop_seconds(2, 5) == 0.5 + 4 * 8 * 4 / 64.0  # 4 more rows of 8 floats at 64 bytes/s
    assert costs.hop_seconds(3, 5) == 0.5 + 4 * 4 / 64.0  # 4 more token ids
    assert costs.hop_seconds(3, 1) == 0.5  # one row: the measured hop already carried it


def test_the_coordinator_pays_its_time_per_pass_and_its_time_per_row_after_the_first():
    costs = _costs([None, None, None])
    assert costs.coordinator_seconds(1) == 1.0
    assert costs.coordinator_seconds(5) == 1.0 + 4 * 0.25


def test_stages_run_on_the_hosts_given_or_each_on_its_own():
    assert [_costs([None] * 3, hosts=(0, 0, 1)).host(stage) for stage in range(3)] == [0, 0, 1]
    assert [_costs([None] * 3).host(stage) for stage in range(3)] == [0, 1, 2]


def test_drafting_costs_come_from_the_drafter_beside_each_stage_and_the_software_call():
    costs = _costs([None] * 3)
    assert [costs.draft_seconds(machine) for machine in range(3)] == [0.01, 0.02, 0.03]
    assert costs.draft_call_seconds() == 0.125


def test_a_stage_needs_its_weights_its_kv_cache_for_the_context_and_the_draft_model():
    costs = _costs([None] * 3)
    # stage 1 holds blocks 1 and 2: 20 + 30 bytes of weights, 2 blocks x 10 positions x 3 bytes of cache
    assert costs.memory_needed(1, context=10, draft_bytes=7) == 20 + 30 + 2 * 10 * 3 + 7
    assert costs.memory_needed(2, context=10, draft_bytes=0) == 40 + 500 + 1 * 10 * 3


def test_a_split_profile_needs_two_stage_files():
    with pytest.raises(ValueError, match=r"^profiling the costs of a split needs at least two stage files$"):
        split_costs([{"first_block": 0, "end_block": 4, "seconds": [1.0]}], {"seconds": [1.0]})


def test_a_three_stage_split_shares_the_fixed_cost_and_takes_the_block_from_every_inner_stage():
    # blocks [0, 2), [2, 6), [6, 10); the stages' times do not quite agree (noise):
    # k = 3 stages hold 2 fixed costs more than the whole: fixed = (2 + 4 + 7 - 10) / 2 = 1.5;
    # block = ((2 - 1.5) + (4 - 1.5)) / (2 + 4) = 0.5; head = 7 - 1.5 - 4 x 0.5 = 3.5
    stages = [{"first_block": 0, "end_block": 2, "seconds": [2.0]},
              {"first_block": 2, "end_block": 6, "seconds": [4.0]},
              {"first_block": 6, "end_block": 10, "seconds": [7.0]}]
    assert split_costs(stages, {"seconds": [10.0]}) == {
        "fixed_seconds": [1.5], "block_seconds": [0.5], "head_seconds": [3.5]}
