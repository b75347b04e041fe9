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

from orchestrator.config import FRONT_ASK_AGAIN_PAUSE_SECONDS, FRONT_ASKS_AGAIN_MOST, FRONT_HEALTH_SECONDS
from orchestrator.decoding.service import Progress, QueueFull, ServiceError, ServiceRequest, Sink, Unavailable
from stages.errors import SpecpipeError


class CoordinatorLost(SpecpipeError):
    """The coordinator's process ended, or cannot be reached, while it held a request (another may follow)."""


class Diverged(SpecpipeError):
    """A request asked again gave other tokens than those already sent (never expected: the contract)."""


class Coordinator(Protocol):
    def generate(self, request: ServiceRequest) -> AsyncIterator:
        """A ticket naming the request in this coordinator, then its Progress
        events until every choice ended; raises the service's refusal
        (QueueFull, Unavailable, ...) at once, CoordinatorLost when the coordinator dies."""

    def cancel_choice(self, ticket, choice: int) -> None:
        """Stop one choice of the request ``ticket`` names; a ticket of another coordinator is ignored."""

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
    ticket: object = None  # what the present coordinator named it (None while none holds it)
    asked_again: int = 0
    events: AsyncIterator | None = None  # the present coordinator's, until closed
    task: asyncio.Task | None = None


class ResumingService:
    """``submit``, ``cancel``, ``cancel_choice`` and ``health`` for the HTTP app,
    over a coordinator that may die and come back within ``back_seconds``."""

    def __init__(self, coordinator: Coordinator, back_seconds: float, asks_again_most: int = FRONT_ASKS_AGAIN_MOST):
        self.coordinator = coordinator
        self.back_seconds = back_seconds
        self.asks_again_most = asks_again_most
        self.asked_again = 0  # requests asked of another coordinator after theirs was lost
        self._asked: dict[int, _Asked] = {}
        self._numbers = itertools.count()

    async def submit(self, request: ServiceRequest, sink: Sink) -> int:
        """The request's number here, once a coordinator took it; its refusal
        (a ServiceError) is raised, and CoordinatorLost where none came back in time."""
        asked = _Asked(request, sink, [[] for _ in range(request.choices)])
        await self._ask(asked, time.monotonic() + self.back_seconds, again=False)
        number = next(self._numbers)
        self._asked[number] = asked
        asked.task = asyncio.get_running_loop().create_task(self._follow(asked))
        asked.task.add_done_callback(lambda _: self._forget(number))
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
        if asked.ticket is not None:
            self.coordinator.cancel_choice(asked.ticket, choice)

    async def health(self) -> tuple[dict, int]:
        """The coordinator's /health, with the requests this front asked again of another coordinator."""
        try:
            body, status = await asyncio.wait_for(self.coordinator.health(), FRONT_HEALTH_SECONDS)
        except Exception as error:  # noqa: BLE001 - whatever the coordinator's state, /health answers
            reason = f"the coordinator does not answer (Serve starts another): {error or 'no answer'}"
            body, status = {"status": "restarting", "error": reason, "requests_decoding": None,
                            "requests_queued": None, "stages": [], "drafters": []}, 503
        return {**body, "requests_asked_again": self.asked_again}, status

    async def _ask(self, asked: _Asked, deadline: float, again: bool) -> None:
        """Ask the coordinator for the request until one takes it (asked.ticket,
        asked.events) or refuses it (raised; asked again, a full queue or a
        stage still moving is waited out too); CoordinatorLost after the deadline."""
        waited_out = (CoordinatorLost, QueueFull, Unavailable) if again else (CoordinatorLost,)
        while True:
            events = aiter(self.coordinator.generate(asked.request))
            try:
                asked.ticket = await asyncio.wait_for(anext(events), max(0.0, deadline - time.monotonic()))
                break
            except asyncio.TimeoutError:
                await _close(events)
                raise CoordinatorLost(f"no coordinator took the request within {self.back_seconds:.0f} s") from None
            except waited_out:
                await _close(events)
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(FRONT_ASK_AGAIN_PAUSE_SECONDS)
        asked.events = events
        asked.seen = [0] * asked.request.choices
        for choice in asked.ended | asked.stopped:  # not computed again
            self.coordinator.cancel_choice(asked.ticket, choice)

    async def _follow(self, asked: _Asked) -> None:
        """Hand the request's new events to its sink until every choice ended;
        ask again where the coordinator is lost (at most asks_again_most times);
        end the open choices with an error where no coordinator comes back, or
        one refuses, or the tokens differ, or anything else fails."""
        try:
            while True:
                try:
                    async for event in asked.events:
                        self._hand_on(asked, event)
                    self._end(asked, "the coordinator ended the request's events early")  # none open: nothing
                    return
                except (CoordinatorLost, asyncio.CancelledError) as lost:
                    if isinstance(lost, asyncio.CancelledError) and asyncio.current_task().cancelling():
                        raise  # the front's own cancel (its client went away), not Ray's
                    await self._let_go(asked)
                    if asked.asked_again >= self.asks_again_most:
                        raise CoordinatorLost(f"lost {asked.asked_again + 1} times while it held the request: "
                                              f"{lost or 'its task was cancelled'}") from None
                    asked.asked_again += 1
                    self.asked_again += 1
                    await self._ask(asked, time.monotonic() + self.back_seconds, again=True)
        except CoordinatorLost as error:
            self._end(asked, f"the coordinator was lost: {error}")
        except ServiceError as error:
            self._end(asked, f"the next coordinator refused it: {error}")
        except Diverged as error:
            self._end(asked, f"asked again: {error}")
        except Exception as error:  # noqa: BLE001 - whatever failed, the client gets an error, never a stream that hangs
            self._end(asked, f"the coordinator failed: {type(error).__name__}: {error}")
        finally:
            await self._let_go(asked)

    async def _let_go(self, asked: _Asked) -> None:
        """Close the present coordinator's events (cancelling the request there, if it runs on)."""
        events, asked.events, asked.ticket = asked.events, None, None
        if events is not None:
            await _close(events)

    def _forget(self, number: int) -> None:
        """The request's task is done: forget it; close its events if the task was cancelled before it began."""
        asked = self._asked.pop(number, None)
        if asked is not None and asked.events is not None:
            asyncio.get_running_loop().create_task(self._let_go(asked))

    @staticmethod
    def _end(asked: _Asked, error: str) -> None:
        for choice in sorted(set(range(asked.request.choices)) - asked.ended):
            asked.sink(Progress(finished="error", error=error, choice=choice))
            asked.ended.add(choice)

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
