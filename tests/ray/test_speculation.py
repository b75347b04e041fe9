"""Speculative decoding on the real model, through Ray: output never changes.

SmolLM2 has no smaller sibling, so it drafts for itself (acceptance near 100 %:
a check of the machinery), and a copy requantized to Q4_0 drafts with
realistic agreement (benchmarks.drafts: accepted and rejected within one
generation). Scripted drafters are wrong at chosen positions or fail on
purpose (tests/fakes.py)."""

import functools
import os
import re
import signal
import threading

import pytest

import fakes
from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.cluster.pipeline import Pipeline
from speculators.sampling import SamplingSettings
from stages.tokenizer import Tokenizer
from speculators.model import ModelSpeculator
from speculators.prompt_lookup import PromptLookupSpeculator
from stages.settings import StageSettings

REWRITE = (
    "Repeat this sentence exactly: The old lighthouse keeper climbed the narrow stairs every night "
    "and lit the great lamp for the passing ships."
)
OPEN = "Tell me about the moon."
SAMPLING = SamplingSettings(temperature=0.8, top_p=0.95, seed=8)  # a draw that copies the rewrite for a while
GREEDY = SamplingSettings()
MAX_TOKENS = 40


@pytest.fixture(scope="module", autouse=True)
def pickle_doubles_by_value():
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(fakes)


@pytest.fixture(scope="module")
def pipelines(ray_cluster, splits):
    opened = {count: Pipeline(splits[count], StageSettings(n_ctx=1024)) for count in (2, 3)}
    yield opened
    for pipeline in opened.values():
        pipeline.close()


@pytest.fixture(scope="module")
def tokenizer(splits):
    return Tokenizer(splits[2][0])


def decode(pipeline, tokenizer, prompt, sampling, drafters=None, schedule="sync", draft_max=6, corrects=False):
    drafting = Drafting(drafters, Schedule(schedule), draft_max, corrects=corrects) if drafters else None
    tokens = tokenizer.chat_prompt(prompt)
    return generate(pipeline, tokens, MAX_TOKENS, sampling, tokenizer.is_end, drafting=drafting)


@pytest.fixture(scope="module")
def plain(pipelines, tokenizer):
    """plain(prompt, sampling): the plain pipeline's tokens, decoded once a module. Two stages
    give what three do (the stages compute the whole model's logits bit for bit, and a seeded
    draw depends only on them and its position), so the 2-stage pipeline decodes them."""
    made = {}

    def tokens(prompt: str, sampling: SamplingSettings) -> list[int]:
        if (prompt, sampling) not in made:
            made[prompt, sampling] = decode(pipelines[2], tokenizer, prompt, sampling).tokens
        return made[prompt, sampling]

    return tokens


def assert_unchanged(pipeline, tokenizer, make_speculator, prompts=(REWRITE, OPEN), schedules=("sync", "async"),
                     corrects=False, plain=None):
    """Every schedule, greedy and sampled, gives the plain pipeline's tokens. Returns the stats.
    corrects: async drafters draft corrections too (speculators.corrections). plain: the plain
    tokens of (prompt, sampling) (default: decoded on this pipeline)."""
    plain = plain or (lambda prompt, sampling: decode(pipeline, tokenizer, prompt, sampling).tokens)
    drafters = start_drafters(pipeline, make_speculator, DrafterSettings(draft_max=6))
    stats = []
    try:
        assert all(drafter.alive for drafter in drafters)
        for prompt in prompts:
            for sampling in (GREEDY, SAMPLING):
                expected = plain(prompt, sampling)
                for schedule in schedules:
                    speculative = decode(pipeline, tokenizer, prompt, sampling, drafters, schedule, corrects=corrects)
                    assert speculative.tokens == expected, (prompt, sampling, schedule)
                    stats.append(speculative.speculation)
    finally:
        stop_drafters(drafters)
    return stats


def test_prompt_lookup_never_changes_the_output(pipelines, tokenizer, plain):
    """Through three stages (two: the draft models' tests below; every stage's
    rollback, two and three: test_partial_acceptance_rolls_every_stage_back)."""
    stats = assert_unchanged(pipelines[3], tokenizer, PromptLookupSpeculator, plain=plain)
    assert sum(s.accepted_tokens for s in stats) > 20  # the rewrite prompt is copied


def test_model_as_its_own_draft_is_accepted_and_exact(pipelines, tokenizer, smollm2, plain):
    make = functools.partial(ModelSpeculator, smollm2, n_ctx=1024)
    stats = assert_unchanged(pipelines[2], tokenizer, make, prompts=(OPEN,), plain=plain)
    greedy = stats[:2]  # greedy runs: a model drafting for itself agrees with itself
    assert all(s.drafted_tokens > 0 and s.acceptance_rate == 1.0 for s in greedy)


@pytest.mark.parametrize("stage_count", [2, 3])
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_partial_acceptance_rolls_every_stage_back(pipelines, tokenizer, plain, stage_count, schedule):
    """Drafts right except at chosen positions: passes commit 2..5 tokens, and the
    rejected tail must be dropped from every stage's KV cache, or later tokens differ."""
    pipeline = pipelines[stage_count]
    prompt_tokens = tokenizer.chat_prompt(OPEN)
    expected = plain(OPEN, GREEDY)
    truth = prompt_tokens + expected
    wrong = {len(prompt_tokens) + offset for offset in (3, 7, 8, 15, 22, 30)}
    drafters = start_drafters(
        pipeline, functools.partial(fakes.ScriptedSpeculator, truth, wrong), DrafterSettings(draft_max=6)
    )
    cancelled_before = cancelled_passes(pipeline)
    try:
        result = decode(pipeline, tokenizer, OPEN, GREEDY, drafters, schedule)
    finally:
        stop_drafters(drafters)
    assert result.tokens == expected
    lengths = result.speculation.accepted_lengths
    assert any(1 < length < 7 for length in lengths), lengths
    assert result.speculation.accepted_tokens < result.speculation.drafted_tokens
    if schedule == "async":  # passes started ahead on a failed speculation were thrown away
        assert result.speculation.discarded_passes > 0
        # and cancelled: dropped by stages they had not reached, or stopped mid-graph
        assert 0 < cancelled_passes(pipeline) - cancelled_before <= result.speculation.discarded_passes * stage_count
    else:
        assert cancelled_passes(pipeline) == cancelled_before


def cancelled_passes(pipeline) -> int:
    """Passes the stages dropped or stopped since they started."""
    return sum(report.dropped_passes + report.stopped_passes for report in pipeline.reports())


@pytest.mark.parametrize(
    "double",
    [
        functools.partial(fakes.RaisingSpeculator, good_calls=5),
        functools.partial(fakes.HangingSpeculator, good_calls=5),
    ],
    ids=["raises", "hangs"],
)
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_failing_drafter_changes_nothing(pipelines, tokenizer, plain, double, schedule):
    import ray

    pipeline = pipelines[2]
    prompt_tokens = tokenizer.chat_prompt(OPEN)
    expected = plain(OPEN, GREEDY)
    drafters = start_drafters(pipeline, functools.partial(double, prompt_tokens + expected),
                              DrafterSettings(draft_max=6, wait_seconds=0.5))
    try:
        result = decode(pipeline, tokenizer, OPEN, GREEDY, drafters, schedule)
        # each drafter's speculator, in its own process: how often it was called
        calls = [ray.get(drafter.actor.__ray_call__.remote(lambda actor: actor.server.speculator.calls), timeout=60)
                 for drafter in drafters]
        alive = [drafter.alive for drafter in drafters]
    finally:
        stop_drafters(drafters)
    assert result.tokens == expected
    assert max(calls) > 5, calls  # a speculator was called past its 5 good calls: it failed
    assert result.speculation.drafted_tokens <= 5 * len(drafters)  # and nothing was drafted after
    assert all(alive), [drafter.lost_reason for drafter in drafters]  # a failing speculator does not lose its drafter
    if double.func is fakes.RaisingSpeculator:
        assert "RuntimeError: drafter exploded on purpose" in {drafter.last_error for drafter in drafters}


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_drafter_killed_mid_generation_is_restarted_rejoins_and_changes_nothing(pipelines, tokenizer, plain,
                                                                                   schedule):
    """The first drafter's process (it drafts in both schedules) killed
    mid-generation under prompt lookup: SIGKILL in sync, SIGSEGV in async
    (as a crash in llama.cpp would end it). It is restarted in the background
    and rejoins; the output is the plain run's throughout; the reason it was
    lost names its worker log, and the segmentation fault found there."""
    from speculators.prompt_lookup import PromptLookupSpeculator

    pipeline = pipelines[2]
    prompt_tokens = tokenizer.chat_prompt(REWRITE)  # a copy task: prompt lookup drafts well
    expected = plain(REWRITE, GREEDY)
    drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=4))
    killed = threading.Event()

    def kill_after_some_tokens(token):
        produced.append(token)
        if len(produced) == 8:
            crashed.append(drafters[0].process_id)
            os.kill(crashed[0], signal.SIGKILL if schedule == "sync" else signal.SIGSEGV)
            killed.set()
        elif killed.is_set() and not drafters[0].alive and drafters[0].restarts == 0:
            # the loss shows at the drafter's next request; wait for its restart (on the state, not the clock)
            assert drafters[0].replacement_ready.wait(120), drafters[0].lost_reason

    produced: list[int] = []
    crashed: list[int] = []
    try:
        # asking costs the policy nothing here, so it keeps asking after the loss (the empty
        # replies of a dead drafter would otherwise stop it asking, and the rejoin comes at an ask)
        drafting = Drafting(drafters, Schedule(schedule), 4, call_cost=0.0)
        result = generate(
            pipeline, prompt_tokens, MAX_TOKENS, GREEDY, tokenizer.is_end, drafting=drafting,
            on_token=kill_after_some_tokens,
        )
        back = drafters[0].alive
    finally:
        stop_drafters(drafters)
    assert killed.is_set()
    assert result.tokens == expected
    assert [drafter.restarts for drafter in drafters] == [1, 0]
    assert drafters[0].lost_reason and back  # the loss is reported, and the drafter is back
    fatal = "" if schedule == "sync" else r" \(Fatal Python error: Segmentation fault\)"
    assert re.search(rf"its log: \S+-{crashed[0]}\.err{fatal}", drafters[0].lost_reason), drafters[0].lost_reason
    assert result.speculation.accepted_tokens > 0

