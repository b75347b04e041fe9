"""Logprobs through the service on the real model (stage engines in this
process): with speculation, every committed token's log-probability and
top alternatives equal llama-cpp-python's own (Llama.logits_to_logprobs of
its logits for the same text, logits_all), to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.service import Service, ServiceRequest, ServiceSettings
from orchestrator.in_process import InProcessPipeline
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

from test_service_exact import COPY

TOP = 5


@pytest.fixture(scope="module")
def own_logprobs(smollm2):
    """llama-cpp-python's logprobs of the token at each position of a text (rows for positions 1..)."""
    import llama_cpp

    llama = llama_cpp.Llama(smollm2, n_ctx=512, logits_all=True, verbose=False)

    def logprobs(tokens: list[int]) -> np.ndarray:
        llama.reset()
        llama.eval(tokens)
        return np.array([llama_cpp.Llama.logits_to_logprobs(llama.scores[position])
                         for position in range(len(tokens) - 1)])
    yield logprobs
    llama.close()


def served(splits, requests, **settings):
    """Each request's (tokens, logprobs entries in order)."""
    chain = InProcessPipeline(splits[2], StageSettings(n_ctx=512, n_batch=64, sequences=2))
    service = Service(chain, lambda token: False, ServiceSettings(max_sequences=2, queue_limit=4, context=512,
                                                                  **settings))
    results = [([], []) for _ in requests]
    import threading

    ended = [threading.Event() for _ in requests]

    def sink(index):
        def collect(progress):
            results[index][0].extend(progress.tokens)
            if progress.logprobs is not None:
                results[index][1].append(progress.logprobs)
            if progress.finished is not None:
                ended[index].set()
        return collect
    try:
        for index, request in enumerate(requests):
            service.submit(request, sink(index))
        assert all(event.wait(timeout=300) for event in ended)
    finally:
        service.close(drain_seconds=5)
        chain.close()
    return results


def test_every_committed_tokens_logprobs_are_llama_cpp_pythons_own(splits, reference, own_logprobs):
    prompt = reference.tokenize(COPY)
    requests = [ServiceRequest(prompt, 24, SamplingSettings(), logprobs=TOP),
                ServiceRequest(prompt, 24, SamplingSettings(temperature=0.9, seed=4), logprobs=TOP)]
    results = served(splits, requests, speculator=lambda sequence: PromptLookupSpeculator(), draft_max=6,
                     schedule=Schedule.ASYNC, stage_count=2)
    assert any(len(entry.logprobs) > 1 for entry in results[0][1])  # greedy windows committed several tokens
    for request, (tokens, entries) in zip(requests, results):
        assert len(tokens) == 24
        chosen = np.concatenate([entry.logprobs for entry in entries])
        top_tokens = np.concatenate([entry.top_tokens for entry in entries])
        top_logprobs = np.concatenate([entry.top_logprobs for entry in entries])
        expected = own_logprobs(prompt + tokens)[len(prompt) - 1:]
        assert len(chosen) == len(tokens) == len(expected)
        np.testing.assert_allclose(chosen, expected[np.arange(len(tokens)), tokens], rtol=0, atol=2e-6)
        np.testing.assert_allclose(top_logprobs, np.sort(expected, axis=-1)[:, ::-1][:, :TOP], rtol=0, atol=2e-6)
        assert np.array_equal(np.take_along_axis(expected, top_tokens.astype(np.int64), axis=-1), top_logprobs)
        assert np.all(top_logprobs[:, :-1] >= top_logprobs[:, 1:])


def test_no_logprobs_travel_unless_asked(splits, reference):
    [(tokens, entries)] = served(splits, [ServiceRequest(reference.tokenize(COPY), 8, SamplingSettings())])
    assert len(tokens) == 8 and entries == []
