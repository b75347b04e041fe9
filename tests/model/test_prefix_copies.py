"""Prefixes copied between KV sequences, on the real model (stage engines in
this process): a copied prefix computes on bit for bit as a prefilled one, so
a request that reuses a finished one's prefix (a chat's second turn), waits
for a running one's (a shared system prompt), or shares its prompt among
its choices (n > 1) gets the tokens it gets with the cache off: greedy and
seeded, with prompt lookup and batched passes."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.service import Service, ServiceObserver, ServiceRequest, ServiceSettings
from orchestrator.in_process import InProcessPipeline
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.engine import StageEngine
from stages.settings import StageSettings

from test_service_exact import Watched, run_all

SYSTEM = ("You are the harbour master's assistant. Answer in one short sentence, name the ship, "
          "and never invent a berth that is not on the list: north quay, south quay, the old pier. ") * 4
QUESTIONS = ["Question: Where does the Mary Rose dock?", "Question: Which berth is free at noon?",
             "Question: Is the old pier open?", "Question: Who keeps the lamp?"]
SERVED, KEPT = 4, 4  # served sequences, prefix sequences


@pytest.fixture(scope="module")
def chain(splits):
    engines = InProcessPipeline(splits[2], StageSettings(n_ctx=1024, n_batch=128, sequences=SERVED,
                                                   prefix_sequences=KEPT))
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def is_end():
    """No token ends a request: the base model often ends these prompts at once, and every test
    compares whole runs of max_tokens (the service with the cache off is checked against the
    whole model by test_service_exact)."""
    return lambda token: False


class Queries(ServiceObserver):
    def __init__(self):
        self.reused: list[int] = []

    def prefix_query(self, prompt_tokens: int, reused: int) -> None:
        self.reused.append(reused)


def serve(chain, is_end, requests, *, cache: bool, **settings):
    """Each request's tokens (all submitted at once), the copies made, and each sequence's reused tokens."""
    watched, queries = Watched(chain), Queries()
    service = Service(watched, is_end, ServiceSettings(
        max_sequences=SERVED, queue_limit=8, context=1024, prefix_sequences=KEPT if cache else 0,
        prefix_tokens=KEPT * 1024 if cache else 0, **settings), observer=queries)
    try:
        got = run_all(service, requests)
    finally:
        service.close(drain_seconds=5)
    return got, watched.copies, queries.reused


def test_a_copied_prefix_computes_on_bit_for_bit_as_a_prefilled_one(smollm2):
    engine = StageEngine(smollm2, StageSettings(n_ctx=512, sequences=3))
    try:
        prompt = np.random.default_rng(0).integers(100, 40000, 300).astype(np.int32)
        engine.decode(np.arange(200, dtype=np.int32), tokens=prompt[:200], sequence=0)
        engine.decode(np.arange(200, 206, dtype=np.int32), tokens=prompt[:6], sequence=0)  # a rejected window
        engine.copy(0, 1, 180)
        assert engine.cached_positions(1) == 180
        copied = engine.decode(np.arange(180, 300, dtype=np.int32), tokens=prompt[180:], sequence=1,
                               logit_rows=np.arange(120, dtype=np.int32))
        prefilled = engine.decode(np.arange(300, dtype=np.int32), tokens=prompt, sequence=2,
                                  logit_rows=np.arange(180, 300, dtype=np.int32))
        assert np.array_equal(copied, prefilled)
        assert engine.cached_positions(0) == 206  # the source is left as it was
    finally:
        engine.close()


def test_a_chats_second_turn_copies_the_first_and_gets_the_whole_models_tokens(chain, reference, is_end):
    first = ServiceRequest(reference.tokenize(SYSTEM + QUESTIONS[0]), 20, SamplingSettings())
    (answer,), _, _ = serve(chain, is_end, [first], cache=False)
    second_prompt = first.prompt_tokens + answer + reference.tokenize(" And " + QUESTIONS[1])
    second = ServiceRequest(second_prompt, 16, SamplingSettings())
    watched, queries = Watched(chain), Queries()
    service = Service(watched, is_end, ServiceSettings(max_sequences=SERVED, queue_limit=8, context=1024,
                                                       prefix_sequences=KEPT, prefix_tokens=KEPT * 1024),
                      observer=queries)
    try:
        run_all(service, [first])
        (got,) = run_all(service, [second])
    finally:
        service.close(drain_seconds=5)
    (alone,), no_copies, _ = serve(chain, is_end, [second], cache=False)
    assert queries.reused[0] == 0 and queries.reused[1] >= len(first.prompt_tokens)
    assert got == alone and no_copies == []
    assert all(engine.cells_held() == 0 for engine in chain.engines)  # served sequences released
    assert all(engine.prefix_cells() > 0 for engine in chain.engines)  # the turns are kept


def test_requests_sharing_a_system_prompt_wait_for_its_prefill_and_get_their_tokens(chain, reference, is_end):
    """Submitted at once: one prefills the system prompt, the others wait for it
    and copy it; every one gets the tokens it gets with the cache off, greedy
    and seeded, with prompt lookup (async: windows ahead) and batched passes."""
    settings = dict(speculator=lambda sequence: PromptLookupSpeculator(), draft_max=4, schedule=Schedule.ASYNC,
                    stage_count=2, batch_step=0.0)
    requests = [ServiceRequest(reference.tokenize(SYSTEM + question), 12, SamplingSettings())
                for question in QUESTIONS[:3]]
    requests.append(ServiceRequest(reference.tokenize(SYSTEM + QUESTIONS[3]), 12,
                                   SamplingSettings(temperature=0.9, top_p=0.95, seed=7)))
    without, no_copies, _ = serve(chain, is_end, requests, cache=False, **settings)
    with_cache, copies, reused = serve(chain, is_end, requests, cache=True, **settings)
    assert no_copies == []
    assert with_cache == without
    assert all(len(tokens) == 12 for tokens in with_cache)
    shared = len(reference.tokenize(SYSTEM)) - 2
    assert sorted(reused)[1:] >= [shared] * 3  # all but the first copied (about) the system prompt


def choices_of(service: Service, request: ServiceRequest) -> dict[int, list[int]]:
    """Each choice's tokens, once every choice has ended."""
    tokens: dict[int, list[int]] = {}
    ended, all_ended = [], threading.Event()

    def sink(progress):
        tokens.setdefault(progress.choice, []).extend(progress.tokens)
        if progress.finished is not None:
            ended.append(progress.choice)
            if len(ended) == request.choices:
                all_ended.set()
    service.submit(request, sink)
    assert all_ended.wait(timeout=300)
    return tokens


def test_n_choices_prefill_the_prompt_once_and_draw_apart(chain, reference, is_end):
    prompt = reference.tokenize(SYSTEM + QUESTIONS[0])
    request = ServiceRequest(prompt, 10, SamplingSettings(temperature=1.0, seed=5), choices=4)
    (single,), _, _ = serve(chain, is_end, [replace(request, choices=1)], cache=False)
    watched = Watched(chain)
    service = Service(watched, is_end, ServiceSettings(max_sequences=SERVED, queue_limit=8, context=1024))
    try:
        first, again = choices_of(service, request), choices_of(service, request)
    finally:
        service.close(drain_seconds=5)
    assert first[0] == single  # choice 0 draws as the request with n = 1
    assert len({tuple(tokens) for tokens in first.values()}) == 4  # each choice draws with its own seed
    assert again == first  # and reproducibly
    # the prompt is prefilled once per request and copied to the other three choices
    assert [length for _, _, length in watched.copies] == [len(prompt) - 1] * 6
