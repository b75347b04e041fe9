from stages.plan import balanced_starts, stage_ranges

import pytest


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


# -- unequal blocks, block 0 offered as a boundary, and no stages

def largest_stage(costs, starts):
    ends = starts[1:] + [len(costs)]
    return max(sum(costs[first:end]) for first, end in zip(starts, ends))


def test_at_least_one_stage():
    with pytest.raises(ValueError, match=r"^at least one stage is needed$"):
        balanced_starts([1, 1], 0, [1])


def test_unequal_blocks_balance_by_cost_not_by_count():
    assert balanced_starts([1, 1, 1, 10], 2, [1, 2, 3]) == [0, 3]
    assert balanced_starts([10, 1, 1, 1], 2, [1, 2, 3]) == [0, 1]
    assert balanced_starts([4, 1, 1, 1, 1, 4], 3, [1, 2, 3, 4, 5]) == [0, 1, 5]
    # 2 | 5 2 | 8 and 2 5 | 2 | 8 are both best (largest stage 8); 2 | 5 | 2 8 is not
    assert largest_stage([2, 5, 2, 8], balanced_starts([2, 5, 2, 8], 3, [1, 2, 3])) == 8


def test_block_0_is_not_a_boundary():
    with pytest.raises(ValueError, match=r"2 stages need 1 boundaries, but only 0 exact boundaries exist"):
        balanced_starts([1, 1, 1], 2, [0])
    assert balanced_starts([1, 1, 1, 1], 2, [0, 2]) == [0, 2]
