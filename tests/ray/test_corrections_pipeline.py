"""Corrections (speculators.corrections) through the pipeline on Ray: an
async draft model drafts, while a pass runs, what follows the likely
rejections of its window, and after a rejection the correction holding the
target's token becomes the next drafts; the text is unchanged.

A file of its own: its pipeline has an emulated cost curve, and the
session's cluster has no room for it beside tests/ray/test_speculation.py's
two pipelines."""

import functools

import fakes
from orchestrator.cluster.pipeline import Pipeline
from speculators.corrections import CORRECTION_RANKS
from stages.cost_curve import BatchCurve, CostCurve, StageCurve
from stages.settings import StageSettings
from stages.tokenizer import Tokenizer
from test_speculation import GREEDY, OPEN, SAMPLING, assert_unchanged, decode
from test_speculation import pickle_doubles_by_value  # noqa: F401 (a fixture)

# Every stage pass lasts at least 150 ms, as on a memory-bound machine: a drafter has the pass's
# time for its corrections, however loaded this machine is (on its own passes, tens of
# milliseconds, a drafter slowed by other tests beside it had none ready: 0 corrected windows).
MEMORY_BOUND = CostCurve("flat 150 ms", stages=(StageCurve(BatchCurve((1, 64), (0.150, 0.150))),))


def test_a_draft_of_realistic_agreement_is_partly_rejected_and_still_exact(ray_cluster, splits, realistic_draft):
    """Async with corrections (speculators.corrections): after some rejections
    the next window's drafts are a correction's, and the text is unchanged."""
    forks = 6 * CORRECTION_RANKS  # a KV id for each runner-up of each of a window's 6 drafts
    # its rounds timed as a memory-bound drafter's: on this CPU the corrections would wait for spare time
    make = functools.partial(fakes.flat_round_draft, realistic_draft, n_ctx=1024 + forks * 7, tree_branches=forks)
    tokenizer = Tokenizer(splits[2][0])
    # the plain runs' tokens from stages without the curve: the same logits, without 150 ms a token of waiting
    with Pipeline(splits[2], StageSettings(n_ctx=1024)) as unhurried:
        plain = {sampling: decode(unhurried, tokenizer, OPEN, sampling).tokens for sampling in (GREEDY, SAMPLING)}
    with Pipeline(splits[2], StageSettings(n_ctx=1024, cost_curve=MEMORY_BOUND)) as pipeline:
        stats = assert_unchanged(pipeline, tokenizer, make, prompts=(OPEN,), corrects=True,
                                 plain=lambda prompt, sampling: plain[sampling])
    assert all(s.drafted_tokens > 0 for s in stats)
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)
    asynchronous = stats[1::2]  # greedy and sampled
    assert all(s.corrected_windows > 0 for s in asynchronous), [s.corrected_windows for s in asynchronous]
