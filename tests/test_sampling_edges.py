"""Sampling edges found by mutation testing: top_p 1 keeps every token, and
ties at the edge of the nucleus are kept in token order."""

import numpy as np
import pytest

from speculators.sampling import SamplingSettings, token_probabilities

pytestmark = pytest.mark.pure


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
