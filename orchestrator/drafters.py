"""Drafter actors beside the stages, and the coordinator's side of their sockets.

One drafter per machine, placed on its stage's node (in the same placement
bundle). Every failure of a drafter (it raises, hangs, its actor dies, its
socket closes) is absorbed here: the client answers with an empty draft, marks
the drafter lost, and the pipeline goes on without it. A lost drafter is not
restarted during a generation.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from orchestrator import wire
from orchestrator.handshake import DRAFTER_ROLE, HandshakeError, connect_peer
from orchestrator.defaults import ACTOR_START_SECONDS, CONNECT_SECONDS, DRAFT_MAX, DRAFTER_REPLY_SECONDS, DRAFTER_WAIT_SECONDS
from orchestrator.drafter_server import DrafterServer, Speculator
from orchestrator.messages import CollectDraft, DraftReply, Shutdown, SpeculateFrom


@dataclass(frozen=True)
class DrafterSettings:
    """draft_max: most tokens drafted per request (--draft-max).
    overlap: keep drafting while the machine's own stage runs (--draft-overlap).
    wait_seconds: how long a synchronous request may wait for the draft to finish."""

    draft_max: int = DRAFT_MAX
    overlap: bool = False
    wait_seconds: float = DRAFTER_WAIT_SECONDS


def _drafter_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class DrafterActor:
        """Thin Ray shell over a DrafterServer."""

        def __init__(self, index: int, make_speculator: Callable[[], Speculator], settings: DrafterSettings,
                     secret: bytes):
            self.index = index
            self.server = DrafterServer(
                make_speculator, ray.util.get_node_ip_address(),
                draft_max=settings.draft_max, overlap=settings.overlap, wait_seconds=settings.wait_seconds,
                secret=secret,
            )

        def peak_rss_mb(self) -> float:
            from orchestrator.cluster import peak_rss_mb

            return peak_rss_mb()

        def address(self) -> tuple[str, int, str]:
            return ray.util.get_node_ip_address(), self.server.port, ray.get_runtime_context().get_node_id()

        def __repr__(self) -> str:  # the name shown on the Ray dashboard
            return f"drafter-{self.index}"

    return DrafterActor


class DrafterClient:
    """The coordinator's handle on one drafter; never raises."""

    def __init__(self, index: int, sock: socket.socket | None, node_id: str = "", actor=None):
        self.index = index
        self.node_id = node_id
        self.actor = actor
        self._sock = sock
        self._epoch = 0
        self._speculating = False
        self.busy_seconds = 0.0
        self.last_error = ""
        self.lost_reason = "" if sock is not None else "did not start"

    @property
    def alive(self) -> bool:
        return self._sock is not None

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def speculate(self, context: list[int]) -> None:
        """Ask the drafter to extend context (committed text + speculation) from now on."""
        if self._sock is None:
            return
        self._epoch += 1
        try:
            wire.send_message(self._sock, SpeculateFrom(self._epoch, np.asarray(context, dtype=np.int32)))
            self._speculating = True
        except OSError as error:
            self._lose(f"send failed: {error}")

    def collect(self, wait: bool = False) -> list[int]:
        """The tokens drafted since the last speculate (best effort); [] if none or lost."""
        if self._sock is None or not self._speculating:
            return []
        self._speculating = False
        try:
            wire.send_message(self._sock, CollectDraft(self._epoch, wait))
            self._sock.settimeout(DRAFTER_REPLY_SECONDS)
            reply = wire.receive_message(self._sock)
            self._sock.settimeout(None)
        except (OSError, wire.ConnectionClosed, wire.ProtocolError) as error:
            self._lose(f"no reply: {error or type(error).__name__}")
            return []
        if not isinstance(reply, DraftReply) or reply.epoch != self._epoch:
            self._lose(f"unexpected reply {reply!r}")
            return []
        self.busy_seconds = reply.busy_seconds
        if reply.error:
            self.last_error = reply.error
        return reply.tokens.tolist()

    def close(self) -> None:
        if self._sock is not None:
            try:
                wire.send_message(self._sock, Shutdown())
            except OSError:
                pass
            self._sock.close()
            self._sock = None


def start_drafters(pipeline, make_speculator: Callable[[], Speculator], settings: DrafterSettings) -> list[DrafterClient]:
    """One drafter actor beside each stage of ``pipeline``, connected to this process.

    A drafter that fails to start is reported as lost; generation goes on without it.
    """
    import ray

    from orchestrator.cluster import one_line

    actor_class = _drafter_actor_class()
    actors = [
        actor_class.options(**pipeline.actor_options(index, num_cpus=0)).remote(index, make_speculator, settings,
                                                                                 pipeline.secret)
        for index in range(len(pipeline.stages))
    ]
    clients = []
    for index, actor in enumerate(actors):
        try:
            host, port, node_id = ray.get(actor.address.remote(), timeout=ACTOR_START_SECONDS)
            sock = connect_peer(host, port, pipeline.secret, DRAFTER_ROLE, CONNECT_SECONDS)
            clients.append(DrafterClient(index, sock, node_id, actor))
        except (ray.exceptions.RayError, OSError, HandshakeError) as error:
            client = DrafterClient(index, None, actor=actor)
            client.lost_reason = f"did not start: {one_line(error)}"
            clients.append(client)
    return clients


def stop_drafters(clients: list[DrafterClient]) -> None:
    import ray

    for client in clients:
        client.close()
        if client.actor is not None:
            ray.kill(client.actor)
