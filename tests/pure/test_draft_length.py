"""The draft policy (speculators.draft_length): how long a draft the next pass carries."""

import random

import pytest

from speculators.draft_length import FORGET, PRIOR_STEP, DraftPolicy, DraftPrices, step_from_timings


def test_expected_tokens_and_cost_follow_the_acceptance_by_position():
    policy = DraftPolicy(3, step=0.5)
    policy.reached, policy.accepted = [10.0, 4.0, 2.0], [4.0, 2.0, 2.0]
    shares = policy.acceptances()
    # each share is (accepted + prior) / (reached + 1), the prior being the share before it (the first's 1/2)
    assert shares[0] == pytest.approx(4.5 / 11)
    assert shares[1] == pytest.approx((2 + shares[0]) / 5)
    assert shares[2] == pytest.approx((2 + shares[1]) / 3)
    assert policy.expected_committed(0) == 1.0
    assert policy.expected_committed(2) == pytest.approx(1 + shares[0] + shares[0] * shares[1])
    assert policy.cost(2) == pytest.approx(2.0)
    rates = [policy.expected_committed(k) / policy.cost(k) for k in range(4)]
    assert policy.limit() == rates.index(max(rates))


def test_a_copied_text_grows_the_draft_to_the_maximum():
    policy = DraftPolicy(8)
    limits = []
    for _ in range(6):
        limits.append(policy.limit())
        policy.observe_window(limits[-1], limits[-1])  # every draft accepted
    assert limits[0] == 1  # nothing known: one draft (acceptance 1/2 beats a 0.35 pass)
    assert limits == sorted(limits) and limits[-1] == 8


def test_drafts_that_are_rarely_right_stop_drafting_but_it_is_tried_again_later():
    policy, rng, limits = DraftPolicy(8), random.Random(3), []
    for _ in range(300):
        limit = policy.limit()
        limits.append(limit)
        policy.observe_window(limit, int(limit > 0 and rng.random() < 0.1))
    assert limits[-100:].count(0) > 80  # mostly no draft at all
    assert 0 < sum(limit > 0 for limit in limits[-100:])  # but probes: the evidence fades
    assert max(limits[-100:]) <= 2


def test_asks_that_get_nothing_stop_drafting_only_where_asking_costs():
    free, costly = DraftPolicy(4), DraftPolicy(4, call_cost=0.2)
    for policy in (free, costly):
        policy.reached, policy.accepted = [4.0] * 4, [3.0] * 4  # what is proposed is mostly right
        for _ in range(8):
            policy.observe_ask(False)
            policy.observe_window(0, 0)
        assert policy.availability < 0.15
    assert free.limit() > 0  # asking in process costs nothing: a proposal, when there is one, pays
    assert costly.limit() == 0  # a round trip a pass for rare proposals does not


def test_a_costlier_draft_is_kept_shorter():
    cheap, costly = DraftPolicy(8), DraftPolicy(8, prices=DraftPrices(awaited=1.0))
    for policy in (cheap, costly):
        policy.reached, policy.accepted = [20.0] * 8, [16.0] * 8  # 80 % at every position
    assert cheap.limit() > costly.limit()
    assert costly.cost(3) == pytest.approx(1 + 3 * (PRIOR_STEP + 1.0))


def test_evidence_fades_by_forget_per_window_and_bad_counts_are_refused():
    policy = DraftPolicy(2)
    policy.observe_window(2, 1)  # draft 1 accepted, draft 2 rejected
    assert (policy.reached, policy.accepted) == ([1.0, 1.0], [1.0, 0.0])
    policy.observe_window(1, 0)
    assert policy.reached == pytest.approx([FORGET + 1, FORGET]) and policy.accepted == pytest.approx([FORGET, 0.0])
    with pytest.raises(ValueError):
        policy.observe_window(1, 2)
    with pytest.raises(ValueError):
        DraftPolicy(0)


def test_the_step_is_the_median_batch_over_the_median_single_pass_per_extra_token():
    # 8 tokens at 3.8x one: 0.4 a token; medians, so one slow pass changes nothing
    assert step_from_timings([0.010, 0.010, 0.030], [0.038, 0.050, 0.038], 8) == pytest.approx((3.8 - 1) / 7)
    assert step_from_timings([0.01], [0.005], 2) == 0.0  # never negative
    assert step_from_timings([0.01], [10.0], 2) == 2.0  # bounded
    with pytest.raises(ValueError):
        step_from_timings([0.01], [0.02], 1)
    with pytest.raises(ValueError):
        step_from_timings([], [0.02], 8)


def test_with_no_evidence_it_drafts_once_however_costly_a_wider_pass():
    policy = DraftPolicy(4, step=0.8)  # by the prior alone (1/2) one draft would not pay
    assert policy.limit() == 1
    policy.observe_window(1, 0)  # tried, rejected: now the evidence decides
    assert policy.limit() == 0


# -- the refusal messages, what one window and one ask count for, how asks fade, the tie between two draft
# lengths, when "no evidence yet" stops, and the medians of the step's timings

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
