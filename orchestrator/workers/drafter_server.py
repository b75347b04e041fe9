"""A speculator behind a socket, drafting in a thread, best effort.

Plain class, no Ray (the Ray actor in orchestrator.cluster.pipeline builds one beside
its stage). The coordinator connects and sends:

* ``SpeculateFrom(epoch, context, most)``: start extending ``context`` now,
  by at most ``most`` tokens;
* ``CollectDraft(epoch, wait)``: reply at once with what has been drafted for
  that epoch, and stop drafting (the machine's stage is about to run). With
  ``wait`` the drafting is first allowed to finish by itself (up to
  ``draft_max`` or the speculator's own stop), for at most ``wait_seconds``.

The socket is served by its own thread, so a speculator that is slow, hangs
or raises never delays a reply: the reply is whatever exists by then. A result
computed for an older epoch is thrown away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from orchestrator.transport import wire
from speculators import Speculator
from orchestrator.transport.handshake import HandshakeError, accept_peer, drafter_role
from orchestrator.config import CONNECT_SECONDS, DRAFTER_WAIT_SECONDS
from orchestrator.transport.messages import CollectDraft, DraftReply, Shutdown, SpeculateFrom


class DrafterServer:
    def __init__(
        self,
        make_speculator: Callable[[], Speculator],
        host: str,
        *,
        draft_max: int,
        overlap: bool = False,
        wait_seconds: float = DRAFTER_WAIT_SECONDS,
        secret: bytes,
        certificate=None,
        index: int = 0,
    ):
        """secret: the pipeline's; the coordinator's connection must prove it holds it.
        certificate: the pipeline's tls.ChainCertificate with --tls, else None.
        index: the stage this drafter sits beside (its connection's role names it)."""
        self.secret = secret
        self.role = drafter_role(index)
        self.certificate = certificate
        self.speculator = make_speculator()
        self.draft_max = draft_max
        self._most = draft_max  # of the current request (SpeculateFrom.most)
        self.overlap = overlap
        self.wait_seconds = wait_seconds
        self.listener = wire.listen(host)
        self.port = self.listener.getsockname()[1]
        self.busy_seconds = 0.0
        self.drafted_tokens = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._epoch = -1
        self._context: list[int] = []
        self._extension: list[int] = []
        self._drafting = False  # allowed to draft now
        self._finished = threading.Event()  # drafting stopped by itself for this epoch
        self._error = ""
        self._closed = False
        self._stalled = False  # a wait timed out: the speculator is stuck; stop waiting for it
        threading.Thread(target=self._draft_loop, name="drafting", daemon=True).start()
        threading.Thread(target=self._serve, name="drafter-socket", daemon=True).start()

    def compute(self) -> dict | None:
        """Where a draft model computes (its threads, backend, devices, layers
        on a GPU: stages.backend.StageCompute); None for a speculator without one."""
        engine = getattr(self.speculator, "engine", None)
        return None if engine is None else {"threads": engine.settings.threads, **engine.compute.record()}

    @property
    def stalled(self) -> bool:
        """A synchronous wait timed out and no token has been produced since."""
        return self._stalled

    # -- the socket -------------------------------------------------------
    def _serve(self) -> None:
        try:
            connection = accept_peer(self.listener, self.secret, self.role, CONNECT_SECONDS, self.certificate)
        except HandshakeError:
            with self._lock:
                self._closed = True
            return
        try:
            while True:
                try:
                    message = wire.receive_message(connection)
                except (wire.ConnectionClosed, wire.ProtocolError, OSError):  # a bad frame: the peer is out of step
                    return
                if isinstance(message, SpeculateFrom):
                    self._start(message)
                elif isinstance(message, CollectDraft):
                    wire.send_message(connection, self._collect(message))
                elif isinstance(message, Shutdown):
                    return
        finally:
            with self._lock:
                self._closed = True
                self._wake.notify_all()
            connection.close()
            self.listener.close()

    def _start(self, message: SpeculateFrom) -> None:
        with self._lock:
            self._epoch = message.epoch
            self._context = message.context.tolist()
            self._most = min(message.most or self.draft_max, self.draft_max)
            self._extension = []
            self._error = ""
            self._drafting = True
            self._finished.clear()
            self._wake.notify_all()

    def _collect(self, message: CollectDraft) -> DraftReply:
        if message.wait and not self._stalled:
            self._stalled = not self._finished.wait(self.wait_seconds)
        with self._lock:
            current = message.epoch == self._epoch
            tokens = list(self._extension) if current else []
            if current and not self.overlap:
                self._drafting = False
            return DraftReply(message.epoch, np.asarray(tokens, dtype=np.int32), self.busy_seconds, self._error)

    # -- drafting ---------------------------------------------------------
    def _draft_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not (self._drafting and len(self._extension) < self._most):
                    if self._drafting:  # reached the most asked for
                        self._drafting = False
                        self._finished.set()
                    self._wake.wait()
                if self._closed:
                    return
                epoch = self._epoch
                context = self._context + self._extension
            started = time.perf_counter()
            try:
                token = self.speculator.extend(context)
                error = ""
            except Exception as failure:  # a drafter's failure must never stop generation
                token, error = None, f"{type(failure).__name__}: {failure}"
            finally:
                self.busy_seconds += time.perf_counter() - started
                self._stalled = False
            if token is not None:
                self.drafted_tokens += 1  # computed, whether or not it is still wanted
            with self._lock:
                if epoch != self._epoch or not self._drafting:
                    continue  # the text moved on while this token was computed
                if token is None:
                    self._drafting = False
                    self._error = error
                    self._finished.set()
                else:
                    self._extension.append(token)
