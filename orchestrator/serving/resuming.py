"""The HTTP front's view of the coordinator's service: every request goes on
through the coordinator Serve starts after one dies.

``orchestrate serve`` runs two deployments (orchestrator.serving.deployment):
the front, the HTTP app (orchestrator.serving.app), and the coordinator, which
holds the pipeline, the drafters and the ``Service``. A coordinator that dies
(SIGKILLed, crashed) takes its requests' state with it, but not the front's:
each request it held is asked again of the next coordinator, the same prompt
tokens, max_tokens and seed, and only the tokens its client has not been sent
yet go on. The exactness contract makes that the same text: a greedy token is
the argmax, and a seeded draw depends only on (seed, position) and the logits,
which are the whole model's whatever else shares the pass. The tokens asked
again are checked against those sent: a difference ends the request with an
error, never a wrong text.

No Ray here: the coordinator is anything with ``Coordinator``'s calls
(deployment.CoordinatorCalls over a Serve handle; fakes in the pure tests).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from orchestrator.config import FRONT_HEALTH_SECONDS
from orchestrator.decoding.service import Progress, ServiceError, ServiceRequest, Sink
from stages.errors import SpecpipeError

ASK_AGAIN_PAUSE_SECONDS = 0.5  # between asks of a coordinator that is not back yet


class CoordinatorLost(SpecpipeError):
    """The coordinator's process ended, or cannot be reached, while it held a request (another may follow)."""


class Diverged(SpecpipeError):
    """A request asked again gave other tokens than those already sent (never expected: the contract)."""


class Coordinator(Protocol):
    def generate(self, request: ServiceRequest) -> AsyncIterator:
        """The request's number in the coordinator's service, then its Progress
        events until every choice ended; raises the service's refusal
        (QueueFull, Unavailable, ...) at once, CoordinatorLost when the coordinator dies."""

    def cancel_choice(self, number: int, choice: int) -> None: ...

    async def health(self) -> tuple[dict, int]:
        """/health's body and status code."""


@dataclass
class _Asked:
    """A request as the front holds it: what was sent to its client, choice by choice."""

    request: ServiceRequest
    sink: Sink
    sent: list[list[int]]  # each choice's tokens sent so far
    ended: set[int] = field(default_factory=set)  # choices whose end was sent
    stopped: set[int] = field(default_factory=set)  # choices the front cancelled (a stop string)
    seen: list[int] = field(default_factory=list)  # each choice's tokens the present ask has given
    number: int | None = None  # its number in the present coordinator's service
    task: asyncio.Task | None = None


class ResumingService:
    """``submit``, ``cancel``, ``cancel_choice`` and ``health`` for the HTTP app,
    over a coordinator that may die and come back within ``back_seconds``."""

    def __init__(self, coordinator: Coordinator, back_seconds: float):
        self.coordinator = coordinator
        self.back_seconds = back_seconds
        self.asked_again = 0  # requests asked of another coordinator after theirs was lost
        self._asked: dict[int, _Asked] = {}
        self._numbers = itertools.count()

    async def submit(self, request: ServiceRequest, sink: Sink) -> int:
        """The request's number here, once a coordinator took it; its refusal
        (a ServiceError) is raised, and CoordinatorLost where none came back in time."""
        asked = _Asked(request, sink, [[] for _ in range(request.choices)])
        events = await self._ask(asked, time.monotonic() + self.back_seconds)
        number = next(self._numbers)
        self._asked[number] = asked
        asked.task = asyncio.get_running_loop().create_task(self._follow(number, asked, events))
        return number

    def cancel(self, number: int) -> None:
        """Stop a request (its client went away): the coordinator frees its sequences. Unknown ones are ignored."""
        asked = self._asked.get(number)
        if asked is not None and asked.task is not None:
            asked.task.cancel()

    def cancel_choice(self, number: int, choice: int) -> None:
        """Stop one choice (its stop string matched), in this coordinator and any next one."""
        asked = self._asked.get(number)
        if asked is None:
            return
        asked.stopped.add(choice)
        if asked.number is not None:
            self.coordinator.cancel_choice(asked.number, choice)

    async def health(self) -> tuple[dict, int]:
        try:
            return await asyncio.wait_for(self.coordinator.health(), FRONT_HEALTH_SECONDS)
        except (CoordinatorLost, asyncio.TimeoutError) as error:
            reason = f"the coordinator does not answer (Serve starts another): {error or 'no answer'}"
            return {"status": "restarting", "error": reason}, 503

    async def _ask(self, asked: _Asked, deadline: float) -> AsyncIterator:
        """Ask the coordinator for the request until one takes it (its events,
        past its number) or refuses it (raised); CoordinatorLost after the deadline."""
        while True:
            events = aiter(self.coordinator.generate(asked.request))
            try:
                asked.number = await asyncio.wait_for(anext(events), max(0.0, deadline - time.monotonic()))
                break
            except asyncio.TimeoutError:
                await _close(events)
                raise CoordinatorLost(f"no coordinator took the request within {self.back_seconds:.0f} s") from None
            except CoordinatorLost:
                await _close(events)
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(ASK_AGAIN_PAUSE_SECONDS)
        asked.seen = [0] * asked.request.choices
        for choice in asked.ended | asked.stopped:  # not computed again
            self.coordinator.cancel_choice(asked.number, choice)
        return events

    async def _follow(self, number: int, asked: _Asked, events: AsyncIterator) -> None:
        """Hand the request's new events to its sink until every choice ended;
        ask again where the coordinator is lost; end the open choices with an
        error where no coordinator comes back, or one refuses, or the tokens differ."""
        try:
            while True:
                try:
                    async for event in events:
                        self._hand_on(asked, event)
                    return
                except CoordinatorLost:
                    await _close(events)
                    self.asked_again += 1
                    events = await self._ask(asked, time.monotonic() + self.back_seconds)
        except (CoordinatorLost, ServiceError, Diverged) as error:
            self._end(asked, f"the coordinator was lost: {error}")
        except Exception as error:  # noqa: BLE001 - whatever failed, the client gets an error, never a stream that hangs
            self._end(asked, f"the coordinator failed: {type(error).__name__}: {error}")
        finally:
            await _close(events)
            self._asked.pop(number, None)

    @staticmethod
    def _end(asked: _Asked, error: str) -> None:
        for choice in sorted(set(range(asked.request.choices)) - asked.ended):
            asked.sink(Progress(finished="error", error=error, choice=choice))

    @staticmethod
    def _hand_on(asked: _Asked, event: Progress) -> None:
        """The part of ``event`` its client has not been sent (the tokens of an
        earlier ask checked against what was sent), if any, to its sink."""
        choice = event.choice
        if choice in asked.ended:
            return
        first = asked.seen[choice]
        asked.seen[choice] += len(event.tokens)
        again = asked.sent[choice][first:first + len(event.tokens)]
        if list(event.tokens[:len(again)]) != again:
            raise Diverged(f"choice {choice}: asked again, its tokens from position {first} differ from those sent")
        new = event.tokens[len(again):]
        asked.sent[choice].extend(new)
        if event.finished is not None:
            asked.ended.add(choice)
        if new or event.finished is not None:
            logprobs = None if event.logprobs is None or not new else event.logprobs.after(len(again))
            asked.sink(replace(event, tokens=tuple(new), logprobs=logprobs))


async def _close(events: AsyncIterator) -> None:
    closing = getattr(events, "aclose", None)
    if closing is not None:
        await closing()
