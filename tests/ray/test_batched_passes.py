"""Passes shared by several requests (continuous batching, schedule.Batching)
through the real pipeline: two stage actors on the session's cluster, the
socket chain, each batched pass one llama.cpp call per stage
(StageBatch.more). The service prices passes as flat (step 0, the regime of
the machines a huge model runs on) so that requests share passes here too.
Every request gets the tokens it gets alone; a cancelled request frees its
KV in every stage; a stage killed while batched passes are in flight is
restarted and replayed without changing a token."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from orchestrator.cluster.pipeline import Pipeline
from orchestrator.decoding.service import Progress, Service, ServiceRequest, ServiceSettings
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

from conftest import PROMPTS

SEQUENCES = 8
WORK = [(PROMPTS[0], 12), (PROMPTS[1], 30), (PROMPTS[2], 20), ("Q: What is 2 + 2?\nA:", 8),
        ("List three colours:", 24), ("import numpy as np\n", 16), ("Say hello.", 10)]
SEEDED = SamplingSettings(temperature=0.8, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def pipeline(ray_cluster, splits):
    from stages.tokenizer import Tokenizer

    with Pipeline(splits[2], StageSettings(n_ctx=512, sequences=SEQUENCES), overlapping=True) as running:
        running.is_end = Tokenizer(splits[2][0]).is_end
        yield running


@pytest.fixture(scope="module")
def requests(reference) -> list[tuple[ServiceRequest, list[int]]]:
    """Seven greedy requests with the whole model's tokens, and a seeded one with its tokens alone (filled in)."""
    work = [ServiceRequest(reference.tokenize(prompt), tokens, SamplingSettings()) for prompt, tokens in WORK]
    return [(request, reference.greedy(request.prompt_tokens, request.max_tokens).tokens) for request in work]


class Collected:
    """Each request's tokens and how it ended, as its sink hears them."""

    def __init__(self, count: int, on_tokens=None):
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.finished: list[str | None] = [None] * count
        self.ended = [threading.Event() for _ in range(count)]
        self.on_tokens = on_tokens

    def sink(self, index: int):
        def collect(progress: Progress) -> None:
            self.tokens[index].extend(progress.tokens)
            if self.on_tokens is not None:
                self.on_tokens(index, self.tokens[index])
            if progress.finished is not None:
                self.finished[index] = progress.finished
                self.ended[index].set()
        return collect

    def wait(self) -> None:
        for event in self.ended:
            assert event.wait(timeout=300)


def serve(pipeline, requests: list[ServiceRequest], *, speculator=None, on_tokens=None,
          cancel: tuple[int, int] | None = None) -> Collected:
    """Every request at once through a service that batches (flat pass cost);
    cancel: (request, after this many tokens)."""
    service = Service(pipeline, pipeline.is_end, ServiceSettings(
        max_sequences=SEQUENCES, queue_limit=0, context=512, speculator=speculator, draft_max=4,
        stage_count=pipeline.stage_count, batch_step=0.0))
    tickets: list[int] = []

    def heard(index, tokens):
        if on_tokens is not None:
            on_tokens(index, tokens)
        if cancel is not None and index == cancel[0] and len(tokens) >= cancel[1]:
            service.cancel(tickets[index])

    collected = Collected(len(requests), heard)
    try:
        for index, request in enumerate(requests):
            tickets.append(service.submit(request, collected.sink(index)))
        collected.wait()
    finally:
        service.close(drain_seconds=5)
    return collected


def loads(pipeline):
    import ray

    return ray.get(pipeline.load_calls(), timeout=60)


def settled_loads(pipeline, seconds: float = 30):
    """Each stage's load once none holds KV cells (or the last seen): the releases travel
    the chain after the service stops, so the last stage may still be taking them."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        found = loads(pipeline)
        if all(load.kv_cells == 0 for load in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.parametrize("drafting", ["plain", "ngram"])
def test_requests_sharing_passes_each_get_their_solo_tokens(pipeline, requests, drafting):
    speculator = None if drafting == "plain" else (lambda sequence: PromptLookupSpeculator())
    seeded = ServiceRequest(requests[2][0].prompt_tokens, 20, SEEDED)
    (alone,) = serve(pipeline, [seeded]).tokens
    before = [(load.passes, load.windows) for load in loads(pipeline)]
    collected = serve(pipeline, [request for request, _ in requests] + [seeded], speculator=speculator)
    assert collected.tokens[:-1] == [expected for _, expected in requests]
    assert collected.tokens[-1] == alone
    after = settled_loads(pipeline)
    for (passes, windows), load in zip(before, after):
        assert load.windows - windows > load.passes - passes  # passes carried several requests' windows
    assert [(load.kv_cells, load.sequences) for load in after] == [(0, 0), (0, 0)]


def test_a_request_cancelled_mid_batch_frees_its_kv_in_every_stage(pipeline, requests):
    collected = serve(pipeline, [request for request, _ in requests], cancel=(1, 5))
    assert collected.finished[1] == "cancelled"
    assert collected.tokens[1] == requests[1][1][:len(collected.tokens[1])]
    others = [index for index in range(len(requests)) if index != 1]
    assert [collected.tokens[index] for index in others] == [requests[index][1] for index in others]
    assert [(load.kv_cells, load.sequences) for load in settled_loads(pipeline)] == [(0, 0), (0, 0)]


def test_a_stage_killed_while_batched_passes_are_in_flight_changes_no_token(pipeline, requests):
    restarts = len(pipeline.restarts)
    killed = threading.Event()

    def kill_once(index, tokens):
        if len(tokens) >= 6 and not killed.is_set():
            killed.set()
            os.kill(pipeline.stages[1].process_id, signal.SIGKILL)

    collected = serve(pipeline, [request for request, _ in requests], on_tokens=kill_once)
    assert killed.is_set() and len(pipeline.restarts) == restarts + 1
    assert collected.tokens == [expected for _, expected in requests]
