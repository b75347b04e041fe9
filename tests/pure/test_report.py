"""What `orchestrate plan` prints, built in-process (orchestrator.planning.report).

A setup of two named machines and a recommendation with hand-chosen
predictions, so every figure of the table and of the JSON object is known:
the lines are compared whole, character for character, and the JSON object
key for key. The per-stage times are worked out here from the roofline
(overhead + the larger of weight reads over bandwidth and 2 flops a weight
a token over compute), not taken from the planner.
"""

from __future__ import annotations

import pytest

from orchestrator.planning.costs import Link, Machine, ModelShape, Software
from orchestrator.planning.search import Recommendation
from orchestrator.planning.report import MODE_NAMES, plan_json, plan_lines
from orchestrator.planning.inputs import Setup
from orchestrator.planning.simulation import DraftBehaviour, Mode, Prediction


# 4 blocks of 248976 one-byte weights, untied 128 x 16 embedding and head (2048 weights each)
MODEL = ModelShape.from_parameters(name="tiny", blocks=4, width=16, vocab=128, parameters=1e6, bits_per_weight=8,
                                   kv_heads_width=8)
BLOCK = 248976
TABLE = 2048
# compute-bound machines (1e8 and 2e8 flops/s), so one token and two take different times
MACHINE_A = Machine("alpha", memory_bytes=10.4e9, bytes_per_second=100e9, flops_per_second=1e8,
                    pass_overhead_seconds=0.001)
MACHINE_B = Machine("beta", memory_bytes=31.5e9, bytes_per_second=50e9, flops_per_second=2e8)
BEHAVIOUR = DraftBehaviour(acceptance=0.7, availability=0.5, first_acceptance=0.4, continuation=0.9)

PLAIN = Prediction(Mode("plain"), tokens_per_second=10.0, passes_per_token=1.0, acceptance_rate=0.0,
                   discarded_passes_per_run=0.0, stage_busy_fraction=(0.5, 0.25))
SYNC = Prediction(Mode("sync", 4), tokens_per_second=15.0, passes_per_token=0.625, acceptance_rate=0.6,
                  discarded_passes_per_run=1.5, stage_busy_fraction=(0.75, 0.5))
ASYNC = Prediction(Mode("async", 8), tokens_per_second=12.5, passes_per_token=0.8125, acceptance_rate=0.55,
                   discarded_passes_per_run=3.25, stage_busy_fraction=(0.875, 0.625))

HEADER = "mode                  tokens/s  passes/token  draft max  vs plain"


def setup(behaviour: DraftBehaviour | None = BEHAVIOUR, draft_seconds=(0.003, 0.002)) -> Setup:
    return Setup(model=MODEL, machines=[MACHINE_A, MACHINE_B], links=[Link(0.001, 1e9)] * 2,
                 software=Software(500e-6, 20e-6, 10e-6), behaviour=behaviour,
                 draft_seconds=list(draft_seconds) if draft_seconds is not None else None, max_tokens=96)


def recommendation(predictions: dict[str, Prediction]) -> Recommendation:
    return Recommendation(starts=(0, 3), blocks_per_machine=(3, 1), memory_needed=(1_350_000_000, 4_567_000_000),
                          predictions=predictions)


def one_token_ms(machine: Machine, weight_bytes: float, parameters: float) -> float:
    return 1e3 * (machine.pass_overhead_seconds + max(weight_bytes / machine.bytes_per_second,
                                                      2 * parameters / machine.flops_per_second))


def test_gigabytes_are_rounded_to_the_nearest_shown_digit():
    # 1.35e9 bytes is 1.4 GB and 31.5e9 is 32 GB (half to even): a divisor a little off 1e9 would show 1.3 and 31
    lines = plan_lines(setup(), recommendation({"plain": PLAIN}))
    assert ", 1.4 GB of 10 GB," in lines[1] and ", 4.6 GB of 32 GB," in lines[2]


def test_the_worked_stage_times_are_compute_bound_and_distinct():
    # stage 0: blocks 0..2 and the embedding (read, not computed); stage 1: block 3 and the head
    assert one_token_ms(MACHINE_A, 3 * BLOCK + TABLE, 3 * BLOCK) == pytest.approx(15.93856)
    assert one_token_ms(MACHINE_B, BLOCK + TABLE, BLOCK + TABLE) == pytest.approx(2.51024)


def test_plan_lines_of_a_speculative_plan_show_stages_draft_modes_and_the_recommendation():
    lines = plan_lines(setup(), recommendation({"plain": PLAIN, "sync": SYNC, "async": ASYNC}))
    assert lines == [
        "tiny: 4 blocks over 2 stages",
        "  stage 0 on alpha: blocks [0, 3) (3 blocks), 1.4 GB of 10 GB, one token 15.94 ms",
        "  stage 1 on beta: blocks [3, 4) (1 blocks), 4.6 GB of 32 GB, one token 2.51 ms",
        "draft: acceptance 0.40 first, 0.70 later; availability 0.50, continuation 0.90; 2.000 ms per token",
        HEADER,
        "plain pipeline           10.00          1.00          -     1.00x",
        "sync speculation         15.00          0.62          4     1.50x",
        "async speculation        12.50          0.81          8     1.25x",
        "recommended: sync speculation with --draft-max 4, stages starting at blocks [0, 3]",
    ]


def test_the_mode_table_columns_line_up_under_the_header():
    lines = plan_lines(setup(), recommendation({"plain": PLAIN, "sync": SYNC, "async": ASYNC}))
    header = lines.index(HEADER)
    for row in lines[header + 1:header + 4]:
        assert len(row) == len(HEADER)


def test_plan_lines_recommend_the_fastest_mode_even_when_it_is_async():
    faster_async = Prediction(Mode("async", 12), 30.0, 0.5, 0.9, 0.0, (1.0, 1.0))
    lines = plan_lines(setup(), recommendation({"plain": PLAIN, "sync": SYNC, "async": faster_async}))
    assert lines[-2] == "async speculation        30.00          0.50         12     3.00x"
    assert lines[-1] == "recommended: async speculation with --draft-max 12, stages starting at blocks [0, 3]"


def test_plan_lines_of_a_plain_plan_have_no_draft_line_and_no_draft_max():
    lines = plan_lines(setup(behaviour=None, draft_seconds=None), recommendation({"plain": PLAIN}))
    assert lines == [
        "tiny: 4 blocks over 2 stages",
        "  stage 0 on alpha: blocks [0, 3) (3 blocks), 1.4 GB of 10 GB, one token 15.94 ms",
        "  stage 1 on beta: blocks [3, 4) (1 blocks), 4.6 GB of 32 GB, one token 2.51 ms",
        HEADER,
        "plain pipeline           10.00          1.00          -     1.00x",
        "recommended: plain pipeline, stages starting at blocks [0, 3]",
    ]


def test_plan_lines_recommend_plain_without_a_draft_max_when_speculation_is_slower():
    slow_sync = Prediction(Mode("sync", 2), 5.0, 1.0, 0.1, 0.0, (0.1, 0.1))
    lines = plan_lines(setup(), recommendation({"plain": PLAIN, "sync": slow_sync}))
    assert lines[-2] == "sync speculation          5.00          1.00          2     0.50x"
    assert lines[-1] == "recommended: plain pipeline, stages starting at blocks [0, 3]"


def test_a_draft_without_per_machine_times_shows_zero_milliseconds():
    lines = plan_lines(setup(draft_seconds=None), recommendation({"plain": PLAIN, "sync": SYNC}))
    assert lines[3] == "draft: acceptance 0.40 first, 0.70 later; availability 0.50, continuation 0.90; 0.000 ms per token"


def test_the_draft_line_shows_the_cheapest_machines_time_per_token():
    lines = plan_lines(setup(draft_seconds=(0.0125, 0.5)), recommendation({"plain": PLAIN, "sync": SYNC}))
    assert lines[3].endswith("; 12.500 ms per token")


def test_a_draft_without_a_first_acceptance_shows_the_later_one_twice():
    behaviour = DraftBehaviour(acceptance=0.35, availability=1.0, continuation=0.25)
    lines = plan_lines(setup(behaviour=behaviour), recommendation({"plain": PLAIN, "sync": SYNC}))
    assert lines[3] == "draft: acceptance 0.35 first, 0.35 later; availability 1.00, continuation 0.25; 2.000 ms per token"


def test_a_stage_line_prices_each_stage_on_its_own_machine_and_blocks():
    # the split (0, 1): stage 0 one block and the embedding on alpha, stage 1 three blocks and the head on beta
    plan = Recommendation(starts=(0, 1), blocks_per_machine=(1, 3), memory_needed=(5e8, 2e9), predictions={"plain": PLAIN})
    lines = plan_lines(setup(behaviour=None), plan)
    first = one_token_ms(MACHINE_A, BLOCK + TABLE, BLOCK)
    last = one_token_ms(MACHINE_B, 3 * BLOCK + TABLE, 3 * BLOCK + TABLE)
    assert lines[1] == f"  stage 0 on alpha: blocks [0, 1) (1 blocks), 0.5 GB of 10 GB, one token {first:.2f} ms"
    assert lines[2] == f"  stage 1 on beta: blocks [1, 4) (3 blocks), 2.0 GB of 32 GB, one token {last:.2f} ms"
    assert (f"{first:.2f}", f"{last:.2f}") == ("5.98", "7.49")
    assert lines[-1] == "recommended: plain pipeline, stages starting at blocks [0, 1]"


def test_every_mode_has_a_display_name():
    assert MODE_NAMES == {"plain": "plain pipeline", "sync": "sync speculation", "async": "async speculation"}


def test_plan_json_of_a_speculative_plan_holds_every_figure():
    assert plan_json(setup(), recommendation({"plain": PLAIN, "sync": SYNC, "async": ASYNC})) == {
        "model": "tiny",
        "starts": [0, 3],
        "blocks_per_stage": [3, 1],
        "memory_needed_bytes": [1_350_000_000, 4_567_000_000],
        "machines": ["alpha", "beta"],
        "draft_behaviour": {"acceptance_first": 0.4, "acceptance_later": 0.7, "availability": 0.5,
                            "continuation": 0.9},
        "max_tokens": 96,
        "predictions": {
            "plain": {"tokens_per_second": 10.0, "draft_max": None, "passes_per_token": 1.0, "acceptance_rate": 0.0,
                      "discarded_passes_per_run": 0.0, "stage_busy_fraction": [0.5, 0.25]},
            "sync": {"tokens_per_second": 15.0, "draft_max": 4, "passes_per_token": 0.625, "acceptance_rate": 0.6,
                     "discarded_passes_per_run": 1.5, "stage_busy_fraction": [0.75, 0.5]},
            "async": {"tokens_per_second": 12.5, "draft_max": 8, "passes_per_token": 0.8125,
                      "acceptance_rate": 0.55, "discarded_passes_per_run": 3.25,
                      "stage_busy_fraction": [0.875, 0.625]},
        },
    }


def test_plan_json_of_a_plain_plan_has_no_draft_behaviour():
    plan = plan_json(setup(behaviour=None, draft_seconds=None), recommendation({"plain": PLAIN}))
    assert plan["draft_behaviour"] is None
    assert list(plan["predictions"]) == ["plain"]
    assert plan["predictions"]["plain"]["draft_max"] is None


def test_plan_json_lists_are_plain_lists_for_json():
    plan = plan_json(setup(), recommendation({"plain": PLAIN, "sync": SYNC}))
    for value in (plan["starts"], plan["blocks_per_stage"], plan["memory_needed_bytes"], plan["machines"],
                  plan["predictions"]["sync"]["stage_busy_fraction"]):
        assert type(value) is list


def test_plan_json_names_the_first_acceptance_from_the_later_one_when_not_given():
    behaviour = DraftBehaviour(acceptance=0.35, availability=1.0, continuation=0.25)
    plan = plan_json(setup(behaviour=behaviour), recommendation({"plain": PLAIN, "sync": SYNC}))
    assert plan["draft_behaviour"] == {"acceptance_first": 0.35, "acceptance_later": 0.35, "availability": 1.0,
                                       "continuation": 0.25}
