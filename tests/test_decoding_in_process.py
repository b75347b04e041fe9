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
