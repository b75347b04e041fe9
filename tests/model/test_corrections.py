"""Corrections (speculators.corrections) grown by the bench's draft of
realistic agreement: each is what the draft drafts after that token, as if
it had drafted it alone, and the chain beside them is the draft's chain."""

import numpy as np
import pytest

from speculators.corrections import (CORRECTION_RANKS, CORRECTION_SLACK, ROUND_WIDTHS, CorrectionGrowth, Forks,
                                     affordable_corrections, round_costs)
from speculators.model import ModelSpeculator
from speculators.sampling import SamplingSettings
from stages.tokenizer import Tokenizer

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def context(realistic_draft):
    return Tokenizer(realistic_draft).tokenize(PROMPT)


def flat(speculator):
    """Its rounds taken as timed at one step at every width (a memory-bound drafter): every correction fits."""
    speculator.round_seconds = {width: 1.0 for width in ROUND_WIDTHS}
    return speculator


def chain(speculator, context, count, sampling=None):
    drafts = []
    for _ in range(count):
        drafts.append(speculator.extend([*context, *drafts], sampling))
    return drafts


@pytest.mark.parametrize("sampling", [None, SamplingSettings(temperature=0.9, seed=3)], ids=["greedy", "coupled"])
def test_each_correction_is_the_drafts_own_continuation_of_a_runner_up(realistic_draft, context, sampling):
    speculator = flat(ModelSpeculator(realistic_draft, n_ctx=512, tree_branches=4 * CORRECTION_RANKS))
    reference = ModelSpeculator(realistic_draft, n_ctx=512)
    drafts = chain(speculator, context, 4, sampling)
    first = len(context)
    for position in range(first, first + 4 if sampling is None else first):  # greedy: its next best after its argmax
        logits = reference._context_logits([*context, *drafts][:position])
        ranked = [int(token) for token in np.argsort(-logits, kind="stable")[:CORRECTION_RANKS + 1]]
        assert speculator.runners_up[position] == ranked[1:]
    growth = CorrectionGrowth(speculator, [*context, *drafts], Forks(first, 4), most=3, length=4, sampling=sampling)
    while not growth.done:
        growth.round()
    assert len(growth.corrections) == 4 * CORRECTION_RANKS
    assert growth.extension == chain(reference, [*context, *drafts], 3, sampling)
    for (position, token), tokens in growth.corrections.items():
        assert token in speculator.runners_up[position] and tokens[0] == token and len(tokens) == 4
        assert tokens[1:] == chain(reference, [*context, *drafts][:position] + [token], 3, sampling), (position, token)
    text = [*context, *drafts, *growth.extension]  # and the draft goes on drafting from its cache afterwards
    assert speculator.extend(text, sampling) == reference.extend(text, sampling)


def test_a_growth_stops_the_chain_at_most_and_forks_only_where_it_has_ids(realistic_draft, context):
    speculator = flat(ModelSpeculator(realistic_draft, n_ctx=512, tree_branches=3))
    drafts = chain(speculator, context, 4)
    growth = CorrectionGrowth(speculator, [*context, *drafts], Forks(len(context) + 1, 2), most=1, length=3)
    runners_up = speculator.runners_up
    assert list(growth.corrections) == [(len(context) + 1, runners_up[len(context) + 1][0]),  # the likeliest first:
                                        (len(context) + 2, runners_up[len(context) + 2][0]),  # each runner-up
                                        (len(context) + 1, runners_up[len(context) + 1][1])]  # then the next rank
    while not growth.done:
        growth.round()
    assert len(growth.extension) == 1 and all(len(tokens) == 3 for tokens in growth.corrections.values())



def forks_timed(realistic_draft, context, round_seconds, rounds=0.0):
    """The corrections a growth opens at two drafts, its rounds timed so (as
    on the drafter's machine), its pass lasting ``rounds`` of the chain's."""
    speculator = ModelSpeculator(realistic_draft, n_ctx=512, tree_branches=4)
    speculator.round_seconds = round_seconds
    drafts = chain(speculator, context, 2)
    forks = Forks(len(context), 2, rounds)
    return list(CorrectionGrowth(speculator, [*context, *drafts], forks, most=4, length=3).corrections)


def test_a_round_carries_the_corrections_that_keep_it_within_the_slack_of_the_chains_step(realistic_draft,
                                                                                          context):
    each_row_a_step = {1: 1.0, 2: 1.8, 3: 2.6, 5: 4.2}  # a compute-bound CPU
    assert forks_timed(realistic_draft, context, each_row_a_step) == []
    memory_bound = {1: 1.0, 2: 1.0, 3: 1.05, 5: 1.1}
    assert len(forks_timed(realistic_draft, context, memory_bound)) == 4
    in_between = {1: 1.0, 2: 1.0, 3: 1.1, 5: 1.9}  # two fit: the runners-up of both drafts, the likeliest
    first, second = len(context), len(context) + 1
    assert [position for position, _ in forks_timed(realistic_draft, context, in_between)] == [first, second]
    assert affordable_corrections({1: 1.0, 2: 1.0, 3: 1.0, 5: 1.0, 9: CORRECTION_SLACK, 17: 2.0}) == 8


def test_a_pass_longer_than_the_chains_drafting_carries_corrections_in_its_idle_rounds(realistic_draft, context):
    """The chain needs 3 rounds for its drafting ahead (most 4, length 3): in a
    pass of 8 of its rounds, rounds of up to 8/3 steps fit, on a CPU where each row costs a step."""
    each_row_a_step = {1: 1.0, 2: 1.8, 3: 2.6, 5: 4.2}
    assert forks_timed(realistic_draft, context, each_row_a_step, rounds=3.0) == []  # the chain alone fills it
    assert len(forks_timed(realistic_draft, context, each_row_a_step, rounds=8.0)) == 2  # a round of 3 rows
    assert len(forks_timed(realistic_draft, context, each_row_a_step, rounds=13.0)) == 4
    assert affordable_corrections(each_row_a_step, need=3, rounds=7.7) == 1

def test_rounds_are_timed_without_changing_what_the_draft_drafts(realistic_draft, context):
    speculator = ModelSpeculator(realistic_draft, n_ctx=512, tree_branches=4)
    reference = ModelSpeculator(realistic_draft, n_ctx=512)
    drafts = chain(speculator, context, 2)
    speculator.roll_back([*context, *drafts])  # the cells below the last token, as a growth times them
    costs = round_costs(speculator.engine, len(context) + 1)
    assert sorted(costs) == [width for width in ROUND_WIDTHS if width <= 5] and all(costs.values())
    assert chain(speculator, [*context, *drafts], 3) == chain(reference, [*context, *drafts], 3)
