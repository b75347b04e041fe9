"""The decoding loop on the real model without Ray: the stage engines one after
another in this process (tests/fakes.py EngineChain), drafters called in place.
Every schedule gives the whole model's tokens, greedy and sampled alike."""

import pytest

from fakes import EngineChain
from orchestrator.interfaces import InstantDrafter
from orchestrator.generate import Drafting, generate
from orchestrator.schedule import Schedule
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

from conftest import PROMPTS

pytestmark = pytest.mark.model

COPY = "Repeat this sentence exactly: the old keeper climbed the stairs every night and lit the lamp. " * 2


@pytest.fixture(scope="module")
def is_end(reference):
    import llama_cpp

    return lambda token: bool(llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token))


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def chain(request, splits):
    engines = EngineChain(splits[request.param], StageSettings(n_ctx=1024))
    yield engines
    engines.close()


@pytest.mark.parametrize("schedule", [Schedule.SYNC, Schedule.ASYNC])
def test_every_schedule_gives_the_whole_models_greedy_tokens(chain, reference, is_end, schedule):
    stage_count = len(chain.engines)
    for prompt in (COPY, PROMPTS[1]):
        tokens = reference.tokenize(prompt)
        expected = reference.greedy(tokens, 32).tokens
        drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in range(stage_count)], schedule, 6)
        assert generate(chain, tokens, 32, SamplingSettings(), is_end, drafting=drafting).tokens == expected, prompt


def test_seeded_sampling_is_the_same_with_and_without_speculation(chain, reference):
    tokens = reference.tokenize(COPY)
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=3)
    plain = generate(chain, tokens, 32, sampling, lambda token: False).tokens
    drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in chain.engines], Schedule.ASYNC, 6)
    speculative = generate(chain, tokens, 32, sampling, lambda token: False, drafting=drafting)
    assert speculative.tokens == plain and speculative.speculation.accepted_tokens > 0
    greedy = generate(chain, tokens, 32, SamplingSettings(), lambda token: False).tokens
    assert plain != greedy  # the temperature really changed the draw


LONG_PROMPT = COPY * 3 + PROMPTS[2]
SMALL_BATCH = 16


@pytest.fixture(scope="module")
def small_batch_chain(splits):
    """Two stages that take at most SMALL_BATCH tokens a pass: a long prompt is prefilled in chunks."""
    engines = EngineChain(splits[2], StageSettings(n_ctx=1024, n_batch=SMALL_BATCH))
    yield engines
    engines.close()


@pytest.mark.parametrize("schedule", [None, Schedule.SYNC, Schedule.ASYNC], ids=["plain", "sync", "async"])
def test_a_prompt_of_several_batches_gives_the_whole_models_greedy_tokens(small_batch_chain, reference, is_end,
                                                                          schedule):
    tokens = reference.tokenize(LONG_PROMPT)
    assert len(tokens) > 5 * SMALL_BATCH  # chunked prefill: six chunks or more
    expected = reference.greedy(tokens, 24).tokens
    drafting = None if schedule is None else Drafting(
        [InstantDrafter(PromptLookupSpeculator(), 6) for _ in small_batch_chain.engines], schedule, 6,
        call_cost=0.0)  # drafters in this process: asking costs nothing, so the policy keeps asking
    result = generate(small_batch_chain, tokens, 24, SamplingSettings(), is_end, drafting=drafting)
    assert result.tokens == expected
    if schedule is not None:
        assert result.speculation.accepted_tokens > 0  # the drafts were verified against the chunked cache


def test_a_prompt_of_several_batches_samples_the_same_tokens_with_and_without_speculation(small_batch_chain, reference):
    tokens = reference.tokenize(LONG_PROMPT)
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=4)
    plain = generate(small_batch_chain, tokens, 24, sampling, lambda token: False).tokens
    drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in small_batch_chain.engines],
                        Schedule.ASYNC, 6)
    assert generate(small_batch_chain, tokens, 24, sampling, lambda token: False, drafting=drafting).tokens == plain
