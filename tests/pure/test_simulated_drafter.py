"""The simulation's drafters in virtual time and its trace lookup
(orchestrator.planning.simulation): what a ``_SimulatedDrafter`` hands back
when collected before it has drafted everything, and what the collect costs
the clock; that collecting one never told to speculate brings nothing and
costs only the round trip (the Drafter protocol: "[] if none", never raises);
the token tree it builds (its main chain bounded by the request's ``most``,
its side branches by ``leaves - 1``, its rows by twice the chain's limit) and
the virtual time that tree costs; and ``_TraceLookup.candidates``, prompt
lookup's ranked candidates replayed from a trace's forks: the main chain's
token first, the recorded others after it (the right one at its rank, wrong
ones as 2 .. _TRUE - 1), none after a wrong token or where nothing is
proposed, and none where the trace recorded no forks. Times are virtual and
chosen as binary fractions, so the sums compare exactly."""

from __future__ import annotations

import random
from types import SimpleNamespace

from orchestrator.planning.simulation import _TRUE, _WRONG, DraftTrace, _Clock, _SimulatedDrafter, _TraceLookup

ROOT = _TRUE  # the first generated token (position 0), where the simulation starts


def make_drafter(trace: DraftTrace, draft_max: int, seconds_per_token: float = 0.5, call_seconds: float = 0.25):
    clock = _Clock()
    drafter = _SimulatedDrafter(clock, seconds_per_token, call_seconds, draft_max, trace, random.Random(0))
    drafter.state = SimpleNamespace(committed=[ROOT])  # speculate only reads the committed text's length
    return clock, drafter


def test_collect_without_wait_hands_back_only_the_tokens_drafted_by_now():
    clock, drafter = make_drafter(DraftTrace((None,) + (True,) * 8), draft_max=4)
    drafter.speculate([ROOT])
    clock.now = 1.25  # two and a half tokens' time after it started
    assert drafter.collect() == [_TRUE + 1, _TRUE + 2]
    assert clock.now == 1.5  # the round trip only: nothing waited for
    clock.now = 10.0
    assert drafter.collect(wait=True) == []  # a collect ends the speculation, as a drafter stops at one
    drafter.speculate([ROOT])
    assert drafter.collect(wait=True) == [_TRUE + 1, _TRUE + 2, _TRUE + 3, _TRUE + 4]


def test_collecting_a_drafter_never_told_to_speculate_brings_nothing_and_costs_the_round_trip():
    clock, drafter = make_drafter(DraftTrace((None,) + (True,) * 8), draft_max=4)
    assert drafter.collect(wait=True) == []
    assert clock.now == 0.25  # nothing to wait for
    clock.now = 3.0
    assert drafter.collect() == []
    assert clock.now == 3.25


# the trace for trees: every proposal right; at position 4 (the last of a
# four-token chain from the root) three other candidates, none right
TREE_TRACE = DraftTrace((None,) + (True,) * 8, tuple((3, 0) if position == 4 else (0, 0) for position in range(9)))


def test_collect_tree_takes_at_most_leaves_less_one_side_branches():
    _, drafter = make_drafter(TREE_TRACE, draft_max=4)
    drafter.speculate([ROOT], 4)
    tree = drafter.collect_tree(2)
    chain = [_TRUE + 1, _TRUE + 2, _TRUE + 3, _TRUE + 4]
    assert tree.tokens == [ROOT, *chain, _WRONG + 1]  # one side branch: the first other candidate at row 3
    assert tree.parents == [-1, 0, 1, 2, 3, 3]
    assert tree.ranks == [0, 1, 1, 1, 1, 2]
    drafter.speculate([ROOT], 4)
    assert drafter.collect_tree(3).tokens == [ROOT, *chain, _WRONG + 1, _WRONG + 2]


def test_collect_tree_main_chain_stops_at_the_requests_most():
    _, drafter = make_drafter(TREE_TRACE, draft_max=4)
    drafter.speculate([ROOT], 2)
    assert drafter.collect_tree(1).tokens == [ROOT, _TRUE + 1, _TRUE + 2]


def test_collect_tree_draft_rows_are_at_most_twice_the_chain_limit():
    forks = tuple((5, 0) if position == 2 else (0, 0) for position in range(9))
    _, drafter = make_drafter(DraftTrace((None,) + (True,) * 8, forks), draft_max=2)
    drafter.speculate([ROOT], 2)
    tree = drafter.collect_tree(10)  # leaves enough for every fork: the row budget binds
    assert tree.tokens == [ROOT, _TRUE + 1, _TRUE + 2, _WRONG + 1, _WRONG + 2]
    assert len(tree.tokens) - 1 == 2 * 2


def test_collect_tree_costs_a_token_of_drafting_per_draft_row_and_the_round_trip():
    clock, drafter = make_drafter(TREE_TRACE, draft_max=4, seconds_per_token=0.5, call_seconds=0.25)
    clock.now = 8.0
    drafter.speculate([ROOT], 4)
    tree = drafter.collect_tree(2)
    assert len(tree.tokens) == 6
    assert clock.now == 8.0 + 5 * 0.5 + 0.25


def test_candidates_put_the_main_token_first_then_the_recorded_others_by_rank():
    # position 1: the proposal is wrong, the second other candidate is right;
    # position 2: right proposal, two other candidates, none right
    trace = DraftTrace((None, False, True), ((0, 0), (3, 2), (2, 0)))
    lookup = _TraceLookup(trace)
    assert lookup.candidates([ROOT]) == [_WRONG, _WRONG + 1, _TRUE + 1, _WRONG + 3]
    assert lookup.candidates([ROOT, _TRUE + 1]) == [_TRUE + 2, _WRONG + 1, _WRONG + 2]


def test_candidates_after_a_wrong_token_are_only_the_wrong_main_token():
    trace = DraftTrace((None, True, True), ((0, 0), (0, 0), (3, 1)))
    assert _TraceLookup(trace).candidates([ROOT, _WRONG]) == [_WRONG]


def test_candidates_where_nothing_is_proposed_are_none():
    trace = DraftTrace((None, None, True), ((0, 0), (2, 1), (0, 0)))
    assert _TraceLookup(trace).candidates([ROOT]) == []


def test_candidates_of_a_trace_without_forks_are_only_the_main_token():
    lookup = _TraceLookup(DraftTrace((True, True, False)))
    assert lookup.candidates([]) == [_TRUE]
    assert lookup.candidates([ROOT]) == [_TRUE + 1]
    assert lookup.candidates([ROOT, _TRUE + 1]) == [_WRONG]
    # forks recorded for fewer positions than the text: none past them
    assert _TraceLookup(DraftTrace((True, True, False), ((0, 0),))).candidates([ROOT]) == [_TRUE + 1]
