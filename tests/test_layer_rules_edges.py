"""Layer-rule edges found by mutation testing: the messages of refused
boundaries, periods of 1 and 2, patterns of 0 and 1, and slices in the middle."""

import pytest

from stages.layer_rules import SplitRuleError, layer_rules, sliding_window_pattern, slice_metadata_overrides

pytestmark = pytest.mark.pure


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
