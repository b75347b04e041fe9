"""Verification and prompt lookup, with numpy alone."""

import subprocess
import sys

import numpy as np
import pytest

from speculators.sampling import SamplingSettings, choose_token
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.verify import verify

pytestmark = pytest.mark.pure


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


def test_prompt_lookup_copies_what_followed_the_longest_recent_match():
    speculator = PromptLookupSpeculator(max_ngram=3)
    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert speculator.extend(text) == 4  # "1 2 3" (longest) was followed by 4
    assert PromptLookupSpeculator(max_ngram=2).extend(text) == 7  # "2 3" most recently by 7
    assert PromptLookupSpeculator(max_ngram=3).extend(text[:-1]) == 3  # "1 2" -> 3
    assert speculator.extend([5, 6, 7]) is None
    assert speculator.extend([1, 2, 3, 9, 9, 1, 2, 3]) == 9


def test_importing_speculators_loads_neither_ray_nor_llama_cpp():
    code = (
        "import sys, speculators, speculators.verify, speculators.prompt_lookup;"
        "print('ray' in sys.modules, 'llama_cpp' in sys.modules)"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "False"]
