import numpy as np
import pytest

from speculators.sampling import SamplingSettings, choose_token, token_probabilities


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


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_probabilities_are_the_softmax_of_logits_over_the_temperature(temperature):
    logits = np.array([2.0, 1.0, 0.5, -1.0], np.float32)
    expected = np.exp(logits.astype(np.float64) / temperature)
    expected /= expected.sum()
    probabilities = token_probabilities(logits, SamplingSettings(temperature=temperature))
    assert np.allclose(probabilities, expected, rtol=1e-9, atol=0)
    at_one = token_probabilities(logits, SamplingSettings(temperature=1.0))
    assert not np.allclose(probabilities, at_one, atol=0.05), "the temperature changed nothing"


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_samples_at_a_temperature_follow_softmax_of_logits_over_it(temperature):
    """Frequencies of 4000 seeded draws against softmax(logits / T): a chi-square
    statistic far below what drawing from softmax(logits) (T ignored) gives."""
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float64)).astype(np.float32)
    expected = np.exp(logits.astype(np.float64) / temperature)
    expected /= expected.sum()
    settings = SamplingSettings(temperature=temperature, seed=11)
    draws = 4000
    counts = np.bincount([choose_token(logits, position, settings) for position in range(draws)], minlength=3)
    chi_square = float((((counts - draws * expected) ** 2) / (draws * expected)).sum())
    # 2 degrees of freedom: P(chi2 > 20) is about 5e-5; T ignored gives more than 100 here
    assert chi_square < 20, (counts / draws, expected)


# -- top_p 1 keeps every token, and ties at the edge of the nucleus are kept in token order

def test_top_p_1_keeps_even_tokens_too_unlikely_to_move_the_cumulative_sum():
    logits = np.array([0.0, -40.0, -41.0], dtype=np.float32)  # exp(-40) is lost in 1 + exp(-40)
    probabilities = token_probabilities(logits, SamplingSettings(temperature=1.0, top_p=1.0))
    assert np.all(probabilities > 0)


def test_tied_tokens_at_the_edge_of_the_nucleus_are_kept_lowest_id_first():
    # many tokens share each logit: the nucleus ends inside a group of equal ones,
    # and which of them it keeps must not depend on the sort's algorithm
    logits = np.random.default_rng(0).integers(0, 4, size=1000).astype(np.float32)
    probabilities = token_probabilities(logits, SamplingSettings(temperature=1.0, top_p=0.5))
    kept = probabilities > 0
    edge = logits[kept].min()
    assert np.all(kept[logits > edge]) and not np.any(kept[logits < edge])
    tied = np.flatnonzero(logits == edge)
    kept_tied = kept[tied]
    assert 0 < kept_tied.sum() < len(tied), "the nucleus must end inside the tied group"
    assert kept_tied.tolist() == sorted(kept_tied.tolist(), reverse=True)  # lowest ids first


def test_close_distributions_draw_the_same_token_with_the_same_noise():
    """Coupling: a draft whose distribution is close to the target's draws the
    target's token at most positions with the seeded noise of that position,
    far more often than with another position's (independent draws)."""
    rng = np.random.default_rng(4)
    target = rng.normal(size=(200, 500)).astype(np.float32) * 3
    draft = target + rng.normal(size=target.shape).astype(np.float32) * 0.3
    settings = SamplingSettings(temperature=1.0, seed=9)
    same = np.mean([choose_token(target[row], row, settings) == choose_token(draft[row], row, settings)
                    for row in range(200)])
    other = np.mean([choose_token(target[row], row, settings) == choose_token(draft[row], row + 1000, settings)
                     for row in range(200)])
    assert same > 0.6 and other < 0.3, (same, other)
