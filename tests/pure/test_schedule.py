"""The decoding schedule's rules (orchestrator.decoding.schedule), with plain Python alone."""

from collections import Counter, deque

import pytest

from speculators.draft_length import DraftPolicy, DraftPrices
from speculators.sampling import SamplingSettings
from orchestrator.decoding.schedule import Schedule, SequenceState, prompt_chunk
from orchestrator.decoding.speculation import Speculation
from orchestrator.decoding.scheduler import Batching, Scheduler
from orchestrator.decoding.stats import SpeculationStats
from orchestrator.decoding.windows import TargetPass, Window

SAMPLING = SamplingSettings(temperature=0.7, top_p=0.9, seed=5)


def never_ends(token):
    return False


def state(schedule=Schedule.ASYNC, committed=(1, 2, 3), speculation=(), draft_max=4, max_tokens=50, sequence=0,
          sampling=None):
    """Two prompt tokens and one generated; the first window may carry draft_max drafts.

    The window mechanics, apart from the draft policy's choice (tests/pure/test_draft_length.py)."""
    return SequenceState(sequence, list(committed), 2, max_tokens, schedule, draft_max, speculation=Speculation(list(speculation)),
                         draft_limit=draft_max, sampling=sampling)


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


def test_drafters_never_speculate_past_the_tokens_still_wanted_nor_past_the_next_window():
    """The speculation budget: what a relayed drafter may still add."""
    assert state(max_tokens=50).speculation_room == 9  # nothing in flight: two windows of 1 + draft_max
    assert state(max_tokens=3).speculation_room == 1  # 1 generated, 2 more: the last is the target's own
    assert state(max_tokens=1).speculation_room == 0
    sequence = state(speculation=[4, 5, 6, 7, 8, 9, 10])
    sequence.first_window()  # feeds positions 2..6: the next two windows feed positions 7..16
    assert sequence.speculation_room == 7  # the text may reach 17 tokens and holds 10
    sequence.accepted_whole = True
    ahead = sequence.window_ahead()
    assert ahead.inputs == (8, 9, 10) and sequence.speculation_room == 10  # fed to position 9 now
    long = state(speculation=list(range(4, 24)), max_tokens=50)
    assert long.speculation_room == 0  # already further than the next window can take
    short = state(max_tokens=50)
    short.draft_limit = 1
    assert short.speculation_room == 3  # the policy takes one draft a window now: two windows of 1 + 1


def test_awaited_drafts_are_priced_with_their_wait_and_drafts_made_while_passes_run_are_not():
    """A draft model's step is a quarter of a pass: sync waits for every draft,
    async only when nothing is speculated (its start, after a rejection)."""
    def fresh(schedule, cost, relayed=0.0):
        return SequenceState(0, [1, 2, 3], 2, 50, schedule, 8, draft_step=0.0,
                             draft_prices=DraftPrices(awaited=cost, relayed=relayed))

    free, sync, asynchronous = fresh(Schedule.SYNC, 0.0), fresh(Schedule.SYNC, 0.25), fresh(Schedule.ASYNC, 0.25)
    shared = fresh(Schedule.ASYNC, 0.25, relayed=0.25)  # drafters on the stages' cores: relayed drafts slow passes
    for sequence in (free, sync, asynchronous, shared):  # short runs of right drafts, on a flat pass
        for _ in range(12):
            for accepted in (0, 1, 2):
                sequence.policy.observe_window(8, accepted)
        sequence._choose_limits()
    assert sync.draft_limit < free.draft_limit == 8  # waiting a quarter of a pass a draft: shorter windows
    assert sync.drafts_wanted == sync.awaited_limit == sync.draft_limit
    assert asynchronous.draft_limit == 8 and asynchronous.awaited_limit == sync.draft_limit
    assert asynchronous.drafts_first and asynchronous.drafts_wanted == sync.draft_limit  # nothing speculated: it waits
    asynchronous.drafted([4] * 8)
    assert asynchronous.drafts_wanted == 8  # relayed drafts cost the pass nothing
    assert shared.draft_limit == shared.awaited_limit == sync.draft_limit


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
    assert sequence.accepted_whole and sequence.speculation.tokens == [9, 10]
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
    sequence.accepted_whole = True
    head = sequence.first_window()
    ahead = sequence.window_ahead()
    assert (head.inputs, ahead.inputs) == ((3, 4, 5, 6, 7), (8, 9, 10, 11))
    committed = sequence.verified(head, [4, 5, 99], never_ends)  # 6 rejected: the target says 99
    assert committed == [4, 5, 99]
    assert not sequence.in_flight and sequence.discards_pending == 1
    assert sequence.speculation.tokens == [] and not sequence.accepted_whole
    assert not sequence.ready  # nothing new until the invalid window's result is back
    sequence.discarded()
    assert sequence.ready and sequence.stats.discarded_passes == 1 and sequence.passes == 2


def test_a_window_ahead_stays_valid_when_its_first_input_is_the_targets_token():
    sequence = state(speculation=[4, 5, 6])
    sequence.accepted_whole = True
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
    sequence.speculation.tokens = [9, 1, 1]
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
    sequence.accepted_whole = True
    head = sequence.first_window()
    sequence.drafted([7])
    sequence.window_ahead()
    assert sequence.verified(head, [4, 0, 9], lambda token: token == 0) == [4]
    assert sequence.finished and sequence.stopped_by == "end" and sequence.discards_pending == 1
    limited = state(speculation=[4, 5, 6], max_tokens=3)
    assert limited.verified(limited.first_window(), [4, 5], never_ends) == [4, 5]
    assert limited.finished and limited.stopped_by == "length"


def test_a_lone_sequence_drafts_its_pass_through_on_the_drafter_beside_stage_0_and_crowded_ones_spread():
    sequences = [state(sequence=index) for index in (0, 5, 6)]
    assert [Scheduler.drafter_of(sequence, 4, crowded=False) for sequence in sequences] == [0, 0, 0]
    assert [Scheduler.drafter_of(sequence, 4, crowded=True) for sequence in sequences] == [0, 1, 2]


def test_the_scheduler_packs_the_windows_of_several_sequences_into_one_pass():
    first, second = state(speculation=[4, 5]), state(Schedule.SYNC, committed=(1, 2, 30), speculation=[40], sequence=1)
    first.accepted_whole = True
    first.drafted([6, 7, 8])
    scheduler = Scheduler([first, second])
    passes = scheduler.next_passes()
    assert [[window.sequence for window in target_pass.windows] for target_pass in passes] == [[0, 1], [0]]
    assert passes[0].tokens == 5 + 2
    assert scheduler.drafting_during() == [first]  # the sync sequence does not draft while its pass runs
    outcome = scheduler.received()
    assert [(state.sequence, rows) for state, _, rows in outcome] == [(0, slice(0, 5)), (1, slice(5, 7))]
    assert len(scheduler.in_flight) == 1


def test_a_sequence_whose_policy_takes_no_drafts_does_not_draft_while_its_pass_runs():
    drafting, idle = state(speculation=[4, 5]), state(committed=(1, 2, 30), sequence=1)
    idle.draft_limit = 0
    scheduler = Scheduler([drafting, idle])
    scheduler.next_passes()
    assert scheduler.drafting_during() == [drafting]


def test_the_scheduler_reports_a_discarded_window_without_rows():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    sequence.accepted_whole = True
    scheduler = Scheduler([sequence])
    head_pass, _ = scheduler.next_passes()
    (_, head, rows), = scheduler.received()
    sequence.verified(head, [99], never_ends)
    (_, _, rows), = scheduler.received()
    assert rows is None and sequence.stats.discarded_passes == 1 and scheduler.done is False


def test_a_window_ahead_is_invalid_when_the_targets_own_token_differs_from_its_first_input():
    sequence = state(speculation=[4, 5, 6])
    sequence.accepted_whole = True
    head = sequence.first_window()  # 3 4 5 6
    sequence.drafted([7, 8])
    sequence.window_ahead()  # 7 8 at position 6
    sequence.verified(head, [4, 5, 6, 99], never_ends)  # every draft accepted, but the target says 99, not 7
    assert not sequence.in_flight and sequence.discards_pending == 1


def test_a_pass_is_handed_out_for_cancelling_once_when_a_rejection_invalidates_it():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    sequence.accepted_whole = True
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
    sequence.accepted_whole = True
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


# -- the statistics a run reports (counted over several windows, shares with nothing to share, two runs
# added), prompt chunks, the sampling every window carries, a window started ahead at the end of the room,
# invalid windows, cancelling twice, and the scheduler's refusals

# -- statistics

def test_with_nothing_counted_every_share_is_zero():
    empty = SpeculationStats()
    assert (empty.acceptance_rate, empty.acceptance_first, empty.acceptance_later) == (0.0, 0.0, 0.0)
    assert (empty.draft_availability, empty.draft_continuation, empty.wasted_tokens) == (0.0, 0.0, 0)


def test_later_acceptance_and_continuation_are_shares_of_the_events_after_the_first():
    # 2 drafted windows, both accepted draft 1; 3 accepted in all: 1 later acceptance; 1 rejection, after draft 1
    stats = SpeculationStats(drafted_passes=2, first_accepted_passes=2, accepted_tokens=3, rejected_passes=1)
    assert stats.acceptance_later == 0.5
    # 4 asks, 3 proposed something, 5 tokens: 2 continuations; 3 stops, 1 of them the empty ask
    asks = SpeculationStats(waited_calls=4, waited_nonempty=3, waited_tokens=5, waited_stops=3)
    assert asks.draft_continuation == 0.5
    assert asks.draft_availability == 0.75


def test_two_runs_statistics_add_field_by_field():
    one = SpeculationStats(drafted_tokens=9, accepted_tokens=5, collected_tokens=12, discarded_passes=1,
                           rejected_passes=2, drafted_passes=3, first_accepted_passes=2, waited_calls=4,
                           waited_nonempty=3, waited_tokens=8, waited_stops=2,
                           accepted_lengths=Counter({1: 2, 5: 1}), input_lengths=Counter({4: 3}))
    two = SpeculationStats(drafted_tokens=1, accepted_tokens=1, collected_tokens=2, discarded_passes=3,
                           rejected_passes=1, drafted_passes=1, first_accepted_passes=1, waited_calls=1,
                           waited_nonempty=1, waited_tokens=1, waited_stops=1,
                           accepted_lengths=Counter({1: 1, 2: 1}), input_lengths=Counter({1: 1}))
    assert one + two == SpeculationStats(drafted_tokens=10, accepted_tokens=6, collected_tokens=14, discarded_passes=4,
                                         rejected_passes=3, drafted_passes=4, first_accepted_passes=3, waited_calls=5,
                                         waited_nonempty=4, waited_tokens=9, waited_stops=3,
                                         accepted_lengths=Counter({1: 3, 5: 1, 2: 1}),
                                         input_lengths=Counter({4: 3, 1: 1}))


def test_drafts_awaited_before_a_window_are_counted_call_by_call():
    sequence = state(Schedule.SYNC)
    for tokens in ([5, 6], [1, 2, 3, 4], []):  # stopped early, reached draft_max (4), proposed nothing
        sequence.drafted_first(tokens)
    stats = sequence.stats
    assert (stats.waited_calls, stats.waited_nonempty, stats.waited_tokens, stats.waited_stops) == (3, 2, 6, 2)
    assert stats.collected_tokens == 6
    assert sequence.speculation.tokens == []  # each call replaces the speculation: the last proposed nothing
    assert (sequence.policy.asked, sequence.policy.proposed) == (3.0, 2.0)


def test_drafts_collected_while_a_pass_runs_add_up():
    sequence = state(speculation=[4])
    sequence.drafted([5, 6])
    sequence.drafted([7])
    assert sequence.speculation.tokens == [4, 5, 6, 7] and sequence.stats.collected_tokens == 3


def test_verified_windows_are_counted_window_by_window():
    sequence = state(Schedule.SYNC)
    rounds = [  # (draft limit, drafts proposed, the verification's new tokens)
        (4, [4, 5, 6, 7], [4, 5, 6, 7, 8]),  # all four accepted
        (3, [9, 10, 11], [9, 20]),  # draft 1 accepted, draft 2 rejected
        (0, None, [21]),  # a plain window
        (2, [22, 23], [30]),  # draft 1 rejected
        (0, None, [31]),  # a plain window
    ]
    for limit, proposed, new_tokens in rounds:
        sequence.draft_limit = limit
        if proposed is not None:
            sequence.drafted_first(proposed)
        sequence.verified(sequence.first_window(), new_tokens, never_ends)
    stats = sequence.stats
    assert sequence.committed == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 30, 31] and sequence.passes == 5
    assert (stats.drafted_tokens, stats.accepted_tokens) == (9, 5)
    assert (stats.drafted_passes, stats.first_accepted_passes, stats.rejected_passes) == (3, 2, 2)
    assert stats.accepted_lengths == Counter({5: 1, 2: 1, 1: 3})  # tokens committed per window
    assert stats.input_lengths == Counter({5: 1, 4: 1, 1: 2, 3: 1})  # tokens fed per window
    assert stats.acceptance_rate == pytest.approx(5 / 9)
    assert stats.acceptance_first == pytest.approx(2 / 3)
    assert stats.acceptance_later == pytest.approx(3 / 4)  # 3 later acceptances, 1 later rejection
    assert not sequence.accepted_whole


# -- the state's policy

def test_draft_max_below_one_is_refused():
    with pytest.raises(ValueError, match=r"^draft_max must be at least 1$"):
        SequenceState(0, [1, 2], 1, 10, Schedule.SYNC, 0)


def test_tree_leaves_below_one_are_refused():
    with pytest.raises(ValueError, match=r"^tree_leaves must be at least 1$"):
        SequenceState(0, [1, 2], 1, 10, Schedule.SYNC, 4, tree_leaves=0)


def test_the_policy_is_made_from_the_states_draft_max_and_costs():
    sequence = SequenceState(0, [1, 2], 1, 10, Schedule.SYNC, 4, draft_step=0.8, draft_call_cost=0.2)
    assert sequence.policy == DraftPolicy(4, step=0.8, call_cost=0.2)
    assert sequence.draft_limit == 1  # no evidence yet: one draft
    given = DraftPolicy(6)
    assert SequenceState(0, [1, 2], 1, 10, Schedule.SYNC, 4, policy=given).policy is given


# -- windows

def test_a_prompt_is_fed_in_chunks_of_prompt_chunk_tokens():
    sequence = SequenceState(0, [10, 11, 12, 13, 14], 5, 20, Schedule.SYNC, 4, prompt_from=0, prompt_chunk=2,
                             sampling=SAMPLING)
    chunks = []
    for new_tokens in ([], [], [15]):
        window = sequence.first_window()
        chunks.append(window)
        assert sequence.gives_token(window) == bool(new_tokens)
        assert sequence.verified(window, new_tokens, never_ends) == new_tokens
    assert chunks == [Window(0, 0, (10, 11), prompt=True, sampling=SAMPLING),
                      Window(0, 2, (12, 13), prompt=True, sampling=SAMPLING),
                      Window(0, 4, (14,), prompt=True, sampling=SAMPLING)]
    assert sequence.prompt_from is None and sequence.drafts_first  # through the prompt: drafting starts


def test_a_prompt_that_fills_its_chunks_exactly_ends_with_its_last_full_chunk():
    sequence = SequenceState(0, [10, 11, 12, 13], 4, 20, Schedule.SYNC, 4, prompt_from=0, prompt_chunk=2)
    first = sequence.first_window()
    sequence.verified(first, [], never_ends)
    last = sequence.first_window()
    assert (first.first, first.inputs, last.first, last.inputs) == (0, (10, 11), 2, (12, 13))
    assert sequence.prompt_from is None and sequence.gives_token(last)


def test_a_prompts_chunks_pipeline_one_in_flight_per_stage_in_passes_of_their_own():
    """prompt_depth 2 (two stages): the first two chunks go at once, in two
    passes; each result lets the next chunk in, so stage 0 always has one to
    compute; only the last chunk gives a token, and only then is the sequence ready."""
    sequence = SequenceState(0, list(range(10, 17)), 7, 20, Schedule.SYNC, 4, prompt_from=0, prompt_chunk=2,
                             prompt_depth=2, sampling=SAMPLING)
    scheduler = Scheduler([sequence])
    first = scheduler.next_passes()
    assert [[(window.first, window.inputs) for window in p.windows] for p in first] == [[(0, (10, 11))],
                                                                                        [(2, (12, 13))]]
    for expected in ([(4, (14, 15))], [(6, (16,))], []):
        [(state, window, rows)] = scheduler.received()
        assert sequence.verified(window, [], never_ends) == [] and not sequence.gives_token(window)
        assert [[(w.first, w.inputs) for w in p.windows] for p in scheduler.next_passes()] == \
            ([expected] if expected else [])
        assert len(sequence.in_flight) <= 2 and not sequence.ready
    [(state, last, rows)] = scheduler.received()
    assert sequence.gives_token(last) and sequence.verified(last, [17], never_ends) == [17]
    assert sequence.ready and not sequence.in_flight and sequence.prompt_from is None


def test_a_cancelled_sequence_discards_every_chunk_in_flight():
    sequence = SequenceState(0, list(range(10, 20)), 10, 20, prompt_from=0, prompt_chunk=3, prompt_depth=3)
    scheduler = Scheduler([sequence])
    assert len(scheduler.next_passes()) == 3
    sequence.cancel()
    assert len(scheduler.invalid_passes()) == 3 and sequence.discards_pending == 3


@pytest.mark.parametrize("length, stages, n_batch, chunk", [
    (1500, 1, 512, 512),  # one stage: nothing overlaps, the biggest chunk
    (1500, 2, 512, 188),  # a quarter of each stage's share
    (100, 2, 512, 64),  # never under PREFILL_LEAST_CHUNK ...
    (100, 2, 32, 32),  # ... nor over n_batch
    (20000, 4, 512, 512),
])
def test_a_prompt_chunk_is_a_quarter_of_a_stages_share_within_its_bounds(length, stages, n_batch, chunk):
    assert prompt_chunk(length, stages, n_batch) == chunk


def test_without_a_chunk_size_the_prompt_is_one_window():
    sequence = SequenceState(0, [10, 11, 12, 13, 14], 5, 20, Schedule.SYNC, 4, prompt_from=1)
    assert sequence.first_window() == Window(0, 1, (11, 12, 13, 14), prompt=True)
    assert sequence.prompt_from is None


def test_every_window_carries_the_sequences_sampling():
    sequence = state(speculation=list(range(4, 15)), sampling=SAMPLING)
    sequence.accepted_whole = True
    assert sequence.first_window() == Window(0, 2, (3, 4, 5, 6, 7), sampling=SAMPLING)
    assert sequence.window_ahead() == Window(0, 7, (8, 9, 10, 11, 12), sampling=SAMPLING)
    greedy_on_logits = state(speculation=[4])
    assert greedy_on_logits.first_window().sampling is None


@pytest.mark.parametrize("max_tokens, ahead_inputs", [
    (50, (8, 9, 10, 11, 12)),  # room enough: draft_limit (4) drafts
    (8, (8, 9)),  # 6 more tokens wanted: the head may commit 5, one draft after the ahead window's first token
    (7, (8,)),  # 5 more: the head may commit 5, the ahead window only its first token
    (6, None),  # 4 more: the head alone may finish the sequence
])
def test_a_window_started_ahead_carries_only_what_the_room_after_the_head_allows(max_tokens, ahead_inputs):
    sequence = state(speculation=list(range(4, 15)), max_tokens=max_tokens)
    sequence.accepted_whole = True
    head = sequence.first_window()
    assert (head.first, head.inputs) == (2, (3, 4, 5, 6, 7))
    ahead = sequence.window_ahead()
    if ahead_inputs is None:
        assert ahead is None and list(sequence.in_flight) == [head]
    else:
        assert (ahead.first, ahead.inputs) == (7, ahead_inputs)
        assert list(sequence.in_flight) == [head, ahead]


def test_a_window_ahead_is_invalid_when_the_head_commits_less_even_if_the_token_matches():
    sequence = state(speculation=list(range(4, 15)))
    sequence.accepted_whole = True
    head = sequence.first_window()  # 3 4 5 6 7 at 2
    ahead = sequence.window_ahead()  # 8 9 10 11 12 at 7
    assert ahead.inputs[0] == 8
    # draft 4 accepted, 5 rejected, and the target's own token happens to be 8: at position 4, not 7
    assert sequence.verified(head, [4, 8], never_ends) == [4, 8]
    assert sequence.committed == [1, 2, 3, 4, 8]
    assert not sequence.in_flight and sequence.discards_pending == 1 and sequence.speculation.tokens == []


def test_every_discarded_window_is_counted():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9, 10, 11])
    for round_ in (1, 2):
        sequence.accepted_whole, sequence.draft_limit = True, 4
        head = sequence.first_window()
        sequence.window_ahead()
        sequence.verified(head, [99], never_ends)  # draft 1 rejected: the window ahead is invalid
        assert sequence.discards_pending == 1
        sequence.discarded()
        assert sequence.stats.discarded_passes == round_ and sequence.passes == 2 * round_
        sequence.drafted([4, 5, 6, 7, 8, 9, 10, 11])


def test_cancelling_twice_keeps_the_windows_to_discard():
    sequence = state(speculation=[4, 5, 6, 7, 8, 9])
    sequence.accepted_whole = True
    sequence.first_window()
    sequence.window_ahead()
    sequence.cancel()
    assert sequence.finished and sequence.stopped_by == "cancelled"
    assert not sequence.in_flight and sequence.discards_pending == 2 and not sequence.settled
    sequence.cancel()
    assert sequence.discards_pending == 2 and sequence.stopped_by == "cancelled"
    sequence.discarded()
    assert not sequence.settled
    sequence.discarded()
    assert sequence.settled and sequence.stats.discarded_passes == 2


def test_cancelling_a_finished_sequence_keeps_why_it_stopped():
    sequence = state(speculation=[4])
    sequence.verified(sequence.first_window(), [4, 0], lambda token: token == 0)
    assert sequence.finished and sequence.stopped_by == "end"
    sequence.cancel()
    assert sequence.stopped_by == "end" and sequence.discards_pending == 0 and sequence.settled


# -- the scheduler

def test_a_sequence_id_is_scheduled_once():
    scheduler = Scheduler([state()])
    with pytest.raises(ValueError, match=r"^sequence 0 is already scheduled$"):
        scheduler.add(state())
    scheduler.add(state(sequence=3))
    assert sorted(scheduler.sequences) == [0, 3]


def test_a_sequence_is_removed_only_once_settled():
    sequence = state(sequence=7)
    scheduler = Scheduler([sequence])
    with pytest.raises(ValueError, match=r"^sequence 7 still has windows in flight$"):
        scheduler.remove(7)
    sequence.cancel()
    assert scheduler.remove(7) is sequence and scheduler.sequences == {}


def test_a_sequence_drafting_one_token_at_a_time_drafts_while_its_pass_runs():
    sequence = state(speculation=[4])
    sequence.draft_limit = 1
    scheduler = Scheduler([sequence])
    scheduler.next_passes()
    assert scheduler.drafting_during() == [sequence]


# -- continuous batching (Batching): which ready windows share a pass

def decoding_window(sequence, width=1, first=10):
    return Window(sequence, first, tuple(range(width)))


def test_on_a_flat_curve_ready_windows_fill_one_pass_per_stage_and_on_a_linear_one_go_alone():
    windows = [decoding_window(sequence) for sequence in range(8)]
    flat = Batching(stage_count=2, step=0.0, n_batch=512)
    assert [[w.sequence for w in p.windows] for p in flat.passes(windows, in_flight=0)] == [[0, 1, 2, 3],
                                                                                            [4, 5, 6, 7]]
    assert [len(p.windows) for p in flat.passes(windows, in_flight=1)] == [8]  # one stage already busy
    linear = Batching(stage_count=2, step=1.0, n_batch=512)
    assert [len(p.windows) for p in linear.passes(windows, in_flight=0)] == [1] * 8  # ties go to more passes
    this_cpu = Batching(stage_count=2, step=0.6, n_batch=512)  # 8 tokens cost 5.2 one-token passes
    assert [len(p.windows) for p in this_cpu.passes(windows, in_flight=0)] == [4, 4]


def test_only_chains_of_one_width_and_consecutive_sequences_share_a_pass():
    flat = Batching(stage_count=1, step=0.0, n_batch=512)
    prompt = Window(5, 0, (1, 2, 3), prompt=True)
    tree = Window(6, 10, (1, 2, 3), parents=(-1, 0, 0))
    windows = [decoding_window(0), decoding_window(1), decoding_window(3), decoding_window(2, width=3),
               decoding_window(4, width=3), prompt, tree]
    shared = sorted(tuple(w.sequence for w in p.windows) for p in flat.passes(windows, in_flight=0))
    assert shared == [(0, 1), (2,), (3,), (4,), (5,), (6,)]  # 0-1 consecutive; 3 apart; width 3: 2 and 4 not


def test_a_shared_pass_never_exceeds_n_batch_tokens():
    flat = Batching(stage_count=1, step=0.0, n_batch=16)
    passes = flat.passes([decoding_window(sequence, width=5) for sequence in range(8)], in_flight=0)
    assert all(sum(len(w.inputs) for w in p.windows) <= 16 for p in passes)
    assert sorted(w.sequence for p in passes for w in p.windows) == list(range(8))


def test_while_the_stages_are_busy_decoding_windows_wait_to_share_a_pass_but_prompts_go():
    batching = Batching(stage_count=2, step=0.0, n_batch=512)
    assert batching.holds(2) and not batching.holds(1)
    assert not Batching(stage_count=2, step=1.0, n_batch=512).holds(5)  # sharing never pays: nothing waits
    waiting = state(Schedule.PLAIN, sequence=0)
    prompt = SequenceState(1, [1, 2, 3], 3, 10, prompt_from=0)
    scheduler = Scheduler([waiting, prompt], batching=batching)
    scheduler.in_flight.extend([TargetPass((decoding_window(7),)), TargetPass((decoding_window(8),))])
    assert [p.windows[0].sequence for p in scheduler.next_passes()] == [1]
    assert waiting.ready and not waiting.in_flight


def test_with_batching_chains_ready_at_once_are_one_width_with_filler_and_share_a_pass():
    """Drafted windows of different widths would take a pass each (8 requests under
    load ran at 0.53x without drafts, 2026-12-03): every chain carries as many
    drafts, a chain short of them filler (its last token again), outside the drafts' count."""
    def two():
        return (state(speculation=[4, 5, 6], committed=(1, 2, 3)),
                state(speculation=[40], committed=(1, 2, 30), sequence=1))

    flat = Batching(stage_count=1, step=0.0, n_batch=512)
    (shared,) = Scheduler(two(), batching=flat).next_passes()
    assert [(window.inputs, window.filler) for window in shared.windows] == [((3, 4, 5, 6), 0), ((30, 40, 40, 40), 2)]
    assert [window.main_drafts for window in shared.windows] == [(4, 5, 6), (40,)]
    first, _ = two()
    alone = Scheduler([first], batching=flat).next_passes()
    assert [window.inputs for pass_ in alone for window in pass_.windows] == [(3, 4, 5, 6)]  # alone: its policy's
    unbatched = Scheduler(two()).next_passes()
    assert sorted(len(window.inputs) for pass_ in unbatched for window in pass_.windows) == [2, 4]


def test_with_batching_drafts_are_taken_only_where_the_curve_has_room_for_them():
    """On a pass flat up to 8 tokens and twice as dear at 16 (a memory-bound
    machine's roofline), 8 one-token windows fill the flat part: one draft
    each would double the pass for half a token each, so none go; 2 windows
    take every draft they have, free. A line through t(1) and t(8) (step 0)
    would see all of it as free."""
    from stages.cost_curve import BatchCurve

    roofline = Batching(stage_count=1, step=0.0, n_batch=512, curve=BatchCurve((1, 8, 16), (1.0, 1.0, 2.0)))
    eight = [state(speculation=[7, 8, 9], committed=(1, 2, 3), sequence=index) for index in range(8)]
    (full,) = Scheduler(eight, batching=roofline).next_passes()
    assert [window.inputs for window in full.windows] == [(3,)] * 8
    two = [state(speculation=[7, 8, 9], committed=(1, 2, 3), sequence=index) for index in range(2)]
    (roomy,) = Scheduler(two, batching=roofline).next_passes()
    assert [window.inputs for window in roomy.windows] == [(3, 7, 8, 9)] * 2


def test_a_filler_the_target_chooses_is_committed_but_not_counted_as_a_draft():
    sequence = state(speculation=[40], committed=(1, 2, 30))
    window = sequence.first_window(shared=3)
    assert (window.inputs, window.filler) == ((30, 40, 40, 40), 2)
    assert sequence.verified(window, [40, 40, 41], lambda token: False) == [40, 40, 41]
    assert sequence.committed == [1, 2, 30, 40, 40, 41] and sequence.cached == 5
    assert (sequence.stats.drafted_tokens, sequence.stats.accepted_tokens) == (1, 1)


def test_while_shared_passes_take_no_drafts_drafting_pauses_but_for_stretches_that_grow_apart():
    """Two async requests sharing passes on a pass twice as dear at 4 tokens as
    at 2: the rule takes none of the draft each has, so after 4 such passes
    their drafters stop drafting, except for 2 passes (a catch-up, then
    drafts) 8 passes into the pause, then after gaps that double."""
    from stages.cost_curve import BatchCurve

    sequences = [state(committed=(1, 2, 3), sequence=index, max_tokens=100) for index in range(2)]
    dear = Batching(stage_count=1, step=0.0, n_batch=512, curve=BatchCurve((1, 2, 4), (1.0, 1.0, 2.0)))
    scheduler = Scheduler(sequences, batching=dear)
    relayed = []
    for turn in range(1, 70):
        for sequence in sequences:
            sequence.speculation.tokens = [7]  # what the drafters had
        (shared,) = scheduler.next_passes()
        assert [len(window.inputs) for window in shared.windows] == [1, 1]
        relayed.append(bool(scheduler.drafting_during()))
        for sequence, window, _ in scheduler.received():
            sequence.verified(window, [100 + turn], lambda token: False)
    assert [turn for turn, relays in enumerate(relayed, 1) if relays] == [1, 2, 3, 11, 12, 27, 28, 59, 60]
