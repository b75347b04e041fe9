"""Corrections drafted while a window is verified (speculators.corrections):
how the schedule forks them and takes one after a rejection
(orchestrator.decoding.schedule.SequenceState.forks, drafted, verified)."""

import pytest

from orchestrator.decoding.schedule import Schedule, SequenceState
from orchestrator.decoding.speculation import Speculation
from speculators.corrections import Forks
from speculators.draft_length import DraftPrices


def never_ends(token):
    return False


def state(speculation=(4, 5, 6), max_tokens=50):
    """Prompt 1 2, generated 3; the next window carries the speculation's drafts."""
    return SequenceState(0, [1, 2, 3], 2, max_tokens, Schedule.ASYNC, 4, speculation=Speculation(list(speculation)), draft_limit=4)


def test_corrections_fork_at_the_head_windows_drafts():
    sequence = state()
    assert sequence.forks is None  # nothing in flight
    sequence.first_window()  # 3 | 4 5 6 at positions 2 | 3 4 5
    assert sequence.forks == Forks(3, 3)  # the draft's price not measured: no time known for them


def test_corrections_are_asked_within_the_rounds_the_heads_pass_lasts():
    """The head window's pass on the policy's line (1 + 3 x 0.1 one-token passes)
    over the awaited draft step (0.05 of a pass): 26 of the chain's rounds."""
    sequence = SequenceState(0, [1, 2, 3], 2, 50, Schedule.ASYNC, 4, speculation=Speculation([4, 5, 6]), draft_limit=4,
                             draft_step=0.1, draft_prices=DraftPrices(awaited=0.05, relayed=0.0))
    sequence.first_window()
    assert sequence.forks.first == 3 and sequence.forks.count == 3
    assert sequence.forks.rounds == pytest.approx(1.3 / 0.05)


def test_a_window_without_drafts_forks_nothing():
    sequence = state(speculation=())
    sequence.first_window()
    assert sequence.forks is None


def test_after_a_rejection_the_correction_holding_the_targets_token_is_the_speculation():
    sequence = state()
    head = sequence.first_window()
    sequence.drafted([7, 8], {(3, 40): [40, 41, 42], (4, 50): [50, 51, 52], (4, 70): [70, 71]})
    committed = sequence.verified(head, [4, 50], never_ends)  # 5 rejected at position 4; the target says 50
    assert committed == [4, 50]
    assert sequence.speculation.tokens == [51, 52]  # the correction at 4 goes on from the target's token
    assert sequence.stats.corrected_windows == 1
    assert not sequence.drafts_first  # its next window goes at once, without waiting for the drafter


def test_a_correction_with_another_token_is_not_taken():
    sequence = state()
    head = sequence.first_window()
    sequence.drafted([], {(4, 50): [50, 51, 52]})
    sequence.verified(head, [4, 60], never_ends)  # the target says 60, not the runner-up 50
    assert sequence.speculation.tokens == [] and sequence.stats.corrected_windows == 0
    assert sequence.drafts_first


def test_a_correction_at_another_position_is_not_taken():
    sequence = state()
    head = sequence.first_window()
    sequence.drafted([], {(3, 50): [50, 51, 52]})  # a correction of the first draft, holding the same token
    sequence.verified(head, [4, 50], never_ends)  # but the second draft was rejected
    assert sequence.speculation.tokens == []


def test_corrections_last_one_verified_window():
    sequence = state(speculation=(4, 5, 6, 7, 8, 9))
    head = sequence.first_window()
    sequence.drafted([], {(5, 60): [60, 61]})
    sequence.verified(head, [4, 5, 6, 7, 8], never_ends)  # every draft accepted: the corrections are spent
    assert sequence.speculation.corrections == {}
    head = sequence.first_window()
    sequence.verified(head, [9, 60], never_ends)
    assert sequence.speculation.tokens == []


def test_no_correction_is_taken_once_the_sequence_has_finished():
    sequence = state(max_tokens=3)
    head = sequence.first_window()
    sequence.drafted([], {(4, 50): [50, 51]})
    sequence.verified(head, [4, 50], never_ends)  # the third generated token ends it
    assert sequence.finished and sequence.speculation.tokens == []


def test_a_correction_holding_no_drafts_after_the_targets_token_is_no_speculation():
    sequence = state()
    head = sequence.first_window()
    sequence.drafted([], {(4, 50): [50]})  # the runner-up alone: collected before its next token
    sequence.verified(head, [4, 50], never_ends)
    assert sequence.speculation.tokens == [] and sequence.stats.corrected_windows == 0 and sequence.drafts_first
