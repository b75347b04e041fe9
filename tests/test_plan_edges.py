"""Split-plan edges found by mutation testing: unequal blocks, block 0 offered
as a boundary, and no stages."""

import pytest

from stages.plan import balanced_starts

pytestmark = pytest.mark.pure


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
