"""The service's loop (orchestrator.decoding.service) over a stand-in target: many
requests at once, each getting what it gets alone; queue, cancel, shutdown and
a failing target. Pure: the target is a small deterministic "model" with a
KV cache per sequence (``CountingModel``), no llama.cpp, no Ray."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from orchestrator.transport.messages import PassResult
from orchestrator.decoding.windows import TargetPass
from orchestrator.decoding.service import (
    Progress, QueueFull, RequestTooLong, Service, ServiceError, ServiceRequest, ServiceSettings, ShuttingDown,
    Unavailable,
)
from orchestrator.decoding.targets import TargetWaiting
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings

VOCAB = 40
END = 0


def next_token(history: list[int]) -> int:
    """The stand-in model: the next token depends on every token before it.
    It repeats itself often (prompt lookup finds drafts) and ends now and then."""
    value = (sum(history) * 7 + len(history) * 3 + history[-1]) % 97
    return END if value == 13 else value % (VOCAB - 1) + 1


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    text = list(prompt)
    while len(text) - len(prompt) < max_tokens:
        token = next_token(text)
        if token == END:
            break
        text.append(token)
    return text[len(prompt):]


class CountingModel:
    """A target with a KV cache per sequence, as the stages keep it: a window
    at ``first`` drops the sequence's positions >= first; ``release`` drops all.
    Row r of a window predicts next_token(cache up to that row). ``gate``:
    when set, each receive waits for a permit (the test paces the passes)."""

    n_batch = 5  # small: prompts come in several chunks
    stage_count = 1

    def __init__(self, gated: bool = False):
        self.cache: dict[int, list[int]] = {}
        self.pending: list[np.ndarray] = []
        self.passes: list[TargetPass] = []
        self.released: list[int] = []
        self.copies: list[tuple[int, int, int]] = []
        self.gate = threading.Semaphore(0) if gated else None
        self.fail_after: int | None = None

    def submit(self, target_pass: TargetPass) -> None:
        self.passes.append(target_pass)
        rows = []
        for window in target_pass.windows:
            cache = self.cache.setdefault(window.sequence, [])
            assert len(cache) >= window.first, "a window past the sequence's cache: a chunk or pass was lost"
            del cache[window.first:]
            cache.extend(window.inputs)
            for row in window.logit_rows:
                logits = np.zeros(VOCAB, np.float32)
                logits[next_token(cache[: window.first + row + 1])] = 1.0
                rows.append(logits)
        self.pending.append(np.array(rows, np.float32).reshape(len(rows), VOCAB))

    def cancel(self, target_pass: TargetPass) -> None:
        """Nothing to stop: the pass was computed when submitted."""

    def receive(self) -> PassResult:
        if self.gate is not None:
            assert self.gate.acquire(timeout=10), "the test never let the pass through"
        if self.fail_after is not None and len(self.passes) > self.fail_after:
            raise RuntimeError("stage 1 died")
        return PassResult(0, self.pending.pop(0), (0.0, 0.0))

    def release(self, sequence: int) -> None:
        self.released.append(sequence)
        self.cache.pop(sequence, None)

    def copy(self, source: int, destination: int, length: int) -> None:
        self.copies.append((source, destination, length))
        self.cache[destination] = list(self.cache.get(source, [])[:length])


class Collector:
    """A request's sink: every Progress, and an event set at the end."""

    def __init__(self):
        self.events: list[Progress] = []
        self.done = threading.Event()

    def __call__(self, progress: Progress) -> None:
        self.events.append(progress)
        if progress.finished is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [token for event in self.events for token in event.tokens]

    @property
    def finished(self) -> str | None:
        return self.events[-1].finished if self.events else None

    def wait(self) -> Collector:
        assert self.done.wait(timeout=10), "the request never ended"
        return self


def wait_for(condition, seconds: float = 10) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the condition never held")


def settings(**overrides) -> ServiceSettings:
    return ServiceSettings(**{"max_sequences": 3, "queue_limit": 50, "context": 200, **overrides})


def request(prompt: list[int], max_tokens: int) -> ServiceRequest:
    return ServiceRequest(prompt, max_tokens, SamplingSettings())


def random_requests(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 14))], rng.randrange(1, 30))
            for _ in range(count)]


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "ngram"])
def test_each_request_gets_what_it_gets_alone(drafting):
    """12 requests through 3 sequences: each one's tokens are its solo tokens
    (a mixed-up sequence id, a lost prompt chunk or a missed rollback changes them)."""
    model = CountingModel()
    service = Service(model, lambda token: token == END, settings(
        speculator=(lambda sequence: PromptLookupSpeculator()) if drafting else None, draft_max=4))
    work = random_requests(12)
    collectors = [Collector() for _ in work]
    for (prompt, max_tokens), collector in zip(work, collectors):
        service.submit(request(prompt, max_tokens), collector)
    for (prompt, max_tokens), collector in zip(work, collectors):
        expected = alone(prompt, max_tokens)
        assert collector.wait().tokens == expected
        assert collector.finished == ("length" if len(expected) == max_tokens else "end")
    service.close(drain_seconds=1)
    assert all(len(target_pass.windows) == 1 for target_pass in model.passes)  # one window per pass
    assert len(model.released) == 12 and set(model.released) <= {0, 1, 2}
    assert model.cache == {}  # every sequence freed
    if drafting:  # the stand-in model repeats itself: prompt lookup must have made windows of several tokens
        assert any(len(target_pass.windows[0].inputs) > 1 and not target_pass.windows[0].prompt
                   for target_pass in model.passes)


def test_sequences_at_once_fill_the_pipeline():
    """With 3 free sequences, 3 passes are in flight before the first comes back."""
    model = CountingModel(gated=True)
    service = Service(model, lambda token: False, settings())
    collectors = [Collector() for _ in range(3)]
    for index, collector in enumerate(collectors):
        service.submit(request([index + 1], 3), collector)
    wait_for(lambda: len(model.passes) == 3)
    assert {p.windows[0].sequence for p in model.passes} == {0, 1, 2}
    for _ in range(3 * 3):
        model.gate.release()
    for collector in collectors:
        assert collector.wait().finished == "length"
    service.close(drain_seconds=1)


def test_a_full_queue_refuses_and_a_cancel_frees_the_sequence():
    model = CountingModel(gated=True)
    service = Service(model, lambda token: False, settings(max_sequences=1, queue_limit=1))
    first, second = Collector(), Collector()
    number = service.submit(request([1, 2], 20), first)
    service.submit(request([3], 2), second)
    with pytest.raises(QueueFull, match="1 sequences are busy and 1 requests are waiting"):
        service.submit(request([4], 2), Collector())
    wait_for(lambda: len(model.passes) == 1)  # the first request's prompt pass is in flight
    service.cancel(number)
    for _ in range(20):
        model.gate.release()
    # the loop was waiting for the prompt's pass: it delivers that token, then cancels (within one pass)
    assert first.wait().finished == "cancelled" and first.tokens == alone([1, 2], 20)[:1]
    assert second.wait().tokens == alone([3], 2)  # it got the freed sequence
    assert model.released == [0, 0]
    service.close(drain_seconds=1)


def test_close_refuses_new_requests_and_errors_queued_ones():
    model = CountingModel(gated=True)
    service = Service(model, lambda token: False, settings(max_sequences=1, queue_limit=5))
    running, queued = Collector(), Collector()
    service.submit(request([1], 3), running)
    service.submit(request([2], 3), queued)
    wait_for(lambda: len(model.passes) == 1)
    closing = threading.Thread(target=service.close, args=(5,))
    closing.start()
    wait_for(lambda: service._closing)
    with pytest.raises(ShuttingDown):
        service.submit(request([1], 1), Collector())
    for _ in range(3):
        model.gate.release()
    assert queued.wait().events == [Progress(finished="error", error="the server is shutting down")]
    assert running.wait().tokens == alone([1], 3)  # in flight: it finishes
    closing.join(timeout=10)
    assert not closing.is_alive() and model.released == [0]


def test_close_ends_requests_still_running_after_the_drain():
    model = CountingModel(gated=True)
    service = Service(model, lambda token: False, settings(max_sequences=1))
    running = Collector()
    service.submit(request([1], 50), running)
    wait_for(lambda: len(model.passes) == 1)
    closing = threading.Thread(target=service.close, args=(0.05,))
    closing.start()
    threading.Event().wait(0.1)
    for _ in range(5):
        model.gate.release()
    assert running.wait().events[-1] == Progress(finished="error", error="the server shut down before the request finished")
    assert 0 < len(running.tokens) < 50
    closing.join(timeout=10)
    assert not closing.is_alive() and model.released == [0]


def test_a_failing_target_ends_every_request_with_its_error():
    model = CountingModel()
    model.fail_after = 3
    service = Service(model, lambda token: False, settings(max_sequences=2, queue_limit=5))
    collectors = [Collector() for _ in range(4)]
    for index, collector in enumerate(collectors):
        service.submit(request([index + 1], 30), collector)
    for collector in collectors:
        assert collector.wait().events[-1] == Progress(finished="error", error="RuntimeError: stage 1 died")
    assert service.failure == "RuntimeError: stage 1 died"
    with pytest.raises(ShuttingDown, match="stage 1 died"):
        service.submit(request([1], 1), Collector())


class LosingModel(CountingModel):
    """A target that loses a part after ``lose_after`` passes (TargetWaiting,
    what it held gone) and can resume once ``room`` is set."""

    def __init__(self, lose_after: int):
        super().__init__()
        self.lose_after, self.room, self.resumes = lose_after, threading.Event(), 0

    def receive(self) -> PassResult:
        if self.lose_after is not None and len(self.passes) > self.lose_after:
            self.lose_after = None
            self.cache.clear()
            raise TargetWaiting("stage 0's node 5e1f is lost and no other node has room for it")
        return super().receive()

    def resume(self) -> bool:
        self.resumes += 1
        if self.room.is_set():
            self.pending.clear()  # the lost passes' results never come
        return self.room.is_set()


def test_a_target_waiting_for_room_ends_requests_retryably_and_the_service_resumes_by_itself(monkeypatch):
    """No node has room for a lost stage: every request in flight or queued
    ends with the reason, new ones are refused (Unavailable, not a shutdown),
    nothing is marked failed; once the target resumes, a request gets its
    solo tokens again."""
    import orchestrator.decoding.service as service_module

    monkeypatch.setattr(service_module, "RESUME_SECONDS", 0.01)
    model = LosingModel(lose_after=3)
    service = Service(model, lambda token: False, settings(max_sequences=2, queue_limit=5))
    collectors = [Collector() for _ in range(3)]
    for index, collector in enumerate(collectors):
        service.submit(request([index + 1], 30), collector)
    for collector in collectors:
        event = collector.wait().events[-1]
        assert event.finished == "error" and "node 5e1f is lost" in event.error and "resumes by itself" in event.error
    wait_for(lambda: model.resumes > 2)
    assert service.failure == "" and "node 5e1f is lost" in service.degraded
    with pytest.raises(Unavailable, match="node 5e1f is lost"):
        service.submit(request([1], 1), Collector())
    model.room.set()
    wait_for(lambda: not service.degraded)
    again = Collector()
    service.submit(request([7, 8], 12), again)
    assert again.wait().tokens == alone([7, 8], 12)
    service.close(drain_seconds=1)
    assert service.failure == ""


def test_a_service_waiting_for_room_closes_without_waiting_for_it(monkeypatch):
    model = LosingModel(lose_after=0)
    service = Service(model, lambda token: False, settings(max_sequences=1))
    service.submit(request([1], 30), collector := Collector())
    assert collector.wait().finished == "error"
    wait_for(lambda: model.resumes > 0)
    closing = threading.Thread(target=service.close, args=(1,))
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive()


def test_a_request_beyond_the_context_is_refused_with_its_numbers():
    service = Service(CountingModel(), lambda token: False, settings(context=20))
    with pytest.raises(RequestTooLong, match=r"the prompt \(5 tokens\) \+ max_tokens \(16\) exceed the context of 20"):
        service.submit(request([1] * 5, 16), Collector())
    service.close(drain_seconds=1)


def test_with_batching_requests_share_passes_and_each_gets_its_solo_tokens():
    """A flat pass cost (batch_step 0): the windows of several requests share
    passes (schedule.Batching), and each request still gets its solo tokens."""
    model = CountingModel()
    service = Service(model, lambda token: token == END, settings(max_sequences=4, batch_step=0.0))
    work = random_requests(8, seed=1)
    collectors = [Collector() for _ in work]
    for (prompt, max_tokens), collector in zip(work, collectors):
        service.submit(request(prompt, max_tokens), collector)
    for (prompt, max_tokens), collector in zip(work, collectors):
        assert collector.wait().tokens == alone(prompt, max_tokens)
    service.close(drain_seconds=1)
    assert max(len(target_pass.windows) for target_pass in model.passes) > 1
    assert model.cache == {}


def test_a_new_request_takes_the_lowest_free_sequence():
    """Requests decoding hold low, consecutive ids (what lets their windows share a pass)."""
    model = CountingModel(gated=True)
    service = Service(model, lambda token: False, settings(max_sequences=3))
    collectors = [Collector() for _ in range(3)]
    numbers = [service.submit(request([index + 1], 40), collector) for index, collector in enumerate(collectors)]
    wait_for(lambda: len(model.passes) == 3)
    for number, freed in ((numbers[1], [1]), (numbers[0], [1, 0])):
        service.cancel(number)
        while model.released != freed:
            model.gate.release()
            threading.Event().wait(0.01)
    late = Collector()
    service.submit(request([9, 9], 2), late)
    while not any(p.windows[0].inputs == (9, 9) for p in model.passes):  # the loop turns a pass at a time
        model.gate.release()
        threading.Event().wait(0.01)
    assert next(p.windows[0].sequence for p in model.passes if p.windows[0].inputs == (9, 9)) == 0
    for _ in range(200):
        model.gate.release()
    service.close(drain_seconds=1)


def test_more_choices_than_the_server_can_ever_hold_are_refused_not_queued():
    service = Service(CountingModel(), lambda token: False, settings(max_sequences=2, queue_limit=1))
    try:
        with pytest.raises(ServiceError, match="4 choices: this server decodes at most 3 at once or queued"):
            service.submit(ServiceRequest([1, 2], 3, SamplingSettings(), choices=4), Collector())
    finally:
        service.close(drain_seconds=1)


def test_cancelling_one_choice_ends_it_and_lets_the_others_finish():
    """A stop string ends its own choice only (cancel_choice); cancel ends every choice."""
    model = CountingModel(gated=True)
    service = Service(model, lambda token: False, settings(max_sequences=4))
    ends: dict[int, list[Progress]] = {0: [], 1: [], 2: []}
    finished = threading.Semaphore(0)

    def sink(progress: Progress) -> None:
        ends[progress.choice].append(progress)
        if progress.finished is not None:
            finished.release()

    prompt = [3, 1, 4]
    number = service.submit(ServiceRequest(prompt, 20, SamplingSettings(), choices=3), sink)
    wait_for(lambda: len(model.passes) == 1)  # the prompt's pass
    service.cancel_choice(number, 1)
    for _ in range(200):
        model.gate.release()
    for _ in range(3):
        assert finished.acquire(timeout=10)
    service.close(drain_seconds=1)
    tokens = {choice: [token for event in events for token in event.tokens] for choice, events in ends.items()}
    assert [ends[choice][-1].finished for choice in range(3)] == ["length", "cancelled", "length"]
    assert tokens[0] == tokens[2] == alone(prompt, 20)  # greedy: every choice the same
    assert tokens[1] == alone(prompt, 20)[:len(tokens[1])] and len(tokens[1]) < 20


def test_choices_of_one_request_wait_for_its_prompt_and_copy_it():
    """The service decides copies without a real model: the second and third
    choice wait for the first's prompt to be prefilled, then copy it all but
    its last token; finished requests are copied into the prefix sequences."""
    model = CountingModel()
    service = Service(model, lambda token: False, settings(max_sequences=4, prefix_sequences=2, prefix_tokens=400))
    try:
        prompt = list(range(1, 40))
        service.submit(ServiceRequest(prompt, 5, SamplingSettings(temperature=1.0, seed=1), choices=3), Collector())
        wait_for(lambda: service.counts() == (0, 0))
    finally:
        service.close(drain_seconds=1)
    into_served = [copy for copy in model.copies if copy[1] < 4]  # the rest keep finished requests (ids 4, 5)
    assert [length for _, _, length in into_served] == [len(prompt) - 1] * 2
