"""Draft-policy edges found by mutation testing: the refusal messages, what
one window and one ask count for, how asks fade, the tie between two draft
lengths, when "no evidence yet" stops, and the medians of the step's timings."""

import pytest

from speculators.draft_length import FORGET, DraftPolicy, step_from_timings

pytestmark = pytest.mark.pure


def test_a_maximum_below_one_is_refused_naming_it():
    for maximum in (0, -2):
        with pytest.raises(ValueError, match=rf"^the draft maximum must be at least 1, not {maximum}$"):
            DraftPolicy(maximum)


def test_more_accepted_than_drafted_or_fewer_than_none_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"^2 accepted of 1 drafts$"):
        DraftPolicy(4).observe_window(1, 2)
    with pytest.raises(ValueError, match=r"^-1 accepted of 3 drafts$"):
        DraftPolicy(4).observe_window(3, -1)


def test_a_window_counts_its_accepted_drafts_and_the_one_rejected_after_them_only():
    policy = DraftPolicy(3)
    policy.observe_window(3, 0)  # draft 1 rejected: drafts 2 and 3 were never judged
    assert (policy.reached, policy.accepted) == ([1.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    other = DraftPolicy(3)
    other.observe_window(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 unjudged
    assert (other.reached, other.accepted) == ([1.0, 1.0, 0.0], [1.0, 0.0, 0.0])
    # position 1: (0 + 1/2) / (1 + 1) = 1/4; positions 2 and 3 have no evidence and lean on it
    assert policy.acceptances() == [0.25, 0.25, 0.25]


def test_a_window_longer_than_the_maximum_counts_only_the_maximum_positions():
    policy = DraftPolicy(2)
    policy.observe_window(5, 5)
    assert (policy.reached, policy.accepted) == ([1.0, 1.0], [1.0, 1.0])
    policy.observe_window(5, 1)  # after fading: 0.95 + 1 reached each, draft 2 rejected this time
    assert policy.reached == pytest.approx([1.95, 1.95]) and policy.accepted == pytest.approx([1.95, 0.95])


def test_each_ask_counts_once_and_the_availability_is_the_share_that_proposed():
    policy = DraftPolicy(2)
    assert policy.availability == 0.5  # the prior: half a proposal in one pseudo-ask
    policy.observe_ask(True)
    assert policy.availability == pytest.approx((1 + 0.5) / (1 + 1))
    policy.observe_ask(True)
    assert policy.availability == pytest.approx((2 + 0.5) / (2 + 1))
    policy.observe_ask(False)
    assert (policy.asked, policy.proposed) == (3.0, 2.0)
    assert policy.availability == pytest.approx((2 + 0.5) / (3 + 1))


def test_asks_fade_by_forget_with_every_window():
    policy = DraftPolicy(2)
    policy.observe_ask(True)
    policy.observe_ask(False)
    policy.observe_window(0, 0)
    assert policy.asked == pytest.approx(2 * FORGET) and policy.proposed == pytest.approx(FORGET)
    assert policy.availability == pytest.approx((0.95 + 0.5) / (1.9 + 1))


def test_a_draft_that_exactly_pays_for_its_row_is_not_taken():
    """step 1/2 and the first draft's prior acceptance 1/2: one draft commits
    1.5 tokens for 1.5 passes, the same rate as none; the tie goes to fewer drafts."""
    policy = DraftPolicy(1, step=0.5)
    policy.observe_ask(True)  # some evidence: the "draft once with none" rule is over
    assert policy.rate(1) == policy.rate(0) == 1.0
    assert policy.limit() == 0


def test_one_ask_is_evidence_enough_to_stop_the_first_probe():
    costly = DraftPolicy(4, step=0.8)
    assert costly.limit() == 1  # no evidence at all: one draft, to learn something
    costly.observe_ask(True)
    # availability 3/4: (1/4 + 3/4 * 1.5) / (1/4 + 3/4 * 1.8) = 1.375 / 1.6 < 1
    assert costly.rate(1) == pytest.approx(1.375 / 1.6)
    assert costly.limit() == 0


def test_the_step_comes_from_the_middle_timing_of_each_list():
    # medians 0.03 and 0.09: a 3-token batch is 3x one token, (3 - 1) / 2 = 1 per extra token
    assert step_from_timings([0.04, 0.01, 0.02, 0.03, 0.05], [0.09, 0.06, 0.12, 0.15, 0.03], 3) == pytest.approx(1.0)


def test_of_an_even_number_of_timings_the_upper_middle_one_is_taken():
    # one token: 0.01 and 0.02 -> 0.02; 2-token batch: 0.03 and 0.04 -> 0.04: (2 - 1) / 1
    assert step_from_timings([0.02, 0.01], [0.04, 0.03], 2) == pytest.approx(1.0)
    # 0.01 0.02 0.04 0.08 -> 0.04; 0.05 0.06 0.07 0.2 -> 0.07: (1.75 - 1) / 3 = 0.25
    assert step_from_timings([0.08, 0.01, 0.04, 0.02], [0.2, 0.05, 0.07, 0.06], 4) == pytest.approx(0.25)


def test_timings_that_cannot_give_a_step_are_refused_saying_why():
    for one_token, batch, tokens in (([0.01], [0.02], 1), ([], [0.02], 8), ([0.01], [], 8)):
        with pytest.raises(ValueError, match=r"^need timed passes of one token and of a batch of at least two$"):
            step_from_timings(one_token, batch, tokens)
    for one_token in ([0.0], [0.0, 0.0, 0.01], [-0.01]):
        with pytest.raises(ValueError, match=r"^a one-token pass took no time$"):
            step_from_timings(one_token, [0.02], 2)
