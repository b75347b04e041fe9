import numpy as np
import pytest

from speculators.sampling import SamplingSettings, choose_token, token_probabilities

pytestmark = pytest.mark.pure


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert choose_token(logits, 7, SamplingSettings()) == 1


def test_draw_depends_only_on_seed_and_position():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=50).astype(np.float32)
    settings = SamplingSettings(temperature=1.0, seed=5)
    forward = [choose_token(logits, position, settings) for position in range(40)]
    backward = [choose_token(logits, position, settings) for position in reversed(range(40))][::-1]
    assert forward == backward
    other_seed = [choose_token(logits, position, SamplingSettings(temperature=1.0, seed=6)) for position in range(40)]
    assert other_seed != forward


def test_samples_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    settings = SamplingSettings(temperature=1.0, seed=3)
    counts = np.bincount([choose_token(logits, position, settings) for position in range(4000)], minlength=3)
    assert np.allclose(counts / 4000, [0.5, 0.3, 0.2], atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    probabilities = token_probabilities(logits, SamplingSettings(temperature=1.0, top_p=0.75))
    assert probabilities[2] == 0 and probabilities[3] == 0
    assert np.isclose(probabilities[:2].sum(), 1.0)
    settings = SamplingSettings(temperature=1.0, top_p=0.75, seed=0)
    assert {choose_token(logits, position, settings) for position in range(300)} == {0, 1}


def test_a_tiny_temperature_is_greedy_not_nan():
    """The maximum is subtracted before dividing: no overflow however small the temperature."""
    logits = np.array([1.0, 3.0, 2.9, -5.0], np.float32)
    settings = SamplingSettings(temperature=1e-300, seed=1)
    probabilities = token_probabilities(logits, settings)
    assert np.all(np.isfinite(probabilities)) and probabilities.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert all(choose_token(logits, position, settings) == 1 for position in range(20))
