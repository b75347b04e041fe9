from stages.plan import balanced_starts, stage_ranges

import pytest

pytestmark = pytest.mark.pure


def test_equal_blocks_split_evenly():
    assert balanced_starts([1] * 30, 2, list(range(1, 30))) == [0, 15]
    assert balanced_starts([1] * 30, 3, list(range(1, 30))) == [0, 10, 20]


def test_uneven_blocks_balance_the_largest_stage():
    # one heavy block first: it gets a stage of its own
    assert balanced_starts([10, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, list(range(1, 10))) == [0, 1]


def test_only_allowed_boundaries_are_used():
    assert balanced_starts([1] * 18, 2, [6, 12]) in ([0, 6], [0, 12])
    assert balanced_starts([1] * 18, 3, [6, 12]) == [0, 6, 12]


def test_too_few_boundaries_is_an_error():
    with pytest.raises(ValueError, match="need 2 boundaries"):
        balanced_starts([1] * 18, 3, [6])


def test_one_stage_and_ranges():
    assert balanced_starts([1] * 5, 1, []) == [0]
    assert stage_ranges([0, 10, 20], 30) == [(0, 10), (10, 20), (20, 30)]
