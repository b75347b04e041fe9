"""serving.resuming: a request whose coordinator dies goes on through the
next one, its client sent each token once, in order; tokens that come out
different end it with an error instead. The coordinator here is a stand-in
that replays a fixed text in chunks and can die after a given event (the Ray
test, tests/ray/test_serve.py, kills a real one)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from orchestrator.decoding.service import Progress, QueueFull, ServiceRequest
from orchestrator.serving.resuming import CoordinatorLost, ResumingService
from speculators.logprobs import TokenLogprobs
from speculators.sampling import SamplingSettings

TEXTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]]


def request(choices: int = 1) -> ServiceRequest:
    return ServiceRequest([1, 2, 3], 7, SamplingSettings(temperature=0.0), choices=choices)


def scored(tokens) -> TokenLogprobs:
    return TokenLogprobs(np.array([-float(token) for token in tokens], dtype=np.float32),
                         np.array([[token] for token in tokens], dtype=np.int32),
                         np.array([[-float(token)] for token in tokens], dtype=np.float32))


class Coordinators:
    """Each ``generate`` is one coordinator's answer: the texts in chunks of
    ``chunk`` tokens, choice after choice; ``lives[i]`` is how many events
    the i-th coordinator sends before it dies (None: all)."""

    def __init__(self, lives, chunk=2, texts=TEXTS, refuse=None, logprobs=False):
        self.lives, self.chunk, self.texts, self.refuse, self.logprobs = list(lives), chunk, texts, refuse, logprobs
        self.asked = 0
        self.cancelled: list[tuple[int, int]] = []

    async def generate(self, asked: ServiceRequest):
        life = self.lives[self.asked] if self.asked < len(self.lives) else None
        number = self.asked
        self.asked += 1
        if self.refuse:
            raise self.refuse
        yield number
        events = []
        for choice in range(asked.choices):
            text = self.texts[choice][:asked.max_tokens]
            for start in range(0, len(text), self.chunk):
                tokens = tuple(text[start:start + self.chunk])
                events.append(Progress(tokens, choice=choice, logprobs=scored(tokens) if self.logprobs else None))
            events.append(Progress(finished="length", choice=choice))
        for sent, event in enumerate(events):
            if life is not None and sent == life:
                raise CoordinatorLost("the replica's actor died")
            await asyncio.sleep(0)
            yield event

    def cancel_choice(self, number: int, choice: int) -> None:
        self.cancelled.append((number, choice))

    async def health(self):
        return {"status": "ok"}, 200


def served(coordinators: Coordinators, choices: int = 1, back_seconds: float = 5.0, on_first=None):
    """Every event the client's sink got, and the service."""

    async def main():
        service = ResumingService(coordinators, back_seconds=back_seconds)
        got: list[Progress] = []
        done = asyncio.Event()

        def sink(event: Progress) -> None:
            got.append(event)
            if on_first is not None and len(got) == 1:
                on_first(service, number_box[0])
            if sum(event.finished is not None for event in got) == choices:
                done.set()

        number_box = [None]
        number_box[0] = await service.submit(request(choices), sink)
        await asyncio.wait_for(done.wait(), 10)
        return got, service

    return asyncio.run(main())


def tokens_of(events, choice=0):
    return [token for event in events if event.choice == choice for token in event.tokens]


@pytest.mark.parametrize("lives", [[3], [1, 4], [0, 5], [7]])
def test_a_request_whose_coordinator_dies_gets_each_token_once_then_its_end(lives):
    events, service = served(Coordinators(lives, chunk=3 if len(lives) == 1 else 2), choices=2)
    assert tokens_of(events, 0) == TEXTS[0] and tokens_of(events, 1) == TEXTS[1]
    assert [(event.choice, event.finished) for event in events if event.finished] == [(0, "length"), (1, "length")]
    assert service.asked_again == len(lives)


def test_tokens_asked_again_that_differ_end_the_request_with_an_error_not_a_wrong_text():
    other = [[5, 6, 99, 8, 9, 10, 11], TEXTS[1]]

    class Changing(Coordinators):
        async def generate(self, asked):
            if self.asked:
                self.texts = other
            async for item in super().generate(asked):
                yield item

    events, _ = served(Changing([3]), choices=1)
    assert tokens_of(events) == TEXTS[0][:6]  # what the first sent; nothing after the difference
    assert events[-1].finished == "error" and "differ" in events[-1].error


def test_the_logprobs_of_tokens_already_sent_are_not_sent_again():
    events, _ = served(Coordinators([2], chunk=3, logprobs=True))
    scored_events = [event for event in events if event.tokens]
    assert tokens_of(events) == TEXTS[0]
    for event in scored_events:
        assert event.logprobs.logprobs.tolist() == [-float(token) for token in event.tokens]


def test_no_coordinator_back_within_the_bound_ends_the_request_saying_so():
    class Gone(Coordinators):
        async def generate(self, asked):
            if self.asked:
                await asyncio.sleep(60)
            async for item in super().generate(asked):
                yield item

    events, _ = served(Gone([2]), back_seconds=0.3)
    assert tokens_of(events) == TEXTS[0][:4]
    assert events[-1].finished == "error" and "within" in events[-1].error


def test_a_coordinator_that_fails_otherwise_ends_the_request_with_an_error_not_a_hang():
    class Failing(Coordinators):
        async def generate(self, asked):
            async for item in super().generate(asked):
                yield item
                if isinstance(item, Progress) and item.tokens:
                    raise RuntimeError("a bug in the coordinator")

    events, service = served(Failing([None]))
    assert tokens_of(events) == TEXTS[0][:2] and service.asked_again == 0
    assert events[-1].finished == "error" and "RuntimeError: a bug in the coordinator" in events[-1].error


def test_a_request_whose_coordinators_keep_dying_ends_with_an_error_after_the_last_ask():
    events, service = served(Coordinators([1, 1, 1, 1]), back_seconds=5.0)
    assert tokens_of(events) == TEXTS[0][:2] and service.asked_again == 2
    assert events[-1].finished == "error" and "lost 3 times" in events[-1].error


def test_a_full_queue_or_a_stage_moving_when_asked_again_is_waited_out():
    class Busy(Coordinators):
        async def generate(self, asked):
            self.refuse = QueueFull("all 4 sequences are busy") if self.asked == 1 else None
            async for item in super().generate(asked):
                yield item

    events, service = served(Busy([2, None, None]))
    assert tokens_of(events) == TEXTS[0] and events[-1].finished == "length"


def test_events_that_end_before_every_choice_did_end_the_request_with_an_error():
    class Short(Coordinators):
        async def generate(self, asked):
            async for item in super().generate(asked):
                if isinstance(item, Progress) and item.finished:
                    return
                yield item

    events, _ = served(Short([None]))
    assert tokens_of(events) == TEXTS[0] and events[-1].finished == "error" and "early" in events[-1].error


def test_a_refusal_is_raised_at_submission():
    async def main():
        service = ResumingService(Coordinators([None], refuse=QueueFull("all 4 sequences are busy")), 5.0)
        await service.submit(request(), lambda event: None)

    with pytest.raises(QueueFull, match="busy"):
        asyncio.run(main())


def test_a_choice_stopped_by_the_front_is_stopped_in_the_next_coordinator_too():
    coordinators = Coordinators([3], chunk=1)
    served(coordinators, choices=2, on_first=lambda service, number: service.cancel_choice(number, 1))
    assert (0, 1) in coordinators.cancelled and (1, 1) in coordinators.cancelled


def test_health_says_restarting_while_no_coordinator_answers():
    class Dead(Coordinators):
        async def health(self):
            raise CoordinatorLost("the replica's actor died")

    body, status = asyncio.run(ResumingService(Dead([None]), 5.0).health())
    assert status == 503 and body["status"] == "restarting" and "actor died" in body["error"]
    assert asyncio.run(ResumingService(Coordinators([None]), 5.0).health()) == (
        {"status": "ok", "requests_asked_again": 0}, 200)


def test_health_counts_the_requests_asked_again():
    _, service = served(Coordinators([1, None]), back_seconds=5.0)
    body, status = asyncio.run(service.health())
    assert status == 200 and body["requests_asked_again"] == service.asked_again == 1
