import pytest

from stages.layer_rules import SplitRuleError, layer_rules, slice_metadata_overrides, sliding_window_pattern


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


def test_a_period_read_from_metadata_refuses_other_boundaries():
    """An architecture with no period of its own: only the metadata says every 4th layer is full attention."""
    metadata = {"general.architecture": "qwen3next", "qwen3next.block_count": 48, "qwen3next.full_attention_interval": 4}
    assert layer_rules({"general.architecture": "qwen3next", "qwen3next.block_count": 48}).boundary_period == 1
    rules = layer_rules(metadata)
    assert rules.boundary_period == 4
    rules.check_boundaries([0, 24])
    with pytest.raises(SplitRuleError, match="boundary 6 cannot be exact for qwen3next: qwen3next.full_attention_interval is 4"):
        rules.check_boundaries([0, 6])


def test_metadata_and_fixed_periods_combine_to_their_least_common_multiple():
    rules = layer_rules({"general.architecture": "llama4", "llama4.block_count": 48, "llama4.interleave_moe_layer_step": 3})
    assert rules.boundary_period == 12
    assert rules.allowed_boundaries() == [12, 24, 36]
    with pytest.raises(SplitRuleError, match="interleave_moe_layer_step is 3"):
        rules.check_boundaries([0, 8])


def test_dense_first_pattern_puts_full_attention_at_the_start_of_each_period():
    metadata = {"general.architecture": "cohere2moe", "cohere2moe.block_count": 10}
    pattern = sliding_window_pattern(metadata)
    assert pattern == [layer % 4 != 0 for layer in range(10)]
    assert pattern[0] is False and pattern[4] is False and pattern[3] is True
    # a slice from block 3 carries its part: full attention at blocks 4 and 8 -> slice layers 1 and 5
    overrides = slice_metadata_overrides(metadata, 3, 7)
    assert overrides["cohere2moe.attention.sliding_window_pattern"] == [i not in (1, 5) for i in range(7)]


def test_a_pattern_stored_as_an_integer_replaces_the_architectures_period():
    metadata = {**gemma3_metadata(12), "gemma3.attention.sliding_window_pattern": 4}
    assert sliding_window_pattern(metadata) == [layer % 4 < 3 for layer in range(12)]
    dense_first = {"general.architecture": "cohere2moe", "cohere2moe.block_count": 9,
                   "cohere2moe.attention.sliding_window_pattern": 3}
    assert sliding_window_pattern(dense_first) == [layer % 3 != 0 for layer in range(9)]


def test_a_pattern_stored_as_an_array_is_taken_as_is():
    flags = [True, False, False, True, True]
    metadata = {**gemma3_metadata(5), "gemma3.attention.sliding_window_pattern": flags}
    assert sliding_window_pattern(metadata) == flags


def test_llama4_without_chunked_attention_is_refused():
    metadata = {"general.architecture": "llama4", "llama4.block_count": 48, "llama4.attention.sliding_window": 0}
    with pytest.raises(SplitRuleError, match="llama4 without chunked attention"):
        layer_rules(metadata)
    assert layer_rules({**metadata, "llama4.attention.sliding_window": 8192}).boundary_period == 4


# -- the messages of refused boundaries, periods of 1 and 2, patterns of 0 and 1, and slices in the middle

def rules(architecture="llama", blocks=30, **extra):
    return layer_rules({"general.architecture": architecture, f"{architecture}.block_count": blocks,
                        **{f"{architecture}.{key}": value for key, value in extra.items()}})


def test_boundary_messages_name_what_is_wrong():
    model = rules(blocks=30)
    with pytest.raises(SplitRuleError, match=r"^the first stage must start at block 0$"):
        model.check_boundaries([1, 10])
    with pytest.raises(SplitRuleError, match=r"^boundaries must increase: \[20, 10\]$"):
        model.check_boundaries([0, 20, 10])
    with pytest.raises(SplitRuleError, match=r"^boundary 40 leaves the last stage empty \(the model has 30 blocks, 0\.\.29\)$"):
        model.check_boundaries([0, 4, 40])


def test_a_refused_boundary_lists_the_valid_ones():
    model = rules("smollm3", blocks=18)
    with pytest.raises(SplitRuleError) as error:
        model.check_boundaries([0, 6])
    assert str(error.value) == ("boundary 6 cannot be exact for smollm3: llama.cpp skips RoPE on every 4th layer; "
                                "valid boundaries are multiples of 4: [4, 8, 12, 16]")


def test_a_step_of_two_is_a_period_and_a_step_of_one_is_none():
    assert rules(full_attention_interval=2).boundary_period == 2
    one = rules(full_attention_interval=1)
    assert (one.boundary_period, one.period_reason) == (1, "")


def test_the_reasons_of_combined_periods_are_all_given():
    model = rules("llama4", blocks=48, interleave_moe_layer_step=2)
    assert model.period_reason == "llama.cpp skips RoPE on every 4th layer; llama4.interleave_moe_layer_step is 2"


def test_refusals_explain_themselves():
    with pytest.raises(SplitRuleError, match=r"^glm4moe with 1 multi-token-prediction blocks at the end cannot be "
                                             r"split \(llama\.cpp counts them by position\)$"):
        rules("glm4moe", nextn_predict_layers=1)
    with pytest.raises(SplitRuleError, match=r"^llama4 without chunked attention skips RoPE on the model's last layer "
                                             r"only, which a slice cannot express$"):
        layer_rules({"general.architecture": "llama4", "llama4.block_count": 48, "llama4.attention.sliding_window": 0})


@pytest.mark.parametrize("architecture", ["gemma3", "cohere2moe"])  # last-of-period and dense-first
def test_a_stored_pattern_of_0_makes_every_layer_sliding_and_of_1_none(architecture):
    def pattern(stored):
        return sliding_window_pattern({"general.architecture": architecture, f"{architecture}.block_count": 4,
                                       f"{architecture}.attention.sliding_window_pattern": stored})

    assert pattern(0) == [True] * 4
    assert pattern(1) == [False] * 4


def test_a_slice_in_the_middle_carries_only_its_own_layers():
    metadata = {"general.architecture": "gemma3", "gemma3.block_count": 12,
                "gemma3.feed_forward_length": list(range(100, 112)), "gemma3.leading_dense_block_count": 3}
    overrides = slice_metadata_overrides(metadata, 4, 4)
    assert overrides["gemma3.block_count"] == 4
    assert overrides["gemma3.feed_forward_length"] == [104, 105, 106, 107]
    assert overrides["gemma3.attention.sliding_window_pattern"] == [True, False, True, True]  # layer 5 is global
    assert overrides["gemma3.leading_dense_block_count"] == 0  # the dense lead ends before the slice
