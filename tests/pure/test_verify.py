"""Verification (speculators.verify): what a pass commits of its drafts, greedy and sampled, with numpy alone."""

import numpy as np
import pytest

from speculators.sampling import SamplingSettings, choose_token
from speculators.verify import verify


def one_hot_logits(tokens, vocab=10):
    logits = np.zeros((len(tokens), vocab), dtype=np.float32)
    for row, token in enumerate(tokens):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_the_matching_prefix_then_corrects():
    logits = one_hot_logits([4, 5, 9, 1])  # the target wants 4 5 9 1
    assert verify([4, 5, 6], logits, 10, SamplingSettings()) == [4, 5, 9]
    assert verify([4, 5, 9], logits, 10, SamplingSettings()) == [4, 5, 9, 1]  # all accepted + bonus
    assert verify([7, 5, 9], logits, 10, SamplingSettings()) == [4]
    assert verify([], logits[:1], 10, SamplingSettings()) == [4]


def test_sampled_verification_equals_plain_sampling_for_any_draft():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 8)).astype(np.float32)
    settings = SamplingSettings(temperature=1.0, seed=9)
    plain = [choose_token(logits[row], 20 + row, settings) for row in range(6)]
    for _ in range(50):
        draft = rng.integers(0, 8, size=5).tolist()
        committed = verify(draft, logits, 20, settings)
        assert committed == plain[: len(committed)]
        accepted = len(committed) - 1
        assert draft[:accepted] == plain[:accepted]
    assert verify(plain[:5], logits, 20, settings) == plain  # a perfect draft commits all six


def test_rows_must_match_drafts():
    with pytest.raises(ValueError, match="need drafts \\+ 1"):
        verify([1, 2], one_hot_logits([1, 2]), 0, SamplingSettings())


# -- the refusal of a row count that does not match the drafts, word for word

def test_a_row_count_that_does_not_match_the_drafts_is_named():
    logits = np.zeros((3, 50), dtype=np.float32)
    with pytest.raises(ValueError, match=r"^3 logits rows for 1 drafts \(need drafts \+ 1\)$"):
        verify([7], logits, 0, SamplingSettings())
