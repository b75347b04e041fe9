"""Batch-cost curve edges found by mutation testing: one measured size, two,
and past the largest."""

import pytest

from orchestrator.planning.costs import BatchCurve

pytestmark = pytest.mark.pure


def test_a_curve_needs_one_time_per_size_in_increasing_order():
    for sizes, seconds in (((1, 2), (0.1,)), ((), ()), ((2, 1), (0.1, 0.2)), ((1, 1), (0.1, 0.2))):
        with pytest.raises(ValueError, match=r"^a batch curve needs increasing sizes, one time each$"):
            BatchCurve(sizes, seconds)


def test_one_measured_size_costs_the_same_for_any_batch():
    assert BatchCurve((4,), (0.5,)).at(1) == 0.5
    assert BatchCurve((4,), (0.5,)).at(64) == 0.5


def test_between_and_beyond_the_measured_sizes_the_curve_is_linear_by_segment():
    two = BatchCurve((1, 5), (1.0, 3.0))
    assert two.at(1) == 1.0 and two.at(3) == pytest.approx(2.0) and two.at(9) == pytest.approx(5.0)
    three = BatchCurve((1, 2, 4), (1.0, 2.0, 10.0))
    assert three.at(3) == pytest.approx(6.0)  # on the segment 2..4
    assert three.at(8) == pytest.approx(26.0)  # past 4: along the last segment
