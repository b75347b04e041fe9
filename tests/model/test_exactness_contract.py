"""The exactness contract, as three properties of one recorded run (docs/backends.md).

A decoding run through the stages (the real loop: async prompt lookup and
token trees, stages in this process: orchestrator.in_process.InProcessPipeline)
records every pass; orchestrator.exactness then checks, without the
product's verifier:

* split-exact: the same passes, with the same cache roll-backs, through the
  whole model in one process give the same logits, bit for bit;
* lossless verification: every verified window committed the target's own
  choices (the argmax, or the draw seeded by (seed, position)) from that
  pass's logits;
* batch-invariant (this CPU build): every row of a chain pass has the logits
  of feeding its tokens one at a time.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FORKING
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.targets import InstantDrafter
from orchestrator.exactness import (
    RecordingChain,
    first_batch_difference,
    first_lossless_violation,
    first_split_difference,
    record_run,
    replay,
)
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.engine import StageEngine
from stages.settings import StageSettings

SETTINGS = StageSettings(n_ctx=1024, tree_sequences=3)
MAX_TOKENS = 40


def record(chain: RecordingChain, prompt_tokens: list[int], sampling: SamplingSettings):
    """Decode through ``chain`` with async prompt lookup and trees of up to 4 leaves."""
    drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in chain.engines], Schedule.ASYNC, 6,
                        call_cost=0.0, step=0.0, tree_leaves=4)
    return record_run(chain, prompt_tokens, MAX_TOKENS, sampling, drafting)


@pytest.fixture(scope="module")
def stages(splits):
    chain = RecordingChain(splits[2], SETTINGS)
    yield chain
    chain.close()


@pytest.fixture(scope="module")
def whole(smollm2):
    engine = StageEngine(smollm2, SETTINGS)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["greedy", "seeded"])
def recorded(request, stages, reference):
    """A run on the first forking prompt, greedy or seeded: (sampling, events, committed, verified windows)."""
    # seed 3: a draw whose run has trees and chains (seeds differ in how often lookup matches it)
    sampling = SamplingSettings() if request.param == "greedy" else SamplingSettings(temperature=0.8, top_p=0.95,
                                                                                      seed=3)
    return record(stages, reference.tokenize(FORKING[0]), sampling)


def test_the_run_had_trees_chains_and_discarded_passes(recorded):
    passes = recorded.passes
    assert any(event.parents is not None for event in passes)  # token trees
    assert any(event.parents is None and len(event.rows) > 1 for event in passes)  # speculated chains
    if recorded.sampling == SamplingSettings():  # greedy: async passes started ahead were thrown away
        assert len(passes) > len(recorded.verified)
    assert len(recorded.committed) > MAX_TOKENS


def test_split_exact_the_whole_model_gives_every_recorded_pass_the_same_logits_bit_for_bit(recorded, whole):
    replayed = replay(whole, recorded.events)
    assert len(replayed) == len(recorded.passes)
    assert first_split_difference(recorded.events, replayed) is None


@pytest.mark.parametrize("stage, what", [(1, "one logit by one ulp"),
                                         (0, "the hidden states of the pass's last row by 2**-14 relative")])
def test_the_replay_finds_a_stage_output_changed_in_one_pass(stages, whole, reference, stage, what):
    """A bug that moves a stage's output in one pass is found: the last stage's logits by one
    ulp, directly. The first stage's hidden states reach the logits through 15 more blocks of
    quantized products, which absorb the smallest changes: measured here, every value of a row
    moved by one ulp, or by 2**-20 relative, leaves every logit bit-identical (so no comparison
    of logits could see it); 2**-14 relative changes them."""
    engine, plain_decode = stages.engines[stage], stages.engines[stage].decode
    calls = 0

    def off_by_one_ulp(*args, **kwargs):
        nonlocal calls
        output = plain_decode(*args, **kwargs)
        calls += 1
        if calls == 5:
            if stage == 0:
                output[-1] *= np.float32(1 + 2**-14)
            else:
                output[-1, 7] = np.nextafter(output[-1, 7], np.float32(np.inf))
        return output

    engine.decode = off_by_one_ulp
    try:
        run = record(stages, reference.tokenize(FORKING[1]), SamplingSettings())
    finally:
        del engine.decode
    difference = first_split_difference(run.events, replay(whole, run.events))
    assert difference is not None and difference.startswith("pass 4 "), (what, difference)


def test_lossless_every_verified_window_committed_the_targets_own_choices(recorded):
    assert first_lossless_violation(recorded) is None
    generated = sum((tokens for _, tokens in recorded.verified), [])
    assert len(generated) == MAX_TOKENS and recorded.committed[-MAX_TOKENS:] == generated


def test_lossless_check_finds_a_window_that_committed_another_token(recorded):
    """The check itself: one committed token changed is found."""
    window, tokens = next((window, tokens) for window, tokens in recorded.verified if len(tokens) > 1)
    index = recorded.verified.index((window, tokens))
    recorded.verified[index] = (window, tokens[:-1] + [tokens[-1] + 1])
    try:
        assert first_lossless_violation(recorded).startswith(f"window at {window.first} ")
    finally:
        recorded.verified[index] = (window, tokens)


def test_batch_invariant_every_chain_row_has_the_logits_of_one_token_decoding(recorded, whole):
    """On this CPU build: each speculated chain pass fed again one token at a time (after the same
    roll-backs), row by row, gives the same logits bit for bit."""
    difference, compared = first_batch_difference(whole, recorded.events)
    assert difference is None and compared >= 5
