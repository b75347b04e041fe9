"""The schedule simulation (orchestrator.planning.simulation): the workloads' draws at
their boundaries, traces replayed and written, which hop and which drafter each
step pays for, async drafting through a pass, cores shared by stages, the end
of the text, seeds, and predict's medians. Times are virtual."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pytest

from orchestrator.decoding.schedule import SequenceState
from orchestrator.planning.simulation import (DraftBehaviour, DraftTrace, Mode, _SimulatedDrafter, predict, simulate,
                                              simulate_many)


@dataclass(frozen=True)
class TableCosts:
    """Every cost by index: stage ``i`` computes for ``stages[i]`` seconds; hop ``h``
    costs ``hops[h]`` plus ``hop_per_token`` a token; the drafter beside stage ``m``
    drafts a token in ``drafts[m]`` seconds; ``cores[host]`` stages compute at once
    on a host (None: as many as it holds)."""

    stages: tuple[float, ...]
    hops: tuple[float, ...]
    drafts: tuple[float, ...]
    call: float = 0.0
    coordinator: float = 0.0
    hop_per_token: float = 0.0
    hosts: tuple[int, ...] | None = None
    cores: dict[int, int] | None = None

    @property
    def stage_count(self) -> int:
        return len(self.stages)

    def stage_seconds(self, stage: int, tokens: int) -> float:
        return self.stages[stage]

    def hop_seconds(self, hop: int, tokens: int) -> float:
        return self.hops[hop] + self.hop_per_token * tokens

    def coordinator_seconds(self, tokens: int) -> float:
        return self.coordinator

    def draft_seconds(self, machine: int) -> float:
        return self.drafts[machine]

    def draft_call_seconds(self) -> float:
        return self.call

    def host(self, stage: int) -> int:
        return stage if self.hosts is None else self.hosts[stage]

    def parallel_stages(self, host: int) -> int | None:
        return None if self.cores is None else self.cores[host]


class FixedDraws(random.Random):
    """A random source that returns the given numbers in turn."""

    def __init__(self, *values: float):
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


@dataclass(frozen=True)
class RightUntilTheEnd:
    """A drafter that always proposes, and proposes right, and a target that ends the text at ``end``."""

    end: int

    def draw(self, position: int, prefix_right: bool, fresh: bool, rng: random.Random) -> bool | None:
        return prefix_right


# -- the workloads


@pytest.mark.parametrize("rates", [dict(acceptance=1.5), dict(acceptance=-0.1), dict(acceptance=0.5, availability=1.5),
                                   dict(acceptance=0.5, first_acceptance=1.5), dict(acceptance=0.5, continuation=1.5)])
def test_draft_rates_outside_zero_to_one_are_refused(rates):
    with pytest.raises(ValueError, match=r"^acceptances, availability and continuation are probabilities in \[0, 1\]$"):
        DraftBehaviour(**rates)


def test_a_fresh_draw_proposes_below_the_availability_and_is_right_below_the_first_acceptance():
    rates = DraftBehaviour(acceptance=0.25, availability=0.5, first_acceptance=0.75, continuation=0.125)
    # a draw equal to the availability proposes nothing (it stops with probability 1 - availability)
    assert rates.draw(1, True, True, FixedDraws(0.5)) is None
    # a draw equal to the first acceptance is wrong (right with probability first_acceptance)
    assert rates.draw(1, True, True, FixedDraws(0.25, 0.75)) is False
    assert rates.draw(1, True, True, FixedDraws(0.25, 0.5)) is True


def test_a_later_draw_goes_on_below_the_continuation_and_is_right_below_the_acceptance():
    rates = DraftBehaviour(acceptance=0.25, availability=0.5, first_acceptance=0.75, continuation=0.125)
    assert rates.draw(2, True, False, FixedDraws(0.125)) is None
    assert rates.draw(2, True, False, FixedDraws(0.0625, 0.25)) is False
    assert rates.draw(2, True, False, FixedDraws(0.0625, 0.125)) is True
    assert rates.draw(2, False, False, FixedDraws(0.0625, 0.0)) is False  # after a wrong token, wrong


def test_rates_of_zero_never_propose_or_accept_even_on_a_draw_of_zero():
    assert DraftBehaviour(1.0, availability=0.0).draw(1, True, True, FixedDraws(0.0, 0.0)) is None
    assert DraftBehaviour(0.0, first_acceptance=0.0).draw(1, True, True, FixedDraws(0.0, 0.0)) is False


def test_a_replayed_trace_asks_the_drafter_after_each_token_but_the_first():
    prompt, output = [1, 2], [3, 4, 9, 5, 6]
    contexts = []

    def propose(context: list[int]) -> int | None:
        contexts.append(list(context))
        return None if context[-1] == 4 else context[-1] + 1  # counts up, except after a 4

    trace = DraftTrace.replay(propose, prompt, output)
    # token 0 comes from the prompt's pass; after 3 it proposes 4 (right), after 4 nothing,
    # after 9 it proposes 10 (wrong: 5), after 5 it proposes 6 (right)
    assert trace == DraftTrace((None, True, None, False, True))
    assert contexts == [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 9], [1, 2, 3, 4, 9, 5]]


def test_a_trace_is_written_one_character_a_token_and_read_back():
    trace = DraftTrace((None, True, False, True))
    assert trace.as_text() == ".RwR"
    assert DraftTrace.from_text(".RwR") == trace
    assert DraftTrace.from_text("") == DraftTrace(())


def test_a_trace_text_with_other_characters_is_refused_naming_the_first_in_order():
    with pytest.raises(ValueError, match=r"^a draft trace holds only R, w and \. \(found 'x'\)$"):
        DraftTrace.from_text("R.x")
    with pytest.raises(ValueError, match=r"^a draft trace holds only R, w and \. \(found 'Q'\)$"):
        DraftTrace.from_text("RzwQ")


def test_a_trace_proposes_what_was_recorded_and_only_wrong_tokens_after_a_wrong_one():
    trace = DraftTrace.from_text(".R.R")
    rng = random.Random(0)
    assert [trace.draw(position, True, False, rng) for position in range(5)] == [None, True, None, True, None]
    assert trace.draw(1, False, False, rng) is False
    assert trace.draw(2, False, False, rng) is False  # even where nothing was recorded


def test_a_mode_needs_at_least_one_draft():
    with pytest.raises(ValueError, match=r"^draft_max must be at least 1$"):
        Mode("sync", draft_max=0)


# -- what each step costs


def test_sync_pays_the_stage_0_drafter_the_call_every_hop_in_order_and_the_coordinator_each_pass():
    """Every sync pass here carries one draft (the drafter stops after one token)
    and commits two tokens: 40 tokens after the first in 20 passes, one after the other."""
    costs = TableCosts(stages=(1.0, 2.0, 4.0), hops=(0.5, 0.25, 0.125, 0.0625), drafts=(0.25, 8.0, 16.0), call=0.125,
                       coordinator=0.375, hop_per_token=0.03125)
    run = simulate(costs, Mode("sync", 4), DraftBehaviour(1.0, continuation=0.0), max_tokens=41)
    # per pass: one draft token beside stage 0, the call, hops 0..3 of two tokens each, the stages, the coordinator
    per_pass = 0.25 + 0.125 + (0.5 + 0.25 + 0.125 + 0.0625 + 4 * 2 * 0.03125) + (1.0 + 2.0 + 4.0) + 0.375
    assert (run.tokens, run.passes, run.drafted_tokens, run.accepted_tokens) == (41, 20, 20, 20)
    assert run.seconds == pytest.approx(20 * per_pass)
    assert run.stage_busy_seconds == pytest.approx([20 * 1.0, 20 * 2.0, 20 * 4.0])


def test_async_drafts_on_one_drafter_through_each_pass_and_pays_a_call_for_each_collect():
    """One draft a window (draft_max 1), both drafters at 0.75 s a token, calls of
    0.25 s, a step of 0.3 (windows ahead only after a window accepted all its
    drafts). A pass submitted at t leaves stage 0 at t + 1 (hop 0.5, compute
    0.5) and stage 1 at t + 1.5, and its result is back at t + 2.25.

    First the drafter beside stage 0 drafts token 1 (0.75 s, then the call: t = 1).
    During each pass the same drafter drafts from t until the result, at most
    two windows' worth (the speculation budget), and is collected with it (the
    call: t + 2.5). During pass 1 (token 0, draft 1) it drafts tokens 2-4 (2.25
    s); pass 1 commits tokens 1-2 by 3.5 and the sequence is on a roll: pass 2
    (token 2, draft 3) and pass 3 (token 4, started ahead) go at 3.5. During
    pass 2 it drafts token 5 (the budget); pass 2 commits 3-4 by 6.0: pass 4
    (token 5) goes ahead at 6.0. Pass 3 commits 5 at 6.5, pass 4 commits 6 at
    8.25 (8.5 with the last call)."""
    costs = TableCosts(stages=(0.5, 0.5), hops=(0.5, 0.0, 0.75), drafts=(0.75, 0.75), call=0.25)
    run = simulate(costs, Mode("async", 1, step=0.3), DraftBehaviour(1.0), max_tokens=7)
    assert (run.tokens, run.passes, run.discarded_passes, run.drafted_tokens, run.accepted_tokens) == (7, 4, 0, 2, 2)
    assert run.seconds == pytest.approx(8.5)
    assert run.stage_busy_seconds == pytest.approx([2.0, 2.0])


# -- cores


def _async_run(**placement) -> tuple:
    costs = TableCosts(stages=(1.0, 1.0, 1.0), hops=(0.0625,) * 4, drafts=(0.0, 0.0, 0.0), **placement)
    run = simulate(costs, Mode("async", 4), DraftBehaviour(1.0), max_tokens=81)
    return run.seconds, run.passes, run.stage_busy_seconds


def test_a_window_started_ahead_waits_for_each_stage_to_finish_the_window_before_it():
    """Three stages, two cores on each one's host, all drafts right, drafters
    instant, one draft a window, a step of 0.3 (windows ahead only after a
    window accepted all its drafts). A pass submitted at t leaves stage i at
    t + 1.0625 (i + 1) and is back at t + 3.25. The first window (token 0, draft
    1) is back at 3.25 with tokens 1-2; meanwhile the drafter beside stage 0
    drafted tokens 2, 3 and 4. Then the next window (token 2, draft 3) and one started
    ahead on the speculation (token 4) are submitted together. The one ahead
    waits for stage 0 until 4.3125 and leaves it at 5.3125; it reaches stages 1
    and 2 as the window before it leaves them (5.375, 6.4375), leaves them at
    6.375 and 7.4375, and is back at 7.5 with token 5."""
    costs = TableCosts(stages=(1.0, 1.0, 1.0), hops=(0.0625,) * 4, drafts=(0.0, 0.0, 0.0), cores={0: 2, 1: 2, 2: 2})
    run = simulate(costs, Mode("async", 1, step=0.3), DraftBehaviour(1.0), max_tokens=6)
    assert (run.tokens, run.passes, run.discarded_passes, run.drafted_tokens, run.accepted_tokens) == (6, 3, 0, 2, 2)
    assert run.seconds == 7.5


def test_stages_on_one_host_with_a_core_each_work_as_on_hosts_of_their_own():
    separate = _async_run(cores={0: 1, 1: 1, 2: 1})
    assert _async_run(hosts=(0, 0, 0), cores={0: 3}) == separate
    assert _async_run(hosts=(0, 0, 0)) == separate  # None: as many cores as stages


def test_stages_sharing_a_one_core_host_take_turns_whatever_the_other_hosts_have():
    shared = _async_run(hosts=(0, 0, 1), cores={0: 1, 1: 3})
    assert shared == _async_run(hosts=(0, 0, 1), cores={0: 1, 1: 1})
    separate = _async_run(hosts=(0, 0, 1), cores={0: 2, 1: 1})
    assert shared[1] == separate[1] and shared[0] > separate[0]


# -- the draft policy's costs, the end of the text, several sequences


def test_a_drafter_too_dear_to_ask_is_asked_for_the_first_window_only():
    """A call cost of 10 one-token passes outweighs anything 8 drafts can commit;
    only the first window, before any evidence, carries a draft (accepted)."""
    costs = TableCosts(stages=(1.0, 1.0), hops=(0.0, 0.0, 0.0), drafts=(0.0, 0.0))
    run = simulate(costs, Mode("sync", 8, call_cost=10.0), DraftBehaviour(1.0), max_tokens=41)
    assert (run.tokens, run.passes, run.drafted_tokens, run.accepted_tokens) == (41, 1 + 38, 1, 1)


def test_a_draft_at_the_ends_position_is_not_accepted():
    """The target ends the text at position 6: positions 0-5 are text. The drafter
    proposes right tokens past it; however the windows fall, the one that reaches
    position 6 ends the text there, its draft for position 6 not accepted."""
    costs = TableCosts(stages=(1.0, 1.0), hops=(0.0, 0.0, 0.0), drafts=(0.0, 0.0))
    run = simulate(costs, Mode("sync", 8), RightUntilTheEnd(6), max_tokens=64)
    assert run.tokens == 6


def test_a_text_that_ends_at_its_first_generated_token_takes_no_time_after_it():
    costs = TableCosts(stages=(1.0, 1.0), hops=(0.0, 0.0, 0.0), drafts=(0.0, 0.0))
    run = simulate(costs, Mode("sync", 8), DraftTrace.from_text("."), max_tokens=10)
    assert (run.tokens, run.passes, run.seconds) == (1, 1, 0.0)


def test_a_sequence_whose_window_is_discarded_does_not_hold_up_another_in_the_same_pass():
    """Sequence 0 fails after a run of right drafts, so a window started ahead on it
    is discarded; sequence 1 is right all along and shares those passes. Each
    makes the decisions it makes alone."""
    costs = TableCosts(stages=(1.0, 1.0), hops=(0.0625,) * 3, drafts=(0.0, 0.0))
    texts = [".RRRRRRRRRRRRw....RRRRRRRRRRRRRRw" + "R" * 30, "." + "R" * 60]
    together = simulate_many(costs, Mode("async", 4), [DraftTrace.from_text(text) for text in texts], max_tokens=200)
    for text, run in zip(texts, together):
        alone = simulate(costs, Mode("async", 4), DraftTrace.from_text(text), max_tokens=200)
        assert (run.tokens, run.passes, run.discarded_passes, run.drafted_tokens, run.accepted_tokens) == \
            (alone.tokens, alone.passes, alone.discarded_passes, alone.drafted_tokens, alone.accepted_tokens)
        assert run.tokens == len(text)
    assert together[0].discarded_passes > 0


# -- seeds and predictions

COSTS = TableCosts(stages=(1.0, 1.0), hops=(0.0625,) * 3, drafts=(0.125, 0.125))
RATES = DraftBehaviour(0.5, availability=0.75, continuation=0.75)


def test_a_seed_fixes_the_draws_and_the_default_seed_is_0():
    runs = {seed: simulate(COSTS, Mode("async", 4), RATES, max_tokens=60, seed=seed) for seed in (0, 1, 3)}
    assert runs[0] != runs[1] and runs[0] != runs[3]  # the draws differ by seed
    assert simulate(COSTS, Mode("async", 4), RATES, max_tokens=60) == runs[0]
    assert simulate(COSTS, Mode("async", 4), RATES, max_tokens=60, seed=3) == runs[3]
    assert simulate_many(COSTS, Mode("async", 4), [RATES], max_tokens=60) == [runs[0]]
    assert simulate_many(COSTS, Mode("async", 4), [RATES], max_tokens=60, seed=3) == [runs[3]]


def test_a_prediction_is_the_medians_and_shares_over_runs_seeded_0_to_runs_minus_1():
    mode = Mode("async", 4)
    runs = [simulate(COSTS, mode, RATES, max_tokens=40, seed=seed) for seed in range(5)]
    prediction = predict(COSTS, mode, RATES, max_tokens=40, runs=5)
    assert prediction.mode == mode
    assert prediction.tokens_per_second == statistics.median(run.tokens_per_second for run in runs)
    assert prediction.passes_per_token == sum(run.passes for run in runs) / sum(run.tokens for run in runs)
    assert prediction.acceptance_rate == sum(run.accepted_tokens for run in runs) / sum(run.drafted_tokens for run in runs)
    assert prediction.discarded_passes_per_run == sum(run.discarded_passes for run in runs) / 5
    assert prediction.stage_busy_fraction == tuple(statistics.median(run.stage_busy_seconds[stage] / run.seconds
                                                                     for run in runs) for stage in range(2))
    assert 0 < prediction.acceptance_rate < 1 and prediction.discarded_passes_per_run > 0


def test_a_prediction_takes_32_runs_unless_told():
    assert predict(COSTS, Mode("sync", 4), RATES, max_tokens=12) == predict(COSTS, Mode("sync", 4), RATES, max_tokens=12,
                                                                           runs=32)
    assert predict(COSTS, Mode("sync", 4), RATES, max_tokens=12) != predict(COSTS, Mode("sync", 4), RATES, max_tokens=12,
                                                                           runs=33)


def test_a_plain_prediction_drafts_nothing_and_accepts_nothing():
    prediction = predict(COSTS, Mode("plain"), RATES, max_tokens=10, runs=2)
    assert prediction.acceptance_rate == 0.0 and prediction.passes_per_token == 9 / 10


# -- traces with forks, tree modes, and what a mode refuses


def test_a_replayed_trace_with_candidates_records_how_many_others_there_are_or_which_of_them_is_right():
    """Token 0 comes from the prompt's pass: no candidates there (0, 0). After 3
    the drafter proposes 9 (wrong) and its other candidates are 4 (right) and 7:
    the first other is right, (1, 1). After 4 it proposes 5 (right); its others
    8 and 7 are both wrong: two others, none right, (2, 0). After 5 it proposes
    nothing; its one other candidate is 6, right: (1, 1)."""
    proposals = {3: 9, 4: 5, 5: None}
    ranked = {3: [9, 4, 7], 4: [5, 8, 7], 5: [6]}
    trace = DraftTrace.replay(lambda context: proposals[context[-1]], [1, 2], [3, 4, 5, 6],
                              candidates=lambda context: ranked[context[-1]])
    assert trace == DraftTrace((None, False, True, None), ((0, 0), (1, 1), (2, 0), (1, 1)))
    assert trace.as_text() == ".wR.|0a2a"


@pytest.mark.parametrize("symbol", ["j", "Z", "`", "A"])
def test_a_trace_text_with_a_fork_outside_digits_and_a_to_i_is_refused(symbol):
    with pytest.raises(ValueError, match=rf"^a draft trace's forks hold only digits and a-i \(found '{symbol}'\)$"):
        DraftTrace.from_text(".R|0" + symbol)


def test_a_trace_texts_fork_letters_run_from_a_the_first_other_candidate_to_i_the_ninth():
    assert DraftTrace.from_text(".RR|0ai").forks == ((0, 0), (1, 1), (9, 9))


def test_a_mode_needs_at_least_one_tree_leaf():
    with pytest.raises(ValueError, match=r"^tree_leaves must be at least 1$"):
        Mode("sync", tree_leaves=0)


TREE_COSTS = TableCosts(stages=(1.0, 1.0), hops=(0.0, 0.0, 0.0), drafts=(0.0, 0.0))
# every proposal wrong, the first other candidate right: only a tree's side row commits a draft
WRONG_BUT_FIRST_OTHER_RIGHT = DraftTrace.from_text("." + "w" * 30 + "|0" + "a" * 30)


def test_a_mode_of_two_tree_leaves_verifies_the_side_row_a_trace_offers():
    chain = simulate(TREE_COSTS, Mode("sync", 4, call_cost=0.0, step=0.0), WRONG_BUT_FIRST_OTHER_RIGHT, max_tokens=100)
    tree = simulate(TREE_COSTS, Mode("sync", 4, call_cost=0.0, step=0.0, tree_leaves=2), WRONG_BUT_FIRST_OTHER_RIGHT,
                    max_tokens=100)
    assert (chain.tokens, chain.passes, chain.tree_passes, chain.side_accepted, chain.accepted_tokens) == (31, 31, 0, 0, 0)
    assert (tree.tokens, tree.passes, tree.tree_passes, tree.side_accepted) == (31, 16, 15, 15)


def test_a_modes_side_row_step_prices_the_side_rows_instead_of_the_step():
    """Right drafts at odd positions, the first other candidate right at even ones."""
    trace = DraftTrace.from_text(".RwRwRwRwRwRwRwRwRwRw|0" + "0a" * 10)

    def run(step, side_row_step):
        return simulate(TREE_COSTS, Mode("sync", 4, call_cost=0.0, step=step, tree_leaves=2, side_row_step=side_row_step),
                        trace, max_tokens=100)

    priced_as_any_row = run(0.5, None)
    assert (priced_as_any_row.passes, priced_as_any_row.tree_passes, priced_as_any_row.side_accepted) == (11, 0, 0)
    free_side_rows = run(0.5, 0.0)
    assert (free_side_rows.passes, free_side_rows.tree_passes, free_side_rows.side_accepted) == (14, 4, 4)
    assert (run(0.0, None).tree_passes, run(0.0, None).side_accepted) == (5, 10)
    dear_side_rows = run(0.0, 5.0)
    assert (dear_side_rows.passes, dear_side_rows.tree_passes, dear_side_rows.side_accepted) == (11, 0, 0)


# -- across rejections


def test_a_window_starts_ahead_only_of_one_after_a_window_that_accepted_all_its_drafts(monkeypatch):
    """Two stages, drafts right 0.8 of the time: windows start ahead, each
    while the sequence is on a roll (after a rejection its speculation is gone)."""
    accepted_whole = []
    window_ahead = SequenceState.window_ahead

    def spy(state):
        window = window_ahead(state)
        if window is not None:
            accepted_whole.append(state.accepted_whole)
        return window

    monkeypatch.setattr(SequenceState, "window_ahead", spy)
    costs = TableCosts(stages=(1.0, 1.0), hops=(0.0625,) * 3, drafts=(0.1, 0.1))
    simulate(costs, Mode("async", 3, step=0.0), DraftBehaviour(0.8), max_tokens=48, seed=3)
    assert accepted_whole and all(accepted_whole)


def test_after_a_rejection_the_drafter_beside_stage_0_starts_before_the_discarded_passes_are_back(monkeypatch):
    """A rejection discards the window started ahead of the one that
    rejected; the committed text is known then, and the drafter beside
    stage 0 starts drafting from it while the discarded pass is still in flight."""
    early = []
    speculate = _SimulatedDrafter.speculate

    def spy(drafter, context, most=None, sampling=None, tree=None):
        state = drafter.state
        if len(context) == len(state.committed):
            early.append(state.discards_pending > 0)
        speculate(drafter, context, most, sampling, tree)

    monkeypatch.setattr(_SimulatedDrafter, "speculate", spy)
    costs = TableCosts(stages=(1.0, 1.0), hops=(0.0625,) * 3, drafts=(0.1, 0.1))
    run = simulate(costs, Mode("async", 3, step=0.0), DraftBehaviour(0.6), max_tokens=48, seed=3)
    assert run.discarded_passes > 0
    assert True in early
