"""Which stages still answer while the coordinator waits for a result.

A pass of a 405B stage may take seconds, so its deadline is long
(config.PASS_DEADLINE_*); a stage whose process or machine froze, or whose
link was cut, would stall every request that long. So while a result is
awaited the coordinator pings each stage on its cancel connection every
STAGE_PING_SECONDS (``Ping``), and the stage's cancel thread answers at once
(``Alive``; orchestrator.workers.cancels), also while llama.cpp computes. A
stage that leaves a ping unanswered for STAGE_SILENCE_SECONDS is silent: the
wait ends with ``PassLate`` naming it, and the pipeline asks Ray what became
of it (orchestrator.cluster.recovery). A slow pass of a live stage is never
called lost this way: its thread answers.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.config import STAGE_ANSWER_SECONDS, STAGE_PING_SECONDS, STAGE_SILENCE_SECONDS
from orchestrator.transport import wire
from orchestrator.transport.messages import Alive, Ping


@dataclass(frozen=True)
class StageDeadlines:
    """How soon a stage that says nothing is found out, in seconds: pinged
    every ``ping_seconds`` while a result is awaited, silent after
    ``silence_seconds`` without an answer, then hung if its actor does not
    answer Ray within ``answer_seconds`` (orchestrator.cluster.recovery).
    The defaults are config's; tests shorten them to see the same path sooner."""

    ping_seconds: float = STAGE_PING_SECONDS
    silence_seconds: float = STAGE_SILENCE_SECONDS
    answer_seconds: float = STAGE_ANSWER_SECONDS


class StageSilent(Exception):
    """A stage left a ping unanswered too long, or its cancel connection broke
    or sent something else; the message names it (one line)."""


def _buffered(sock: socket.socket) -> bool:
    """Bytes already read off the socket and waiting in TLS's buffer (select does not see them)."""
    pending = getattr(sock, "pending", None)
    return bool(pending and pending())


class StageLiveness:
    """The pings of one chain's stages: ``connections[i]`` is stage i's cancel
    connection (the chain's own list, filled as the stages connect). One for
    the chain's life: an answer may arrive during a later wait."""

    def __init__(self, connections: list[socket.socket], clock: Callable[[], float] = time.monotonic,
                 deadlines: StageDeadlines = StageDeadlines()):
        self.connections = connections
        self.clock = clock
        self.ping_seconds = deadlines.ping_seconds
        self.silence_seconds = deadlines.silence_seconds
        self._number = 0
        self._unanswered: dict[int, float] = {}  # stage -> since when a ping of it is pending

    def wait(self, sock: socket.socket, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``sock`` to be readable (True), pinging
        the stages meanwhile; False when the time ran out; StageSilent as soon
        as a stage is silent."""
        now = self.clock()
        until, next_ping, timeout = now + seconds, now + self.ping_seconds, 0.0
        while True:
            if _buffered(sock):
                return True
            readable, _, _ = select.select([sock, *self.connections], [], [], max(0.0, timeout))
            for index, connection in enumerate(self.connections):
                if connection in readable or _buffered(connection):
                    self._hear(index, connection)
            if sock in readable:
                return True
            now = self.clock()
            if now >= until:
                return False
            self._check(now)
            if now >= next_ping:
                self._ping(now)
                next_ping = now + self.ping_seconds
            silent_at = [since + self.silence_seconds for since in self._unanswered.values()]
            timeout = min(until, next_ping, *silent_at) - now

    def _hear(self, index: int, connection: socket.socket) -> None:
        connection.settimeout(self.silence_seconds)  # a frame begun is finished promptly, or the stage is silent
        try:
            message = wire.receive_message(connection)
        except (wire.ConnectionClosed, OSError) as error:
            raise StageSilent(f"stage {index}'s cancel connection broke ({error or type(error).__name__})") from None
        except wire.ProtocolError as error:
            raise StageSilent(f"stage {index} sent a bad frame on its cancel connection: {error}") from None
        finally:
            try:
                connection.settimeout(None)
            except OSError:
                pass
        if not isinstance(message, Alive) or message.stage_index != index or not 0 < message.number <= self._number:
            raise StageSilent(f"stage {index} sent {message!r:.80} on its cancel connection, not its Alive")
        self._unanswered.pop(index, None)

    def _check(self, now: float) -> None:
        for index, since in self._unanswered.items():
            if now - since >= self.silence_seconds:
                raise StageSilent(f"stage {index} is silent: no answer to the coordinator's ping for "
                                  f"{now - since:.0f} s (a frozen process or machine, or a cut link)")

    def _ping(self, now: float) -> None:
        self._number += 1
        for index, connection in enumerate(self.connections):
            try:
                wire.send_message(connection, Ping(self._number))
            except OSError as error:
                raise StageSilent(f"stage {index}'s cancel connection broke ({error})") from None
            self._unanswered.setdefault(index, now)
