"""Many requests at once through the real model (stage engines in this process,
orchestrator.in_process.InProcessPipeline, 8 KV sequences): each request's greedy tokens are
llama-cpp-python's on the whole model, and a seeded sampled request gets the
same tokens alone as beside seven others."""

from __future__ import annotations

import threading

import pytest

from orchestrator.in_process import InProcessPipeline
from orchestrator.decoding.service import Progress, Service, ServiceRequest, ServiceSettings
from speculators.model import ModelSpeculator, load_draft_engine
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

from conftest import FORKING, PROMPTS

COPY = "Repeat this sentence exactly: the old keeper climbed the stairs every night and lit the lamp. " * 2
LONG = "The harbour log, day by day: the ships came in, the nets were mended, the lamps were lit. " * 14
WORK = [  # (prompt, max_tokens): different lengths, one prompt longer than a batch (n_batch 128 here)
    (PROMPTS[0], 12), (PROMPTS[1], 40), (PROMPTS[2], 25), (COPY, 30),
    ("Q: What is 2 + 2?\nA:", 8), (LONG, 16), ("List three colours:", 33), ("import numpy as np\n", 20),
]


@pytest.fixture(scope="module")
def chain(splits):
    engines = InProcessPipeline(splits[2], StageSettings(n_ctx=1024, n_batch=128, sequences=8))
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def is_end(reference):
    import llama_cpp

    return lambda token: bool(llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token))


def run_all(service: Service, requests: list[ServiceRequest]) -> list[list[int]]:
    """Submit every request at once; each one's tokens when all have ended."""
    results: list[list[int]] = [[] for _ in requests]
    ended = [threading.Event() for _ in requests]

    def sink(index: int):
        def collect(progress: Progress) -> None:
            results[index].extend(progress.tokens)
            if progress.finished is not None:
                assert progress.finished in ("end", "length"), progress
                ended[index].set()
        return collect

    for index, request in enumerate(requests):
        service.submit(request, sink(index))
    for event in ended:
        assert event.wait(timeout=300)
    return results


@pytest.fixture(scope="module")
def greedy_work(reference) -> list[tuple[ServiceRequest, list[int]]]:
    """WORK's requests (greedy) and the whole model's tokens for each."""
    requests = [ServiceRequest(reference.tokenize(prompt), max_tokens, SamplingSettings()) for prompt, max_tokens in WORK]
    return [(request, reference.greedy(request.prompt_tokens, request.max_tokens).tokens) for request in requests]


@pytest.mark.parametrize("drafting", ["plain", "model"])
def test_eight_requests_at_once_each_get_the_whole_models_tokens(chain, greedy_work, is_end, smollm2, drafting):
    """A draft model drafts for each request in its own KV sequence of one shared
    draft engine (SmolLM2 drafting for itself: exact, not fast). Prompt lookup:
    test_serve_drafts_with_prompt_lookup_sync_and_async_... (the same requests)."""
    requests = [request for request, _ in greedy_work]
    draft_engine = load_draft_engine(smollm2, n_ctx=1024, sequences=8) if drafting == "model" else None
    speculator = {"plain": None, "model": lambda sequence: ModelSpeculator.on(draft_engine, sequence)}[drafting]
    assert len(requests[5].prompt_tokens) > 2 * chain.n_batch  # the long prompt comes in three chunks
    service = Service(chain, is_end, ServiceSettings(max_sequences=8, queue_limit=0, context=1024,
                                                     speculator=speculator, draft_max=6))
    try:
        got = run_all(service, requests)
    finally:
        service.close(drain_seconds=5)
        if draft_engine is not None:
            draft_engine.close()
    assert got == [expected for _, expected in greedy_work]
    assert all(engine.cells_held() == 0 for engine in chain.engines)  # every sequence released


@pytest.mark.parametrize("drafting", ["plain", "ngram"])
def test_batched_passes_give_every_request_its_solo_tokens(chain, greedy_work, reference, is_end, drafting):
    """Continuous batching (schedule.Batching on a flat cost curve, step 0):
    windows of several requests share each pass, one llama.cpp call per
    stage, and every greedy request still gets the whole model's tokens, a
    seeded one the tokens it draws alone, with prompt lookup on and off."""
    speculator = None if drafting == "plain" else (lambda sequence: PromptLookupSpeculator())
    sampled = ServiceRequest(reference.tokenize(COPY), 24, SamplingSettings(temperature=0.8, top_p=0.95, seed=3))
    alone_service = Service(chain, is_end, ServiceSettings(max_sequences=8, queue_limit=0, context=1024))
    try:
        (alone,) = run_all(alone_service, [sampled])
    finally:
        alone_service.close(drain_seconds=5)
    watched = Watched(chain)
    service = Service(watched, is_end, ServiceSettings(max_sequences=8, queue_limit=0, context=1024,
                                                       speculator=speculator, draft_max=4, stage_count=2,
                                                       batch_step=0.0))
    requests = [request for request, _ in greedy_work[:7]] + [sampled]
    try:
        got = run_all(service, requests)
    finally:
        service.close(drain_seconds=5)
    assert got[:7] == [expected for _, expected in greedy_work[:7]]
    assert got[7] == alone
    assert watched.most_windows_per_pass > 1  # requests really shared passes
    assert all(engine.cells_held() == 0 for engine in chain.engines)


def test_a_seeded_request_samples_the_same_tokens_alone_and_beside_others(chain, reference, is_end):
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=3)
    sampled = ServiceRequest(reference.tokenize(COPY), 32, sampling)
    others = [ServiceRequest(reference.tokenize(prompt), max_tokens, SamplingSettings(temperature=1.0, seed=index))
              for index, (prompt, max_tokens) in enumerate(WORK[:7])]
    settings = ServiceSettings(max_sequences=8, queue_limit=0, context=1024)
    service = Service(chain, lambda token: False, settings)
    try:
        (alone,) = run_all(service, [sampled])
        beside = run_all(service, [*others[:3], sampled, *others[3:]])[3]
    finally:
        service.close(drain_seconds=5)
    assert beside == alone
    assert alone != reference.greedy(sampled.prompt_tokens, 32).tokens  # the temperature really changed the draw


class Watched:
    """A target's passes as submitted: the most decoding windows of one sequence in flight at once (a
    prompt's chunks pipeline in every schedule), and the tree windows."""

    def __init__(self, target):
        self.target = target
        self.n_batch = target.n_batch
        self.stage_count = target.stage_count
        self.in_flight: dict[int, int] = {}
        self.most_in_flight = 0
        self.tree_windows = 0
        self.order: list[list[tuple[int, bool]]] = []
        self.most_windows_per_pass = 0
        self.copies: list[tuple[int, int, int]] = []

    def submit(self, target_pass):
        self.order.append([])
        self.most_windows_per_pass = max(self.most_windows_per_pass, len(target_pass.windows))
        for window in target_pass.windows:
            counted = not window.prompt
            self.in_flight[window.sequence] = self.in_flight.get(window.sequence, 0) + counted
            self.most_in_flight = max(self.most_in_flight, self.in_flight[window.sequence])
            self.tree_windows += window.parents is not None
            self.order[-1].append((window.sequence, counted))
        self.target.submit(target_pass)

    def receive(self):
        for sequence, counted in self.order.pop(0):
            self.in_flight[sequence] -= counted
        return self.target.receive()

    def cancel(self, target_pass):
        self.target.cancel(target_pass)

    def release(self, sequence):
        self.target.release(sequence)

    def copy(self, source, destination, length):
        self.copies.append((source, destination, length))
        self.target.copy(source, destination, length)


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_serve_drafts_with_prompt_lookup_sync_and_async_and_every_request_gets_the_whole_models_tokens(
        chain, greedy_work, is_end, schedule):
    """The service turns orchestrate run's loop: async drafts while passes run
    and starts windows ahead (a sequence with two windows in flight)."""
    from orchestrator.decoding.schedule import Schedule

    watched = Watched(chain)
    service = Service(watched, is_end, ServiceSettings(
        max_sequences=8, queue_limit=0, context=1024, speculator=lambda sequence: PromptLookupSpeculator(),
        draft_max=6, schedule=Schedule(schedule), stage_count=len(chain.engines)))
    try:
        got = run_all(service, [request for request, _ in greedy_work])
    finally:
        service.close(drain_seconds=5)
    assert got == [expected for _, expected in greedy_work]
    assert (watched.most_in_flight > 1) == (schedule == "async")  # windows started ahead only in async
    assert all(engine.cells_held() == 0 for engine in chain.engines)  # every sequence released


@pytest.fixture(scope="module")
def tree_chain(splits):
    engines = InProcessPipeline(splits[2], StageSettings(n_ctx=1024, n_batch=128, sequences=1, tree_sequences=3))
    yield engines
    engines.close()


def test_serve_drafts_token_trees_and_a_request_gets_its_solo_and_whole_model_tokens(tree_chain, reference, is_end):
    """Prompt lookup's trees (every candidate row verified: side_row_step 0),
    async, one sequence: greedy requests get the whole model's tokens, and a
    seeded one the tokens it samples with no drafting at all."""
    from orchestrator.decoding.schedule import Schedule

    settings = ServiceSettings(max_sequences=1, queue_limit=8, context=1024,
                               speculator=lambda sequence: PromptLookupSpeculator(), draft_max=6,
                               schedule=Schedule.ASYNC, stage_count=2, tree_leaves=4, side_row_step=0.0)
    greedy = [ServiceRequest(reference.tokenize(prompt), 40, SamplingSettings()) for prompt in FORKING]
    seeded = ServiceRequest(reference.tokenize(FORKING[1]), 32, SamplingSettings(temperature=0.7, seed=11))
    watched = Watched(tree_chain)
    service = Service(watched, is_end, settings)
    try:
        got = run_all(service, [*greedy, seeded])
    finally:
        service.close(drain_seconds=5)
    plain = Service(tree_chain, is_end, ServiceSettings(max_sequences=1, queue_limit=0, context=1024))
    try:
        (seeded_alone,) = run_all(plain, [seeded])
    finally:
        plain.close(drain_seconds=5)
    assert got[:2] == [reference.greedy(request.prompt_tokens, 40).tokens for request in greedy]
    assert got[2] == seeded_alone
    assert watched.tree_windows > 0
