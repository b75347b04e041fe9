"""The per-token path: a chain of TCP sockets through the stages.

coordinator -> stage 0 -> stage 1 -> ... -> last stage -> coordinator. The
coordinator sends each pass to stage 0 and reads the logits back from the last
stage; with boundary notices, each non-last stage also reports every pass
leaving it (async drafting uses the moment). Ray is not on this path: a plain
actor call costs ~1-2 ms on these machines, as much as a whole stage of a small
model (orchestrator.wire frames the messages).
"""

from __future__ import annotations

import collections
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from orchestrator import wire
from orchestrator.handshake import RESULT_ROLE, HandshakeError, accept_peer, boundary_role, connect_peer, upstream_role
from orchestrator.defaults import (
    CONNECT_SECONDS,
    PASS_DEADLINE_FACTOR,
    PASS_DEADLINE_MINIMUM_SECONDS,
    SHUTDOWN_SECONDS,
)
from orchestrator.messages import Boundary, PassResult, Shutdown, StageBatch, StageFailure
from stages.errors import SpecpipeError


class PipelineError(SpecpipeError):
    """A pipeline could not start or run; the message is one line."""


@contextlib.contextmanager
def _setting_up() -> Iterator[None]:
    """A connection of the chain that cannot be made (or proved) is one PipelineError."""
    try:
        yield
    except (HandshakeError, OSError) as error:
        raise PipelineError(f"the chain could not be set up: {error}") from None


class PassLate(PipelineError):
    """No result within the pass deadline, or the chain broke: the Pipeline asks
    Ray which stage is dead or hung and names it."""


@dataclass
class _Timing:
    """A pass in flight: its id, when it was sent, and whether another pass was
    in flight at the same time (then wall time minus compute is not transport)."""

    pass_id: int
    started: float
    overlapped: bool
    release: bool = False  # a sequence's release: its (empty) result is not handed out


class SocketChain:
    """The coordinator's ends of the chain: one socket to stage 0, one from the
    last stage, and one from each non-last stage for boundary notices."""

    def __init__(self, host: str, secret: bytes):
        """Listen on ``host`` (this machine's address) for the last stage and the
        notices; every connection proves it holds the pipeline's ``secret``."""
        self.secret = secret
        self.listener = wire.listen(host)
        self.listener.settimeout(CONNECT_SECONDS)
        self.address = (host, self.listener.getsockname()[1])
        self._to_first: socket.socket | None = None
        self._from_last: socket.socket | None = None
        self._boundaries: list[socket.socket] = []
        self._boundary_seen: list[int] = []  # last pass id each stage reported
        self._pass_id = 0
        self._in_flight: collections.deque[_Timing] = collections.deque()
        self.stage_count = 0
        # Wall time of passes minus the stages' own compute: the transport cost
        # of all stage_count + 1 hops, over the passes that ran alone.
        self.transport_seconds = 0.0
        self.passes_alone = 0
        self.slowest_pass_seconds = 0.0  # wall time of the slowest pass received (sets the deadline)
        self.deadline_minimum = PASS_DEADLINE_MINIMUM_SECONDS

    def connect_first(self, host: str, port: int) -> None:
        with _setting_up():
            self._to_first = connect_peer(host, port, self.secret, upstream_role(0), CONNECT_SECONDS)

    def accept_last(self, stage_count: int) -> None:
        """The last stage has been told to connect here."""
        self.stage_count = stage_count
        self._from_last = self._accept(RESULT_ROLE)

    def accept_boundary(self) -> None:
        """The next non-last stage (in stage order) has been told to connect here for its notices."""
        self._boundaries.append(self._accept(boundary_role(len(self._boundaries))))
        self._boundary_seen.append(0)

    def _accept(self, role: str) -> socket.socket:
        with _setting_up():
            return accept_peer(self.listener, self.secret, role, CONNECT_SECONDS)

    def send(self, positions: np.ndarray, tokens: np.ndarray, keep: int, logit_rows: np.ndarray,
             sequence: int = 0) -> int:
        """Start a pass of one KV sequence's tokens int32[n] at positions
        int32[n]; each stage first drops the sequence's cached positions >=
        keep; the last returns the logits of logit_rows int32[rows]. Returns
        its id; results come back in order."""
        return self._send(StageBatch(self._pass_id + 1, keep, positions, logit_rows, tokens=tokens, sequence=sequence))

    def release(self, sequence: int) -> None:
        """Every stage drops all of a KV sequence's cache (in order with the
        passes before and after it); no result is handed out for it."""
        empty = np.empty(0, np.int32)
        self._send(StageBatch(self._pass_id + 1, 0, empty, empty, tokens=empty, sequence=sequence), release=True)

    def _send(self, batch: StageBatch, release: bool = False) -> int:
        self._pass_id = batch.pass_id
        overlapping = bool(self._in_flight)
        for entry in self._in_flight:
            entry.overlapped = True
        self._in_flight.append(_Timing(self._pass_id, time.perf_counter(), overlapping, release))
        try:
            wire.send_message(self._to_first, batch)
        except OSError as error:
            raise PassLate(f"the chain broke while sending pass {batch.pass_id} ({error})") from None
        return self._pass_id

    @property
    def deadline_seconds(self) -> float:
        """How long the oldest pass's result may take (defaults.PASS_DEADLINE_*)."""
        return max(self.deadline_minimum, PASS_DEADLINE_FACTOR * self.slowest_pass_seconds)

    def _receive_within_deadline(self, sock: socket.socket, what: str):
        sock.settimeout(self.deadline_seconds)
        try:
            return wire.receive_message(sock)
        except TimeoutError:
            raise PassLate(f"no {what} within the deadline of {self.deadline_seconds:.0f} s") from None
        except (wire.ConnectionClosed, OSError) as error:
            raise PassLate(f"the chain broke while waiting for the {what} ({error or type(error).__name__})") from None
        finally:
            try:
                sock.settimeout(None)
            except OSError:
                pass

    def await_boundary(self, stage_index: int) -> int:
        """Block until the next pass has left stage ``stage_index``; return its id
        (needs boundary notices). receive() consumes notices not awaited."""
        try:
            notice = self._receive_within_deadline(self._boundaries[stage_index], f"notice from stage {stage_index}")
        except wire.ProtocolError as error:
            raise PipelineError(f"stage {stage_index} sent a bad boundary notice: {error}") from None
        if not isinstance(notice, Boundary) or notice.pass_id != self._boundary_seen[stage_index] + 1:
            raise PipelineError(f"stage {stage_index} reported {notice} after pass {self._boundary_seen[stage_index]}")
        self._boundary_seen[stage_index] = notice.pass_id
        return notice.pass_id

    def receive(self) -> PassResult:
        """The logits of the oldest pass in flight (releases before it are passed over)."""
        while True:
            reply = self._receive_oldest()
            if reply is not None:
                return reply

    def _receive_oldest(self) -> PassResult | None:
        entry = self._in_flight.popleft()
        for stage_index in range(len(self._boundaries)):
            while self._boundary_seen[stage_index] < entry.pass_id:
                self.await_boundary(stage_index)
        try:
            reply = self._receive_within_deadline(self._from_last, f"result of pass {entry.pass_id}")
        except wire.ProtocolError as error:
            raise PipelineError(f"the last stage (stage {self.stage_count - 1}) sent a bad frame: {error}") from None
        if isinstance(reply, StageFailure):
            raise PipelineError(f"stage {reply.stage_index} failed: {reply.message}")
        if not isinstance(reply, PassResult) or reply.pass_id != entry.pass_id:
            raise PipelineError(f"unexpected reply {type(reply).__name__} to pass {entry.pass_id}")
        if entry.release:
            return None
        self.slowest_pass_seconds = max(self.slowest_pass_seconds, time.perf_counter() - entry.started)
        if not entry.overlapped:  # wall time minus compute is transport only for a pass that ran alone
            self.transport_seconds += time.perf_counter() - entry.started - sum(reply.stage_seconds)
            self.passes_alone += 1
        return reply

    @property
    def in_flight(self) -> int:
        """Passes (and releases) sent whose results have not been received."""
        return len(self._in_flight)

    @property
    def hop_seconds(self) -> float:
        """Mean transport time of one hop, over the passes that ran alone so far."""
        hops = self.passes_alone * (self.stage_count + 1)
        return self.transport_seconds / hops if hops else 0.0

    def close(self) -> None:
        """Send Shutdown down the chain (each stage closes in turn), then close our ends."""
        if self._to_first is not None and self._from_last is not None:
            try:
                wire.send_message(self._to_first, Shutdown())
                self._from_last.settimeout(SHUTDOWN_SECONDS)
                wire.receive_message(self._from_last)
            except (OSError, wire.ConnectionClosed):
                pass
        for connection in (self._to_first, self._from_last, *self._boundaries):
            if connection is not None:
                connection.close()
        self._to_first = self._from_last = None
        self._boundaries = []
        self.listener.close()
