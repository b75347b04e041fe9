"""The coordinator deployment's Serve handle as serving.resuming's
``Coordinator``: Ray's errors turned into the project's (a replica that died
or cannot be reached: CoordinatorLost; the service's refusal: itself, as the
replica raised it). Ray is imported only inside (a heavy library)."""

from __future__ import annotations

import asyncio

from orchestrator.cluster.ray_calls import one_line
from orchestrator.decoding.service import ServiceRequest
from orchestrator.serving.resuming import CoordinatorLost


class CoordinatorCalls:
    """serving.resuming's Coordinator over the coordinator deployment's Serve
    handle: Ray's errors as the project's (a dead replica: CoordinatorLost;
    the service's refusal: itself)."""

    def __init__(self, handle):
        self.handle = handle
        self._calls: set[asyncio.Task] = set()  # cancel_choice calls under way (kept from the collector)

    async def generate(self, request: ServiceRequest):
        events = self.handle.options(stream=True).generate.remote(request)
        try:
            async for item in events:
                yield item
        except Exception as error:
            raise _as_ours(error) from None
        finally:
            events.cancel()

    def cancel_choice(self, ticket, choice: int) -> None:
        async def call():
            try:
                await self.handle.cancel_choice.remote(ticket, choice)
            except Exception:  # the coordinator is gone: the next one is told when the front asks again
                pass

        task = asyncio.get_running_loop().create_task(call())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def health(self) -> tuple[dict, int]:
        try:
            return await self.handle.health.remote()
        except Exception as error:
            raise _as_ours(error) from None


def _as_ours(error: BaseException) -> BaseException:
    """A replica's exception as it was raised there (Ray wraps it); a dead or
    unreachable replica as CoordinatorLost; anything else unchanged."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import RayServeException

    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    if isinstance(cause, (RayActorError, RayServeException)):  # a dead replica, or none to ask (deleted, crashed)
        return CoordinatorLost(one_line(cause))
    return cause
