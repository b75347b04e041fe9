"""The decoding schedule's rules (orchestrator.decoding.schedule), with plain Python alone."""

from collections import deque

import pytest

from speculators.draft_length import DraftPolicy
from orchestrator.decoding.schedule import Handoff, Schedule, Scheduler, SequenceState, relay

pytestmark = pytest.mark.pure


def never_ends(token):
    return False


def state(schedule=Schedule.ASYNC, committed=(1, 2, 3), speculation=(), draft_max=4, max_tokens=50, sequence=0):
    # the window mechanics, apart from the draft policy's choice (tests/test_draft_policy.py): the first window may carry draft_max
    return SequenceState(sequence, list(committed), 2, max_tokens, schedule, draft_max, speculation=list(speculation),
                         draft_limit=draft_max)


def test_a_window_is_the_last_committed_token_then_at_most_draft_limit_drafts():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    window = sequence.first_window()
    assert (window.first, window.inputs, window.drafts) == (2, (3, 4, 5, 6, 7), (4, 5, 6, 7))
    assert window.logit_rows == (0, 1, 2, 3, 4)
    plain = state(Schedule.PLAIN, speculation=[4, 5])
    assert plain.first_window().inputs == (3,)  # plain decoding carries no drafts


def test_a_window_never_carries_more_drafts_than_tokens_still_wanted():
    sequence = state(speculation=[4, 5, 6, 7], max_tokens=3)  # 1 generated, 2 more wanted
    assert sequence.first_window().drafts == (4,)


def test_the_prompt_window_asks_only_for_its_last_rows_logits():
    sequence = SequenceState(0, [7, 8, 9, 10], 4, 10, Schedule.SYNC, 4, prompt_from=2)
    assert not sequence.drafts_first  # nothing to draft from before the prompt is through
    window = sequence.first_window()
    assert (window.first, window.inputs, window.logit_rows, window.drafts) == (2, (9, 10), (1,), ())
    assert sequence.verified(window, [11], never_ends) == [11]
    assert sequence.passes == 0 and sequence.stats.drafted_passes == 0  # the prompt's pass is not counted


def test_sync_drafts_first_for_every_window_async_only_when_nothing_is_pending():
    assert state(Schedule.SYNC, speculation=[4]).drafts_first
    assert not state(Schedule.ASYNC, speculation=[4]).drafts_first
    assert state(Schedule.ASYNC).drafts_first
    assert not state(Schedule.PLAIN).drafts_first


def test_a_window_starts_ahead_only_in_async_after_a_fully_accepted_window():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9, 10])
    first = sequence.first_window()
    assert sequence.window_ahead() is None  # not on a roll yet
    sequence.verified(first, [4, 5, 6, 7, 8], never_ends)  # all four accepted, the target adds 8
    assert sequence.on_a_roll and sequence.speculation == [9, 10]
    head = sequence.first_window()
    ahead = sequence.window_ahead()
    # the head feeds 8 9 10 at positions 7..9; ahead assumes it commits 9 10 and one more
    assert (head.first, head.inputs) == (7, (8, 9, 10))
    assert ahead is None  # the speculation ends at the head's window: nothing to start ahead
    sequence.drafted([11, 12, 13])
    ahead = sequence.window_ahead()
    assert (ahead.first, ahead.inputs) == (10, (11, 12, 13))
    sync = state(Schedule.SYNC, speculation=[4, 5])
    window = sync.first_window()
    sync.verified(window, [4, 5, 6], never_ends)
    sync.first_window()
    assert sync.window_ahead() is None


def test_a_window_in_flight_becomes_invalid_when_the_one_before_is_rejected():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9, 10, 11])
    sequence.on_a_roll = True
    head = sequence.first_window()
    ahead = sequence.window_ahead()
    assert (head.inputs, ahead.inputs) == ((3, 4, 5, 6, 7), (8, 9, 10, 11))
    committed = sequence.verified(head, [4, 5, 99], never_ends)  # 6 rejected: the target says 99
    assert committed == [4, 5, 99]
    assert not sequence.in_flight and sequence.discards_pending == 1
    assert sequence.speculation == [] and not sequence.on_a_roll
    assert not sequence.ready  # nothing new until the invalid window's result is back
    sequence.discarded()
    assert sequence.ready and sequence.stats.discarded_passes == 1 and sequence.passes == 2


def test_a_window_ahead_stays_valid_when_its_first_input_is_the_targets_token():
    sequence = state(speculation=[4, 5, 6])
    sequence.on_a_roll = True
    head = sequence.first_window()  # 3 4 5 6
    sequence.drafted([7, 8])
    ahead = sequence.window_ahead()  # 7 8 at position 6
    sequence.verified(head, [4, 5, 6, 7], never_ends)
    assert list(sequence.in_flight) == [ahead] and sequence.discards_pending == 0


def test_the_draft_limit_is_the_policys_choice_after_each_verified_window():
    sequence = state(Schedule.SYNC, speculation=[4, 5, 6, 7], draft_max=8)
    sequence.draft_limit = 4
    twin = DraftPolicy(8)
    sequence.verified(sequence.first_window(), [4, 5, 6, 7, 8], never_ends)
    twin.observe_window(4, 4)
    assert sequence.draft_limit == twin.limit() > 4  # all four accepted: a longer window
    sequence.speculation = [9, 1, 1]
    sequence.verified(sequence.first_window(), [9, 10], never_ends)
    twin.observe_window(3, 1)
    assert sequence.draft_limit == twin.limit()


def test_a_draft_limit_of_zero_runs_plain_windows_without_asking_the_drafter():
    sequence = state(Schedule.SYNC, speculation=[4, 5])
    sequence.draft_limit = 0
    assert not sequence.drafts_first
    assert sequence.first_window().inputs == (3,)


def test_an_end_token_or_max_tokens_finishes_the_sequence_and_invalidates_what_is_in_flight():
    sequence = state(speculation=[4, 5, 6])
    sequence.on_a_roll = True
    head = sequence.first_window()
    sequence.drafted([7])
    sequence.window_ahead()
    assert sequence.verified(head, [4, 0, 9], lambda token: token == 0) == [4]
    assert sequence.finished and sequence.stopped_by == "end" and sequence.discards_pending == 1
    limited = state(speculation=[4, 5, 6], max_tokens=3)
    assert limited.verified(limited.first_window(), [4, 5], never_ends) == [4, 5]
    assert limited.finished and limited.stopped_by == "length"


def test_async_relay_hands_drafting_to_the_machine_that_just_went_idle():
    assert relay(2) == (Handoff(None, 1), Handoff(1, 0), Handoff(0, None))
    assert relay(3) == (Handoff(None, 1), Handoff(1, 2), Handoff(2, 0), Handoff(0, None))
    assert relay(1) == (Handoff(None, 0), Handoff(0, None))


def test_the_scheduler_packs_the_windows_of_several_sequences_into_one_pass():
    first, second = state(speculation=[4, 5]), state(Schedule.SYNC, committed=(1, 2, 30), speculation=[40], sequence=1)
    first.on_a_roll = True
    first.drafted([6, 7, 8])
    scheduler = Scheduler([first, second])
    passes = scheduler.next_passes()
    assert [[window.sequence for window in target_pass.windows] for target_pass in passes] == [[0, 1], [0]]
    assert passes[0].tokens == 5 + 2
    assert scheduler.relaying() == [first]  # the sync sequence hands nothing between machines
    outcome = scheduler.received()
    assert [(state.sequence, rows) for state, _, rows in outcome] == [(0, slice(0, 5)), (1, slice(5, 7))]
    assert len(scheduler.in_flight) == 1


def test_a_sequence_whose_policy_takes_no_drafts_does_not_relay():
    drafting, idle = state(speculation=[4, 5]), state(committed=(1, 2, 30), sequence=1)
    idle.draft_limit = 0
    scheduler = Scheduler([drafting, idle])
    scheduler.next_passes()
    assert scheduler.relaying() == [drafting]


def test_the_scheduler_reports_a_discarded_window_without_rows():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    sequence.on_a_roll = True
    scheduler = Scheduler([sequence])
    head_pass, _ = scheduler.next_passes()
    (_, head, rows), = scheduler.received()
    sequence.verified(head, [99], never_ends)
    (_, _, rows), = scheduler.received()
    assert rows is None and sequence.stats.discarded_passes == 1 and scheduler.done is False


def test_a_window_ahead_is_invalid_when_the_targets_own_token_differs_from_its_first_input():
    sequence = state(speculation=[4, 5, 6])
    sequence.on_a_roll = True
    head = sequence.first_window()  # 3 4 5 6
    sequence.drafted([7, 8])
    sequence.window_ahead()  # 7 8 at position 6
    sequence.verified(head, [4, 5, 6, 99], never_ends)  # every draft accepted, but the target says 99, not 7
    assert not sequence.in_flight and sequence.discards_pending == 1


def test_a_pass_is_handed_out_for_cancelling_once_when_a_rejection_invalidates_it():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    sequence.on_a_roll = True
    scheduler = Scheduler([sequence])
    head_pass, ahead_pass = scheduler.next_passes()
    assert scheduler.invalid_passes() == []  # both windows still valid
    (_, head, _), = scheduler.received()
    assert scheduler.invalid_passes() == []
    sequence.verified(head, [4, 99], never_ends)  # the second draft is rejected: the window ahead is wrong
    assert [target_pass is ahead_pass for target_pass in scheduler.invalid_passes()] == [True]
    assert scheduler.invalid_passes() == []  # handed out once
    (_, _, rows), = scheduler.received()
    assert rows is None and scheduler.in_flight == deque()


def test_a_pass_with_one_valid_window_is_not_cancelled_and_a_cancelled_sequence_cancels_its_passes():
    first, second = state(speculation=[4, 5]), state(committed=(1, 2, 30), speculation=[40], sequence=1)
    scheduler = Scheduler([first, second])
    (shared,) = scheduler.next_passes()
    first.cancel()  # its client went away: its window is invalid, the other sequence's is not
    assert scheduler.invalid_passes() == []
    second.cancel()
    assert [target_pass is shared for target_pass in scheduler.invalid_passes()] == [True]


def test_the_scheduler_keeps_no_pass_it_has_handed_back():
    import gc
    import weakref

    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    sequence.on_a_roll = True
    scheduler = Scheduler([sequence])
    _, ahead_pass = scheduler.next_passes()
    (_, head, _), = scheduler.received()
    sequence.verified(head, [4, 99], never_ends)
    assert scheduler.invalid_passes() == [ahead_pass]
    gone = weakref.ref(ahead_pass)
    del ahead_pass
    scheduler.received()
    gc.collect()
    assert gone() is None  # a long-lived service would otherwise hold every cancelled pass
