"""A speculator behind a socket, drafting in a thread, best effort.

Plain class, no Ray (the Ray actor in orchestrator.cluster.drafters builds one beside
its stage). The coordinator connects and sends, for KV sequence ``sequence``
(one per request the drafter drafts for; 0 in a run):

* ``SpeculateFrom(epoch, context, most, sequence)``: start extending
  ``context`` now, by at most ``most`` tokens; with ``forks``, a draft model
  also drafts corrections at those positions of the context, a round at a
  time beside the chain (speculators.corrections);
* ``CollectDraft(epoch, wait, sequence)``: reply at once with what has been
  drafted for that epoch, and stop drafting it (the machine's stage is about
  to run). With ``wait`` the drafting is first allowed to finish by itself
  (up to ``most``, at most chain_reach(draft_max), or the speculator's own stop), for at most ``wait_seconds``.

The socket is served by its own thread, so a speculator that is slow, hangs
or raises never delays a reply: the reply is whatever exists by then. A result
computed for an older epoch is thrown away. One drafting thread serves the
sequences in turn, a token each, or a round of a chain and its corrections
(a draft model's sequences share its engine: speculators.model.ModelSpeculator.sibling).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from orchestrator.transport import wire
from speculators import Speculator
from orchestrator.transport.handshake import HandshakeError, accept_peer, drafter_role
from orchestrator.config import CONNECT_SECONDS, DRAFTER_WAIT_SECONDS, chain_reach
from orchestrator.transport.messages import CollectDraft, DraftReply, Shutdown, SpeculateFrom
from speculators.corrections import CorrectionGrowth, Corrections, Forks
from speculators.sampling import SamplingSettings
from speculators.tree import DraftTree, TreeAsk
from stages.tree_shape import main_chain_length


@dataclass
class _Request:
    """What one KV sequence's drafting stands at."""

    speculator: Speculator
    epoch: int = -1
    context: list[int] = field(default_factory=list)
    extension: list[int] = field(default_factory=list)
    most: int = 0  # of the current request (SpeculateFrom.most)
    drafting: bool = False  # allowed to draft now
    finished: threading.Event = field(default_factory=threading.Event)  # stopped by itself for this epoch
    error: str = ""
    sampling: SamplingSettings | None = None  # coupled drafting (SpeculateFrom.sampling)
    tree_ask: TreeAsk | None = None  # grow a tree (SpeculateFrom.tree), in one go
    tree: DraftTree | None = None  # the tree grown for this epoch
    forks: Forks | None = None  # draft corrections there too (SpeculateFrom.forks), a round at a time
    growth: CorrectionGrowth | None = None  # the main chain and corrections being grown for this epoch
    corrections: Corrections = field(default_factory=dict)  # what the growth's rounds drafted so far

    @property
    def wants(self) -> bool:
        if self.tree_ask is not None:
            return self.drafting and self.tree is None
        if self.correcting:
            return self.drafting and (self.growth is None or not self.growth.done)
        return self.drafting and len(self.extension) < self.most

    @property
    def correcting(self) -> bool:
        """Its drafting grows corrections beside the chain: asked, and a draft
        model with KV ids to fork them in (prompt lookup has no runners-up)."""
        engine = getattr(self.speculator, "engine", None)
        return (self.forks is not None and hasattr(self.speculator, "runners_up") and engine is not None
                and engine.tree_sequences > 0)


def _speculators(make_speculator: Callable[[], Speculator], sequences: int) -> list[Speculator]:
    """One speculator per KV sequence: the first made, the others its siblings
    (sharing its model) where it has them, else made alike."""
    first = make_speculator()
    sibling = getattr(first, "sibling", None)
    return [first, *(sibling(sequence) if sibling else make_speculator() for sequence in range(1, sequences))]


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
        sequences: int = 1,
    ):
        """secret: the pipeline's; the coordinator's connection must prove it holds it.
        certificate: the pipeline's tls.ChainCertificate with --tls, else None.
        index: the stage this drafter sits beside (its connection's role names it).
        sequences: the KV sequences (requests) it drafts for."""
        self.secret = secret
        self.role = drafter_role(index)
        self.certificate = certificate
        self._requests = [_Request(speculator) for speculator in _speculators(make_speculator, sequences)]
        self.speculator = self._requests[0].speculator
        self.draft_max = draft_max
        self.overlap = overlap
        self.wait_seconds = wait_seconds
        self.listener = wire.listen(host)
        self.port = self.listener.getsockname()[1]
        self.busy_seconds = 0.0
        self.drafted_tokens = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._turn = 0  # the sequence the drafting thread looks at first
        self._closed = False
        self._stalled = False  # a wait timed out: the speculator is stuck; stop waiting for it
        threading.Thread(target=self._draft_loop, name="drafting", daemon=True).start()
        threading.Thread(target=self._serve, name="drafter-socket", daemon=True).start()

    @property
    def stalled(self) -> bool:
        """A synchronous wait timed out and no token has been produced since."""
        return self._stalled

    def compute(self) -> dict | None:
        """Where a draft model computes (its file on this machine, its threads,
        backend, devices, layers on a GPU: stages.backend.StageCompute); None for a speculator without one."""
        engine = getattr(self.speculator, "engine", None)
        if engine is None:
            return None
        return {"path": engine.path, "threads": engine.settings.threads, **engine.compute.record()}

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
                except wire.ProtocolError as error:  # a bad frame: the peer is out of step
                    print(f"{self.role}: a bad frame from the coordinator, connection closed: {error}",
                          file=sys.stderr, flush=True)  # to the worker's log: the coordinator sees a reset
                    return
                except (wire.ConnectionClosed, OSError):
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
        if message.sequence >= len(self._requests):
            return  # its collect says so
        with self._lock:
            request = self._requests[message.sequence]
            request.epoch = message.epoch
            request.context = message.context.tolist()
            request.most = min(message.most or self.draft_max, chain_reach(self.draft_max))
            request.extension = []
            request.error = ""
            request.sampling, request.tree_ask, request.tree = message.sampling, message.tree, None
            request.forks, request.growth, request.corrections = message.forks, None, {}
            request.drafting = True
            request.finished.clear()
            self._wake.notify_all()

    def _collect(self, message: CollectDraft) -> DraftReply:
        if message.sequence >= len(self._requests):
            return DraftReply(message.epoch, np.zeros(0, np.int32), self.busy_seconds,
                              f"no KV sequence {message.sequence} here (it drafts for {len(self._requests)})",
                              message.sequence)
        request = self._requests[message.sequence]
        if message.wait and not self._stalled:
            self._stalled = not request.finished.wait(self.wait_seconds)
        with self._lock:
            current = message.epoch == request.epoch
            tokens = list(request.extension) if current else []
            if current and not self.overlap and not message.keep:
                request.drafting = False
            tree = request.tree if current and request.tree_ask is not None else None
            if tree is not None and not tree.is_chain:
                return DraftReply(message.epoch, np.asarray(tree.drafts, dtype=np.int32), self.busy_seconds,
                                  request.error, message.sequence, np.asarray(tree.parents, dtype=np.int32),
                                  np.asarray(tree.ranks, dtype=np.int32))
            corrections = tuple((position, tuple(drafted)) for (position, _), drafted in sorted(request.corrections.items()))
            return DraftReply(message.epoch, np.asarray(tokens, dtype=np.int32), self.busy_seconds, request.error,
                              message.sequence, corrections=corrections if current else ())

    # -- drafting ---------------------------------------------------------
    def _next_request(self) -> _Request | None:
        """The next sequence that wants a token, in turn (under the lock); the
        ones that reached what they asked for are finished on the way."""
        count = len(self._requests)
        for offset in range(count):
            request = self._requests[(self._turn + offset) % count]
            if request.drafting and not request.wants:  # reached the most asked for
                request.drafting = False
                request.finished.set()
            elif request.wants:
                self._turn = (self._turn + offset + 1) % count
                return request
        return None

    def _grow(self, request: _Request, epoch: int, context: list[int], sampling: SamplingSettings | None,
              ask: TreeAsk, started: float) -> None:
        """A tree for one request, grown in one go within half the wait a
        collect allows (speculators.model_tree); a speculator without trees
        drafts a chain, token by token."""
        depth = min(request.most, self.draft_max)
        try:
            grow = getattr(request.speculator, "grow_tree", None)
            if grow is not None:
                tree = grow(context, rows=ask.rows, depth=depth, leaves=ask.leaves, sampling=sampling,
                            seconds=self.wait_seconds / 2, acceptance=ask.acceptance)
            else:
                drafts: list[int] = []
                while len(drafts) < depth and (token := request.speculator.extend(context + drafts, sampling)) is not None:
                    drafts.append(token)
                tree = DraftTree.chain(context[-1], drafts)
            error = ""
        except Exception as failure:  # a drafter's failure must never stop generation
            tree, error = DraftTree.chain(context[-1], []), f"{type(failure).__name__}: {failure}"
        finally:
            self.busy_seconds += time.perf_counter() - started
            self._stalled = False
        self.drafted_tokens += len(tree.drafts)
        with self._lock:
            if epoch != request.epoch or not request.drafting:
                return  # the text moved on while it grew
            request.tree, request.error = tree, error
            request.extension = tree.drafts[: main_chain_length(tree.parents) - 1]
            request.drafting = False
            request.finished.set()

    def _correct(self, request: _Request, epoch: int, step: tuple, sampling: SamplingSettings | None,
                 started: float) -> None:
        """One step of a request that drafts corrections beside its chain
        (speculators.corrections): start the growth, or grow one round; what
        the rounds drafted is what a collect returns, at any time. step: its
        growth, or (context, forks, most) to start one, read under the lock."""
        def work() -> CorrectionGrowth:
            if isinstance(step[0], CorrectionGrowth):
                step[0].round()
                return step[0]
            context, forks, most = step
            return CorrectionGrowth(request.speculator, context, forks, most, 1 + self.draft_max, sampling)

        growth, error = self._timed(work, started)
        with self._lock:
            if epoch != request.epoch or not request.drafting:
                return  # the text moved on, or it was collected, while this round ran
            if growth is None:
                request.drafting, request.error = False, error
                request.finished.set()
                return
            # the tokens the rounds drafted (a correction's first, the draft's runner-up, was drafted before)
            self.drafted_tokens += (len(growth.extension) - len(request.extension)
                                    + sum(len(tokens) - 1 for tokens in growth.corrections.values())
                                    - sum(len(tokens) - 1 for tokens in request.corrections.values()))
            request.growth = growth
            request.extension = list(growth.extension)
            request.corrections = {fork: list(tokens) for fork, tokens in growth.corrections.items()}

    def _timed(self, work: Callable[[], object], started: float) -> tuple:
        """(what ``work`` returns, "") or (None, its failure in one line): a
        drafter's failure must never stop generation. Its time since
        ``started`` counts as busy."""
        try:
            return work(), ""
        except Exception as failure:
            return None, f"{type(failure).__name__}: {failure}"
        finally:
            self.busy_seconds += time.perf_counter() - started
            self._stalled = False

    def _draft_loop(self) -> None:
        while True:
            with self._lock:
                request = self._next_request()
                while not self._closed and request is None:
                    self._wake.wait()
                    request = self._next_request()
                if self._closed:
                    return
                epoch = request.epoch
                context = request.context + request.extension
                sampling, tree_ask = request.sampling, request.tree_ask
                correcting = request.correcting
                step = (request.growth,) if request.growth is not None else (context, request.forks, request.most)
            started = time.perf_counter()
            if tree_ask is not None:
                self._grow(request, epoch, context, sampling, tree_ask, started)
                continue
            if correcting:
                self._correct(request, epoch, step, sampling, started)
                continue
            token, error = self._timed(lambda: request.speculator.extend(context, sampling), started)
            if token is not None:
                self.drafted_tokens += 1  # computed, whether or not it is still wanted
            with self._lock:
                if epoch != request.epoch or not request.drafting:
                    continue  # the text moved on while this token was computed
                if token is None:
                    request.drafting = False
                    request.error = error
                    request.finished.set()
                else:
                    request.extension.append(token)
