"""Structured output through the service on the real model (stage engines in
this process, tokens chosen under the grammar as the last stage chooses them):
the reply parses and matches the schema, and speculation, batched passes and
the prefix cache change no token, greedy or seeded."""

from __future__ import annotations

import json

import pytest

from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.service import Service, ServiceRequest, ServiceSettings
from orchestrator.in_process import InProcessPipeline
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.grammar import grammar_of
from stages.settings import StageSettings

from test_grammar import PERSON, PROMPT, schema_format
from test_service_exact import run_all

LIMIT = 80


@pytest.fixture(scope="module")
def chain(splits):
    engines = InProcessPipeline(splits[2], StageSettings(n_ctx=512, n_batch=64, sequences=2, prefix_sequences=2))
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def is_end(reference):
    import llama_cpp

    return lambda token: bool(llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token))


def decoded(chain, is_end, requests, **settings) -> list[list[int]]:
    service = Service(chain, is_end, ServiceSettings(max_sequences=2, queue_limit=4, context=512, **settings))
    try:
        return run_all(service, requests)
    finally:
        service.close(drain_seconds=5)


def test_a_schema_constrained_reply_parses_and_speculation_changes_no_token(chain, reference, is_end):
    prompt = reference.llama.tokenize(PROMPT.encode(), add_bos=False, special=True)
    grammar = grammar_of(schema_format(PERSON))
    requests = [ServiceRequest(prompt, LIMIT, SamplingSettings(), grammar=grammar),
                ServiceRequest(prompt, LIMIT, SamplingSettings(temperature=0.8, seed=9), grammar=grammar)]
    plain = decoded(chain, is_end, requests)
    speculating = decoded(chain, is_end, requests, speculator=lambda sequence: PromptLookupSpeculator(),
                          draft_max=6, schedule=Schedule.ASYNC, stage_count=2, batch_step=0.0,
                          prefix_sequences=2, prefix_tokens=1024)
    assert speculating == plain
    for tokens in plain:
        assert len(tokens) < LIMIT  # ended by an end token: the object was closed
        person = json.loads(reference.llama.detokenize(tokens).decode())
        assert set(person) <= set(PERSON["properties"]) and isinstance(person["name"], str) \
            and isinstance(person["age"], int)
    unconstrained = decoded(chain, is_end, [ServiceRequest(prompt, LIMIT, SamplingSettings())])
    assert unconstrained[0] != plain[0]  # the grammar really constrained the greedy reply


def test_a_window_started_ahead_on_a_speculation_the_grammar_forbids_gets_a_well_formed_answer(reference):
    """The loop discards such a window (the committed text obeys the grammar, so it
    differs from the speculation), but the last stage must answer it, not fail the pipeline."""
    import llama_cpp
    import numpy as np

    from orchestrator.transport.messages import TokenChoice
    from orchestrator.workers.token_chooser import TokenChooser

    chooser = TokenChooser(llama_cpp.llama_model_get_vocab(reference.llama.model))
    forbidden = reference.llama.tokenize(b"hello", add_bos=False)  # a JSON object cannot begin so
    rows = np.zeros((2, reference.llama.n_vocab()), np.float32)
    choice = TokenChoice(np.array([5], np.int32), 10, SamplingSettings(), None, 0,
                         grammar_of({"type": "json_object"}), np.array(forbidden, np.int32))
    tokens, logprobs = chooser.choose(0, choice, rows)
    assert 1 <= len(tokens) <= 2 and len(logprobs.logprobs) == len(tokens)
