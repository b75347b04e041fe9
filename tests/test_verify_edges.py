"""Verification edges found by mutation testing."""

import numpy as np
import pytest

from speculators.sampling import SamplingSettings
from speculators.verify import verify

pytestmark = pytest.mark.pure


def test_a_row_count_that_does_not_match_the_drafts_is_named():
    logits = np.zeros((3, 50), dtype=np.float32)
    with pytest.raises(ValueError, match=r"^3 logits rows for 1 drafts \(need drafts \+ 1\)$"):
        verify([7], logits, 0, SamplingSettings())
