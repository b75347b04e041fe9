import pytest

from stages.layer_rules import SplitRuleError, layer_rules, slice_metadata_overrides, sliding_window_pattern

pytestmark = pytest.mark.pure


def gemma3_metadata(blocks: int = 18) -> dict:
    return {"general.architecture": "gemma3", "gemma3.block_count": blocks, "gemma3.attention.sliding_window": 512}


def test_gemma3_pattern_is_five_local_one_global():
    pattern = sliding_window_pattern(gemma3_metadata())
    assert pattern == [layer % 6 < 5 for layer in range(18)]
    assert pattern[5] is False and pattern[11] is False and pattern[0] is True


def test_slice_carries_its_part_of_the_pattern_so_any_boundary_is_exact():
    overrides = slice_metadata_overrides(gemma3_metadata(), 9, 9)
    assert overrides["gemma3.block_count"] == 9
    # blocks 9..17: global attention at 11 and 17 -> slice layers 2 and 8
    assert overrides["gemma3.attention.sliding_window_pattern"] == [i not in (2, 8) for i in range(9)]
    assert layer_rules(gemma3_metadata()).boundary_period == 1


def test_per_layer_arrays_are_sliced_and_dense_lead_is_shifted():
    metadata = {
        "general.architecture": "deepseek2",
        "deepseek2.block_count": 4,
        "deepseek2.attention.head_count_kv": [1, 2, 3, 4],
        "deepseek2.leading_dense_block_count": 3,
    }
    overrides = slice_metadata_overrides(metadata, 2, 2)
    assert overrides["deepseek2.attention.head_count_kv"] == [3, 4]
    assert overrides["deepseek2.leading_dense_block_count"] == 1


def test_hard_coded_period_refuses_other_boundaries():
    rules = layer_rules({"general.architecture": "smollm3", "smollm3.block_count": 36})
    rules.check_boundaries([0, 16])
    with pytest.raises(SplitRuleError, match="boundary 15 cannot be exact for smollm3.*multiples of 4"):
        rules.check_boundaries([0, 15])


def test_moe_step_from_metadata_sets_the_period():
    rules = layer_rules({"general.architecture": "llama4", "llama4.block_count": 48, "llama4.interleave_moe_layer_step": 2})
    assert rules.boundary_period == 4
    assert rules.allowed_boundaries()[:3] == [4, 8, 12]


def test_unsplittable_layouts_are_refused():
    with pytest.raises(SplitRuleError, match="multi-token-prediction"):
        layer_rules({"general.architecture": "glm4moe", "glm4moe.block_count": 47, "glm4moe.nextn_predict_layers": 1})
    with pytest.raises(SplitRuleError, match="gemma3n cannot be split"):
        layer_rules({"general.architecture": "gemma3n", "gemma3n.block_count": 30})


@pytest.mark.parametrize("starts, message", [([0, 0], "increase"), ([0, 30], "empty"), ([5], "block 0")])
def test_boundary_shape_errors(starts, message):
    with pytest.raises(SplitRuleError, match=message):
        layer_rules({"general.architecture": "llama", "llama.block_count": 30}).check_boundaries(starts)
