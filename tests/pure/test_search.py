"""The split search and the recommendation (orchestrator.planning.search).

Toy setups whose costs are worked out by hand: blocks of 1 GB, machines that
either read their weights at a stated number of seconds per GB (a pass costs
the same for any batch) or compute at a stated time per block and token (a
pass of n tokens costs n times one), no hop, coordinator or drafter cost.
A plain pipeline then costs the sum of its stages per token, so which split
is fastest, which fit, which the memory tie-break prefers and which the
coarse grid and its single-boundary moves can reach follow from the setup.
Guards: the memory test at exactly the headroom, a fixed split, the exact
refusals, the grid step and the fallback to every split, the local moves,
the tie within PLAN_TIE of the fastest, and the predictions' wiring.
"""

from __future__ import annotations

import pytest

from orchestrator.planning.costs import Machine, ModelShape, Software
from orchestrator.planning.inputs import PlanError, Setup
from orchestrator.planning.search import (PLAN_SEARCH_RUNS, PLAN_TIE, candidate_splits, choose_split, fits,
                                          memory_needed, memory_proportional, predict_modes, recommend)
from orchestrator.planning.simulation import DraftBehaviour, Mode, predict, simulate

GB = 10**9


def shape(blocks: int, *, block: int = GB, embedding: int = 0, head: int = 0, kv: int = 0) -> ModelShape:
    """``blocks`` blocks of ``block`` bytes and one parameter each (so compute is set by the machine)."""
    return ModelShape("toy", blocks, 1, 1, (block,) * blocks, head, embedding, 1, 0, kv)


def reader(name: str, memory: float, seconds_per_gb: float) -> Machine:
    """A pass costs its weights' GB times seconds_per_gb, whatever the batch."""
    return Machine(name, memory, GB / seconds_per_gb, 1e30)


def adder(name: str, memory: float, seconds_per_block_token: float) -> Machine:
    """A pass of n tokens over k blocks costs k * n * seconds_per_block_token."""
    return Machine(name, memory, 1e30, 2 / seconds_per_block_token)


def make_setup(model: ModelShape, machines: list[Machine], behaviour: DraftBehaviour | None = None,
               **options) -> Setup:
    options.setdefault("max_tokens", 4)
    return Setup(model, machines, [None] * len(machines), Software(0.0, 0.0, 0.0), behaviour, **options)


# -- memory -------------------------------------------------------------------

def test_a_stage_needs_its_weights_its_kv_cache_and_the_draft():
    setup = make_setup(shape(3, embedding=GB // 2, head=GB // 4, kv=1000), [reader("a", 100 * GB, 1.0)] * 2,
                       context=2000, draft_bytes=GB // 10)
    # stage 0: blocks 0, 1 and the embedding; stage 1: block 2 and the head; 2000 x 1000 bytes of KV per block
    assert memory_needed(setup, (0, 2)) == (2 * GB + GB // 2 + 2 * 2_000_000 + GB // 10,
                                            GB + GB // 4 + 2_000_000 + GB // 10)


def test_a_split_fits_when_it_needs_exactly_the_headroom_of_each_machine():
    # 8 GB of weights, 0.25 GB of KV cache and a 0.75 GB draft: 9 GB, 90% of 10 GB
    model = shape(1, block=8 * GB, kv=250_000)
    exact = make_setup(model, [reader("a", 10 * GB, 1.0)], context=1000, draft_bytes=3 * GB // 4)
    assert memory_needed(exact, (0,)) == (9 * GB,)
    assert fits(exact, (0,))
    short = make_setup(model, [reader("a", 10 * GB - 10, 1.0)], context=1000, draft_bytes=3 * GB // 4)
    assert not fits(short, (0,))


# -- the candidates ---------------------------------------------------------------

def test_one_machine_has_the_one_split_that_starts_at_block_zero():
    assert candidate_splits(5, 1, 1) == [(0,)]
    assert candidate_splits(5, 1, 2) == [(0,)]
    recommendation = recommend(make_setup(shape(5), [reader("a", 100 * GB, 0.001)]))
    assert recommendation.starts == (0,) and recommendation.blocks_per_machine == (5,)


def test_candidate_splits_on_a_step_keep_only_boundaries_on_its_multiples():
    assert candidate_splits(7, 2, 2) == [(0, 2), (0, 4), (0, 6)]
    assert candidate_splits(7, 3, 3) == [(0, 3, 6)]


def test_memory_proportional_gives_each_machine_blocks_in_proportion_to_its_memory():
    machines = [reader("a", 16 * GB, 1.0), reader("b", 16 * GB, 1.0), reader("c", 32 * GB, 1.0)]
    assert memory_proportional(make_setup(shape(8), machines)) == (0, 2, 4)  # 8 x 1/4, 8 x 2/4
    three = [reader("a", 10 * GB, 1.0), reader("b", 20 * GB, 1.0), reader("c", 30 * GB, 1.0)]
    assert memory_proportional(make_setup(shape(10), three)) == (0, 2, 5)  # round(1.67), 10 x 3/6


def test_memory_proportional_rounds_an_exact_half_to_the_even_block():
    # 5 blocks over two equal machines: 2.5 rounds to 2 (Python rounds halves to even)
    assert memory_proportional(make_setup(shape(5), [reader("a", GB, 1.0), reader("b", GB, 1.0)])) == (0, 2)
    assert memory_proportional(make_setup(shape(7), [reader("a", GB, 1.0), reader("b", GB, 1.0)])) == (0, 4)


def test_memory_proportional_gives_each_machine_at_least_one_block():
    machines = [reader("a", GB, 1.0), reader("b", GB, 1.0), reader("c", 100 * GB, 1.0)]
    # 8 x 1/102 and 8 x 2/102 both round to 0
    assert memory_proportional(make_setup(shape(8), machines)) == (0, 1, 2)


# -- a fixed split and the refusals -------------------------------------------------

def test_a_fixed_split_is_taken_as_given_even_when_another_is_faster():
    machines = [reader("a", 100 * GB, 0.1), reader("b", 100 * GB, 0.001)]
    setup = make_setup(shape(5), machines, starts=(0, 3))
    assert choose_split(setup) == (0, 3)
    assert recommend(setup).blocks_per_machine == (3, 2)
    assert choose_split(make_setup(shape(5), machines)) == (0, 1)  # the search would put 4 blocks on b


def test_a_fixed_split_with_the_wrong_number_of_stages_is_refused():
    setup = make_setup(shape(5), [reader("a", 100 * GB, 1.0)] * 2, starts=(0,))
    with pytest.raises(PlanError, match=r"^the split has 1 stages but the setup has 2 machines$"):
        choose_split(setup)


def test_a_fixed_split_that_does_not_fit_is_refused():
    # machine b holds at most 3 blocks (0.9 x 4 GB): the split [0, 1] gives it 4
    setup = make_setup(shape(5), [reader("a", 100 * GB, 1.0), reader("b", 4 * GB, 1.0)], starts=(0, 1))
    with pytest.raises(PlanError, match=r"^the split \[0, 1\] does not fit in the machines' memory$"):
        choose_split(setup)


def test_as_many_blocks_as_machines_gives_one_block_each_and_fewer_are_refused():
    machines = [reader("a", 100 * GB, 1.0)] * 2
    assert choose_split(make_setup(shape(2), machines)) == (0, 1)
    with pytest.raises(PlanError, match=r"^1 blocks cannot be split over 2 machines$"):
        choose_split(make_setup(shape(1), machines))


def test_a_model_too_big_for_two_machines_is_refused_with_the_memory_it_needs():
    # each 1 GB block with 0.25 GB of KV cache and a 0.5 GB draft: 1.75 GB per stage, 3.5 GB in all
    # (the draft counted on both machines); 90% of 1.5 GB is 1.35 GB
    setup = make_setup(shape(2, kv=250_000), [reader("a", 1.5 * GB, 1.0), reader("b", GB, 1.0)],
                       context=1000, draft_bytes=GB // 2)
    with pytest.raises(PlanError, match=(
            r"^toy does not fit: no split of 2 blocks over 2 machines leaves each within 90% of its memory "
            r"\(largest machine 2 GB; about 4 GB needed in all with KV cache and drafts\)$")):
        choose_split(setup)


def test_a_model_too_big_for_one_machine_is_refused_with_the_memory_it_needs():
    # 2 GB of blocks, 0.5 GB of embedding, 0.5 GB of KV cache and a 0.5 GB draft: 3.5 GB
    setup = make_setup(shape(2, embedding=GB // 2, kv=250_000), [reader("a", 1.5 * GB, 1.0)],
                       context=1000, draft_bytes=GB // 2)
    with pytest.raises(PlanError, match=(
            r"^toy does not fit: no split of 2 blocks over 1 machines leaves each within 90% of its memory "
            r"\(largest machine 2 GB; about 4 GB needed in all with KV cache and drafts\)$")):
        choose_split(setup)


# -- the search: grid, single-boundary moves, memory tie-break ------------------------
# 42 blocks over two machines: 41 boundaries, more than PLAN_GRID_SPLITS, so the grid steps by 2
# (20 boundaries) and the moves go one block either way of the best; 41 blocks still step by 1.

def test_the_moves_find_the_fastest_split_off_the_grid():
    # a costs 0.1 s a block, b 0.001 s: one block on a is fastest; the grid's best is [0, 2]
    assert choose_split(make_setup(shape(42), [reader("a", 100 * GB, 0.1), reader("b", 100 * GB, 0.001)])) \
        == (0, 1)


def test_the_moves_stop_short_of_the_last_block():
    # a is the fast one: all but one block on a; [0, 42] (an empty last stage) is no split
    assert choose_split(make_setup(shape(42), [reader("a", 100 * GB, 0.001), reader("b", 100 * GB, 0.1)])) \
        == (0, 41)


def test_the_moves_stay_within_the_machines_memory():
    # b is fast but holds at most 39 blocks (0.9 x 39.5 / 0.9 GB): a must take 3, off the grid
    machines = [reader("a", 100 * GB, 0.1), reader("b", 39.5 / 0.9 * GB, 0.001)]
    assert choose_split(make_setup(shape(42), machines)) == (0, 3)


def test_the_moves_go_on_while_they_help():
    # a 0.03 s a block, b 0.02 s, c 0.01 s; a and b hold at most 2 blocks, c at most 8.
    # Of 11 blocks only [0, 2, 4] (0.17 s), [0, 2, 3] (0.16 s) and [0, 1, 3] (0.15 s) fit; the grid
    # (boundaries on multiples of 2) and the memory-proportional split give [0, 2, 4], one move
    # gives [0, 2, 3], a second [0, 1, 3]
    machines = [reader("a", 2.5 * GB, 0.03), reader("b", 2.5 * GB, 0.02), reader("c", 9.5 * GB, 0.01)]
    assert choose_split(make_setup(shape(11), machines)) == (0, 1, 3)


def test_the_moves_change_any_boundary_but_keep_every_stage():
    # b is fast and a and c slow: a and c one block each; the grid's best is [0, 2, 10]
    machines = [reader("a", 1000 * GB, 0.01), reader("b", 1000 * GB, 0.001), reader("c", 1000 * GB, 0.01)]
    assert choose_split(make_setup(shape(11), machines)) == (0, 1, 10)


def test_the_moves_make_at_most_three_rounds():
    # 9 blocks on four machines of 1, 0.3, 0.1 and 0.001 s a block: [0, 1, 2, 3] is fastest. The grid
    # (multiples of 2) gives [0, 2, 4, 6]; each round moves one boundary by one block, the best move
    # first: [0, 1, 4, 6], [0, 1, 3, 6], [0, 1, 2, 6], and there the search stops
    machines = [reader("a", 1e12, 1.0), reader("b", 1e12, 0.3), reader("c", 1e12, 0.1), reader("d", 1e12, 0.001)]
    assert choose_split(make_setup(shape(9), machines)) == (0, 1, 2, 6)


def test_splits_within_tie_of_the_fastest_are_decided_by_the_fullest_machine():
    # a is 0.1% faster than b: every split of 7 blocks is within 1% of the fastest. Memory used by
    # the fullest machine (a has 20 GB, b 10 GB): k blocks on a give max(k / 20, (7 - k) / 10), least at k = 5
    machines = [reader("a", 20 * GB, 0.999), reader("b", 10 * GB, 1.0)]
    assert choose_split(make_setup(shape(7), machines)) == (0, 5)


def test_with_41_blocks_every_boundary_is_on_the_grid():
    # all splits tie on speed; a 3.5 GB embedding on a: k blocks on a need max(k + 3.5, 41 - k) GB,
    # least at k = 19 (22.5 GB), an odd boundary a grid on multiples of 2 would miss
    machines = [reader("a", 100 * GB, 0.999), reader("b", 100 * GB, 1.0)]
    assert choose_split(make_setup(shape(41, embedding=35 * GB // 10), machines)) == (0, 19)


def test_with_42_blocks_the_tie_is_decided_among_the_scored_splits_only():
    # an 8.5 GB embedding on a: max(k + 8.5, 42 - k) GB is least at k = 17 (25.5), then 16 (26), 18 (26.5).
    # The grid steps by 2 and the moves only go around the fastest ([0, 40]): 17 is never scored
    machines = [reader("a", 100 * GB, 0.999), reader("b", 100 * GB, 1.0)]
    assert choose_split(make_setup(shape(42, embedding=85 * GB // 10), machines)) == (0, 16)


def test_with_42_blocks_the_moves_reach_one_block_either_side_of_the_grid():
    # a has 600 GB, b 100 GB and a 1.2 GB head: max(k / 6, 42 - k + 1.2) is least at k = 37, then 38.
    # The moves around the fastest ([0, 40], then [0, 41]) score 39 and 41, not 37
    machines = [reader("a", 600 * GB, 0.999), reader("b", 100 * GB, 1.0)]
    assert choose_split(make_setup(shape(42, head=12 * GB // 10), machines)) == (0, 38)


def test_a_split_exactly_tie_slower_than_the_fastest_still_ties():
    # a reads 2^52 bytes a second, b 2^51. [0, 2] takes exactly 1 s a token; [0, 1] moves block 1
    # (b1 bytes) to b, which takes b1 / 2^52 s more: 1 / (1 - PLAN_TIE) s, rounded to a double, so that its
    # tokens/s is exactly (1 - PLAN_TIE) times the fastest. It leaves a less full, so it wins the tie.
    slower = 1 / (1 - PLAN_TIE)
    assert 1 / slower == 1.0 * (1 - PLAN_TIE)
    b1 = int((slower - 1) * 2**52)
    b2 = 10**15
    b0 = 2**52 - b1 - 2 * b2
    model = ModelShape("toy", 3, 1, 1, (b0, b1, b2), 0, 0, 1, 0, 0)
    machines = [Machine("a", 1e16, 2.0**52, 1e30), Machine("b", 1e16, 2.0**51, 1e30)]
    setup = make_setup(model, machines, max_tokens=2)
    assert predict_modes(setup, (0, 2), runs=1)["plain"].tokens_per_second == 1.0
    assert predict_modes(setup, (0, 1), runs=1)["plain"].tokens_per_second == 1.0 * (1 - PLAN_TIE)
    assert choose_split(setup) == (0, 1)


# -- every split when the grid has none that fits ----------------------------------------

def _narrow(blocks: int, most_on_a: int, most_on_b: int) -> Setup:
    """1 MB blocks and a 1 GB embedding: a holds at most most_on_a blocks, b most_on_b."""
    block, embedding = 10**6, GB
    machines = [Machine("a", (most_on_a * block + embedding + block / 2) / 0.9, GB, 1e30),
                Machine("b", (most_on_b * block + block / 2) / 0.9, GB, 1e30)]
    return make_setup(shape(blocks, block=block, embedding=embedding), machines, max_tokens=2)


def test_a_split_off_the_grid_is_found_by_trying_every_split_up_to_the_limit():
    # 5001 blocks: 5000 splits, PLAN_EVERY_SPLIT_LIMIT; the grid is on multiples of 125 and the
    # memory-proportional split gives a 2917 blocks; only 2501 on a fits
    assert choose_split(_narrow(5001, 2501, 2500)) == (0, 2501)


def test_past_the_limit_a_split_off_the_grid_is_not_tried():
    # 5002 blocks: 5001 splits, one past PLAN_EVERY_SPLIT_LIMIT; [0, 2501] would fit but is not tried
    with pytest.raises(PlanError, match=(
            r"^toy does not fit: no split of 5002 blocks over 2 machines leaves each within 90% of its memory "
            r"\(largest machine 4 GB; about 6 GB needed in all with KV cache and drafts\)$")):
        choose_split(_narrow(5002, 2501, 2501))


def test_every_split_tried_means_the_first_200_that_fit():
    # 101 blocks on three machines: 4950 splits, within PLAN_EVERY_SPLIT_LIMIT. a (11.5 GB) holds at most
    # 10 blocks, so no grid split (boundaries on multiples of 11) fits; b (49 GB) at most 44; c (194 GB,
    # a 100 GB head) at most 74. With k blocks on a, the second boundary runs from 27 to k + 44: k + 18
    # splits, 180 for k <= 8, so [0, 9, 47] is the 201st. It leaves the fullest machine least full (c at
    # 154 / 194), then [0, 8, 47] (b at 39 / 49); all speeds tie and c is fastest, so the moves stay
    # around a second boundary of 27 and never score [0, 9, 47].
    machines = [reader("a", 11.5 * GB, 1.0), reader("b", 49 * GB, 1.0), reader("c", 194 * GB, 0.999)]
    assert choose_split(make_setup(shape(101, head=100 * GB), machines, max_tokens=2)) == (0, 8, 47)


# -- the speculative schedules in the search ----------------------------------------------
# 4 blocks; a computes (1 ms a block and token), b reads (3 ms a block whatever the batch).
# Plain (1 token a pass): [0, 3] costs 3 + 3 = 6 ms, [0, 2] 2 + 6 = 8, [0, 1] 1 + 9 = 10.
# Passes of 9 tokens (8 right drafts): [0, 1] costs 9 + 9 = 18 ms, [0, 3] 27 + 3 = 30.
# Passes of 2 tokens (1 draft): [0, 3] costs 6 + 3 = 9 ms, [0, 1] 2 + 9 = 11.

COMPUTING, READING = adder("a", 100 * GB, 0.001), reader("b", 100 * GB, 0.003)


def _drafting(behaviour: DraftBehaviour | None, lengths: tuple[int, ...], draft_seconds: float = 0.0) -> Setup:
    return make_setup(shape(4), [COMPUTING, READING], behaviour, draft_seconds=[draft_seconds] * 2,
                      draft_lengths=lengths, max_tokens=64)


def test_without_a_draft_the_search_ranks_splits_by_the_plain_pipeline():
    assert choose_split(_drafting(None, (1, 8))) == (0, 3)


def test_the_search_ranks_splits_at_the_middle_draft_length():
    # lengths (1, 8): the middle one is 8, whose long passes favour b
    assert choose_split(_drafting(DraftBehaviour(1.0), (1, 8))) == (0, 1)
    assert choose_split(_drafting(DraftBehaviour(1.0), (8, 1))) == (0, 1)


def test_the_search_drafts_no_more_than_the_middle_length_in_either_schedule():
    # only length 1: passes of 2 tokens, which favour a
    assert choose_split(_drafting(DraftBehaviour(1.0), (1,))) == (0, 3)


def test_the_search_still_weighs_the_plain_pipeline_when_drafting_is_slow():
    # 10 ms a draft token: 8 drafts cost more than any pass saves, the plain pipeline's [0, 3] wins
    assert choose_split(_drafting(DraftBehaviour(1.0), (8,), draft_seconds=0.01)) == (0, 3)


def test_the_search_uses_the_setups_drafts_as_they_are_right():
    # drafts that are never right do not pay for their passes: the plain pipeline's split
    assert choose_split(_drafting(DraftBehaviour(0.0), (1, 8))) == (0, 3)


def test_the_search_scores_each_split_over_search_runs_runs():
    # Random drafts; [0, 1] puts 2 of 3 blocks on b, [0, 2] 1. As b gets slower, [0, 1] drops out of
    # the tie with [0, 2] at one slowness by the median of PLAN_SEARCH_RUNS runs and at another by that
    # of 32 (predict's default). Halfway between, the two counts disagree, and the search must follow
    # PLAN_SEARCH_RUNS: [0, 1] if it ties by them (it leaves b, 300 GB, less full), else [0, 2].
    def setup(slower: float) -> Setup:
        machines = [reader("a", 100 * GB, 0.001), reader("b", 300 * GB, 0.001 * slower)]
        return make_setup(shape(3), machines, DraftBehaviour(0.8), draft_seconds=[0.0002] * 2,
                          draft_lengths=(3,), max_tokens=16)

    def ties(slower: float, runs: int) -> bool:
        candidate = setup(slower)
        score = {starts: max(predict(candidate.costs(starts), Mode(schedule, 3), candidate.behaviour, 16,
                                     runs).tokens_per_second for schedule in ("plain", "sync", "async"))
                 for starts in ((0, 1), (0, 2))}
        return score[(0, 1)] >= score[(0, 2)] * (1 - PLAN_TIE)

    def last_tie(runs: int) -> float:
        low, high = 1.0, 2.0  # b as fast as a: a tie; twice as slow: none
        assert ties(low, runs) and not ties(high, runs)
        for _ in range(30):
            middle = (low + high) / 2
            low, high = (middle, high) if ties(middle, runs) else (low, middle)
        return low

    slower = (last_tie(PLAN_SEARCH_RUNS) + last_tie(32)) / 2
    by_search_runs = ties(slower, PLAN_SEARCH_RUNS)
    assert by_search_runs != ties(slower, 32)
    assert choose_split(setup(slower)) == ((0, 1) if by_search_runs else (0, 2))


# -- the recommendation -------------------------------------------------------------------
# 5 blocks; a reads at 2 ms a block, b at 1 ms. [0, 3]: 3 x 2 + 2 x 1 = 8 ms a token.

def _recommended(behaviour: DraftBehaviour | None, **options) -> Setup:
    options.setdefault("max_tokens", 3)
    return make_setup(shape(5), [reader("a", 100 * GB, 0.002), reader("b", 100 * GB, 0.001)], behaviour,
                      starts=(0, 3), **options)


def test_a_plain_recommendation_reports_the_split_its_blocks_memory_and_plain_prediction():
    recommendation = recommend(_recommended(None))
    assert recommendation.starts == (0, 3)
    assert recommendation.blocks_per_machine == (3, 2)
    assert recommendation.memory_needed == (3 * GB, 2 * GB)
    assert set(recommendation.predictions) == {"plain"}
    plain = recommendation.predictions["plain"]
    assert plain.tokens_per_second == pytest.approx(125.0)
    assert plain.passes_per_token == pytest.approx(2 / 3)  # 3 tokens: the first is given, 2 passes
    assert recommendation.best is plain


def test_each_schedule_is_predicted_at_the_setups_length_with_its_drafts():
    # 3 tokens: one pass carrying one right draft makes the other two
    predictions = predict_modes(_recommended(DraftBehaviour(1.0), draft_lengths=(2,)), (0, 3), runs=2)
    assert set(predictions) == {"plain", "sync", "async"}
    assert predictions["plain"].passes_per_token == pytest.approx(2 / 3)
    for schedule in ("sync", "async"):
        assert predictions[schedule].mode.draft_max == 2
        assert predictions[schedule].acceptance_rate == 1.0
        assert predictions[schedule].passes_per_token == pytest.approx(1 / 3)


def test_each_schedule_is_predicted_at_its_fastest_draft_length():
    # 9 tokens, every draft right: draft_max 8 makes them in far fewer passes than 1
    predictions = predict_modes(_recommended(DraftBehaviour(1.0), draft_lengths=(1, 8), max_tokens=9),
                                (0, 3), runs=1)
    assert predictions["sync"].mode.draft_max == 8 and predictions["async"].mode.draft_max == 8


def test_predictions_are_over_the_runs_asked_for():
    # one run: the prediction is that run's (seed 0); its one draft is right or wrong
    setup = _recommended(DraftBehaviour(0.5), draft_lengths=(1,))
    predictions = predict_modes(setup, (0, 3), runs=1)
    for schedule in ("sync", "async"):
        run = simulate(setup.costs((0, 3)), Mode(schedule, 1), setup.behaviour, 3, seed=0)
        assert predictions[schedule].acceptance_rate == run.accepted_tokens / run.drafted_tokens
        assert predictions[schedule].passes_per_token == run.passes / run.tokens
        assert predictions[schedule].tokens_per_second == run.tokens_per_second


def test_no_runs_give_no_prediction():
    with pytest.raises(ValueError, match=r"^a prediction needs at least one run, not 0$"):
        predict_modes(_recommended(None), (0, 3), runs=0)
