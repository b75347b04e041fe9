"""The per-token path: a chain of TCP sockets through the stages.

coordinator -> stage 0 -> stage 1 -> ... -> last stage -> coordinator. The
coordinator sends each pass to stage 0 and reads the logits back from the last
stage. Each stage also keeps a
connection on which the coordinator cancels passes (orchestrator.workers.stage_server).
Ray is not on this path: a plain actor call costs ~1-2 ms on these machines,
as much as a whole stage of a small model (orchestrator.transport.wire frames the
messages).
"""

from __future__ import annotations

import collections
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from orchestrator.transport import wire
from orchestrator.transport.handshake import (
    RESULT_ROLE,
    HandshakeError,
    accept_peer,
    cancel_role,
    connect_peer,
    upstream_role,
)
from orchestrator.config import (
    CONNECT_SECONDS,
    PASS_DEADLINE_FACTOR,
    PASS_DEADLINE_MINIMUM_SECONDS,
    SHUTDOWN_SECONDS,
)
from orchestrator.transport.messages import Cancel, Cancelled, PassResult, Shutdown, StageBatch, StageFailure
from orchestrator.transport.ledger import KvLedger, PassRecord
from orchestrator.transport.liveness import StageDeadlines, StageLiveness, StageSilent
from speculators.tree import accepted_rows
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
class _InFlight:
    """A pass in flight: its id, what was sent (kept until its result comes back:
    a lost chain's passes are sent again), when, and whether another pass was
    in flight at the same time (then wall time minus compute is not transport),
    and whether it was cancelled."""

    pass_id: int
    record: PassRecord
    started: float
    overlapped: bool
    cancelled: bool = False


def result_problem(record: PassRecord, reply: PassResult, n_vocab: int, stage_count: int) -> str:
    """What is wrong with a last stage's result for ``record``, or "": the
    logits' shape, or the chosen tokens (1 to rows ids in the vocabulary,
    beginning with the drafts they accept), and one time per stage."""
    if len(reply.stage_seconds) != stage_count:
        return f"{len(reply.stage_seconds)} stage times (expected {stage_count})"
    rows = len(record.logit_rows)
    if record.choice is None:
        expected = (rows, n_vocab)
        if reply.logits is None or reply.logits.shape != expected:
            shape = "tokens" if reply.logits is None else f"logits of shape {reply.logits.shape}"
            return f"{shape} (expected logits of shape {expected})"
        return ""
    tokens = reply.tokens
    if tokens is None:
        return "logits (expected the tokens it chose)"
    if not 1 <= len(tokens) <= rows or tokens.min() < 0 or tokens.max() >= n_vocab:
        return f"{len(tokens)} tokens {tokens[:4].tolist()} (expected 1 to {rows} ids below {n_vocab})"
    choice = record.choice
    if choice.parents is None and not np.array_equal(tokens[:-1], choice.drafts[:len(tokens) - 1]):
        return "tokens that do not begin with the accepted drafts"
    if choice.parents is not None and len(accepted_rows([0, *choice.drafts.tolist()], choice.parents,
                                                        tokens.tolist())) != len(tokens) - 1:
        return "tokens that do not follow a path of the tree"
    return _logprobs_problem(choice.top_logprobs, reply, n_vocab)


def _logprobs_problem(top: int, reply: PassResult, n_vocab: int) -> str:
    """What is wrong with a result's logprobs when ``top`` alternatives were asked (-1: none), or ""."""
    if (top >= 0) != (reply.logprobs is not None):
        return "logprobs that were not asked for" if top < 0 else "no logprobs (they were asked for)"
    if reply.logprobs is None:
        return ""
    problem = reply.logprobs.check(len(reply.tokens), top)
    if not problem and len(reply.logprobs.top_tokens.ravel()) and (
            reply.logprobs.top_tokens.min() < 0 or reply.logprobs.top_tokens.max() >= n_vocab):
        problem = f"alternatives outside the vocabulary of {n_vocab}"
    return problem


class SocketChain:
    """The coordinator's ends of the chain: one socket to stage 0, one from the
    last stage, and one to each stage for its cancels."""

    def __init__(self, host: str, secret: bytes, n_vocab: int, ledger: KvLedger | None = None, certificate=None,
                 deadlines: StageDeadlines = StageDeadlines()):
        """Listen on ``host`` (this machine's address) for the last stage and the
        cancel connections; every connection proves it holds the pipeline's ``secret``.
        n_vocab: the width of every result's logits (checked on receipt).
        ledger: settles each pass whose result came back (what the stages
        cache, for a replay; a new chain after a lost stage takes the old one's).
        certificate: the pipeline's tls.ChainCertificate with --tls (every connection in TLS), else None.
        deadlines: how soon a silent stage is found out (liveness.StageDeadlines)."""
        self.secret = secret
        self.certificate = certificate
        self.n_vocab = n_vocab
        self.ledger = ledger if ledger is not None else KvLedger()
        self.listener = wire.listen(host)
        self.listener.settimeout(CONNECT_SECONDS)
        self.address = (host, self.listener.getsockname()[1])
        self._to_first: socket.socket | None = None
        self._from_last: socket.socket | None = None
        self._cancels: list[socket.socket] = []  # to each stage, in stage order
        self._liveness = StageLiveness(self._cancels, deadlines=deadlines)  # pings them while a result is awaited
        self._pass_id = 0
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self.stage_count = 0
        # Wall time of passes minus the stages' own compute: the transport cost
        # of all stage_count + 1 hops, over the passes that ran alone.
        self.transport_seconds = 0.0
        self.passes_alone = 0
        self.slowest_pass_seconds = 0.0  # wall time of the slowest pass received (sets the deadline)
        self.deadline_minimum = PASS_DEADLINE_MINIMUM_SECONDS

    def take_timing_from(self, old: SocketChain) -> None:
        """Go on from a lost chain's figures: its deadline and its hop times."""
        self.deadline_minimum = old.deadline_minimum
        self.slowest_pass_seconds = old.slowest_pass_seconds
        self.transport_seconds = old.transport_seconds
        self.passes_alone = old.passes_alone

    def connect_first(self, host: str, port: int) -> None:
        with _setting_up():
            self._to_first = connect_peer(host, port, self.secret, upstream_role(0), CONNECT_SECONDS, self.certificate)

    def accept_last(self, stage_count: int) -> None:
        """The last stage has been told to connect here."""
        self.stage_count = stage_count
        self._from_last = self._accept(RESULT_ROLE)

    def accept_cancel(self) -> None:
        """The next stage (in stage order) has been told to connect here to take cancels."""
        self._cancels.append(self._accept(cancel_role(len(self._cancels))))

    def _accept(self, role: str) -> socket.socket:
        with _setting_up():
            return accept_peer(self.listener, self.secret, role, CONNECT_SECONDS, self.certificate)

    def send(self, record: PassRecord, more: int = 0) -> int:
        """Start a pass (replay.PassRecord: one KV sequence's tokens at their
        positions, after each stage drops the sequence's cache from keep on;
        the last stage returns the logits of its logit rows, or the tokens it
        chose from them when the record has a choice), or a release (no
        positions: every stage drops the sequence, in order with the passes
        around it; no result is handed out for it). more: the next ``more``
        records are decoded with this one (a batched pass, StageBatch.more;
        each keeps its own result). Returns its id; results come back in order. If the chain is broken the pass stays in flight
        (``unanswered``) and PassLate is raised."""
        self._pass_id += 1
        batch = StageBatch(self._pass_id, record.keep, record.positions, record.logit_rows, tokens=record.tokens,
                           sequence=record.sequence, choice=record.choice, parents=record.parents, more=more,
                           source=record.source)
        overlapping = bool(self._in_flight)
        for entry in self._in_flight:
            entry.overlapped = True
        self._in_flight.append(_InFlight(self._pass_id, record, time.perf_counter(), overlapping))
        try:
            wire.send_message(self._to_first, batch)
        except OSError as error:
            raise PassLate(f"the chain broke while sending pass {batch.pass_id} ({error})") from None
        return self._pass_id

    def cancel(self, record: PassRecord) -> None:
        """Tell every stage that the pass in flight of ``record`` is no longer
        wanted (nothing if its result is in, or it is a release). Best effort:
        its result may still come whole; a broken connection shows at receive."""
        for entry in self._in_flight:
            if entry.record is record and not entry.cancelled and record.gives_result:
                entry.cancelled = True
                for connection in self._cancels:
                    try:
                        wire.send_message(connection, Cancel(entry.pass_id))
                    except OSError:
                        pass
                return

    def cancel_origin(self, origin: object) -> None:
        """Cancel the passes in flight that carry out ``origin`` (PassRecord.origin; several: a batched pass)."""
        for record in [entry.record for entry in self._in_flight if entry.record.origin is origin]:
            self.cancel(record)

    def next_origin(self) -> object | None:
        """The decision the oldest pass in flight carries out (PassRecord.origin), releases passed over."""
        return next((entry.record.origin for entry in self._in_flight if entry.record.gives_result), None)

    def holds(self, record: PassRecord) -> bool:
        """``record`` was sent and its result has not been received."""
        return any(entry.record is record for entry in self._in_flight)

    @property
    def deadline_seconds(self) -> float:
        """How long the oldest pass's result may take (defaults.PASS_DEADLINE_*)."""
        return max(self.deadline_minimum, PASS_DEADLINE_FACTOR * self.slowest_pass_seconds)

    def _receive_within_deadline(self, sock: socket.socket, what: str):
        """The next message on ``sock`` within the pass deadline, the stages
        pinged meanwhile (PassLate as soon as one is silent: transport.liveness)."""
        started = time.monotonic()
        try:
            arrived = self._liveness.wait(sock, self.deadline_seconds)
        except StageSilent as silent:
            raise PassLate(f"no {what}: {silent}") from None
        if not arrived:
            raise PassLate(f"no {what} within the deadline of {self.deadline_seconds:.0f} s")
        sock.settimeout(max(1.0, self.deadline_seconds - (time.monotonic() - started)))  # the frame begun, whole
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

    def result_within(self, seconds: float) -> bool:
        """Whether the last stage has sent something within ``seconds`` (the
        oldest pass's result, as a rule); True where a stage is silent or the
        chain broke, for receive to find out."""
        try:
            return self._liveness.wait(self._from_last, seconds)
        except (StageSilent, OSError, ValueError):
            return True

    def receive(self) -> PassResult | Cancelled:
        """The result of the oldest pass in flight (releases before it are
        passed over); for a cancelled pass, its result or a ``Cancelled`` with
        a time for every stage."""
        while True:
            reply = self._receive_oldest()
            if reply is not None:
                return reply

    def _receive_oldest(self) -> PassResult | Cancelled | None:
        entry = self._in_flight[0]  # stays in flight until its result is in: a broken chain sends it again
        try:
            reply = self._receive_within_deadline(self._from_last, f"result of pass {entry.pass_id}")
        except wire.ProtocolError as error:
            raise PipelineError(f"{self._last_stage} sent a bad frame: {error}") from None
        if isinstance(reply, StageFailure):
            self._in_flight.popleft()
            self.ledger.settle(entry.record, decoded=False)
            raise PipelineError(f"stage {reply.stage_index} failed: {reply.message}")
        if isinstance(reply, Cancelled) and reply.pass_id == entry.pass_id:
            return self._cancelled(entry, reply)
        if not isinstance(reply, PassResult) or reply.pass_id != entry.pass_id:
            raise PipelineError(f"{self._last_stage} sent {type(reply).__name__} {getattr(reply, 'pass_id', '')} "
                                f"in reply to pass {entry.pass_id}")
        problem = result_problem(entry.record, reply, self.n_vocab, self.stage_count)
        if problem:
            raise PipelineError(f"{self._last_stage} sent {problem} for pass {entry.pass_id}")
        self._in_flight.popleft()
        self.ledger.settle(entry.record, decoded=True)
        if not entry.record.gives_result:
            return None
        self.slowest_pass_seconds = max(self.slowest_pass_seconds, time.perf_counter() - entry.started)
        if not entry.overlapped:  # wall time minus compute is transport only for a pass that ran alone
            self.transport_seconds += time.perf_counter() - entry.started - sum(reply.stage_seconds)
            self.passes_alone += 1
        return reply

    def _cancelled(self, entry: _InFlight, reply: Cancelled) -> Cancelled:
        """A pass dropped or stopped by a stage: some stages cached it, some
        did not, so it settles as not decoded (replay.KvLedger)."""
        if not entry.cancelled:
            raise PipelineError(f"stage {reply.stage_index} dropped pass {entry.pass_id}, which was not cancelled")
        if reply.stage_index >= self.stage_count or len(reply.stage_seconds) != reply.stage_index + 1:
            raise PipelineError(f"{self._last_stage} sent a cancellation of pass {entry.pass_id} by stage "
                                f"{reply.stage_index} with {len(reply.stage_seconds)} stage times")
        self._in_flight.popleft()
        self.ledger.settle(entry.record, decoded=False)
        padding = (0.0,) * (self.stage_count - len(reply.stage_seconds))
        started = reply.stage_started + padding if reply.stage_started else ()
        return Cancelled(reply.pass_id, reply.stage_index, reply.stage_seconds + padding, started)

    @property
    def _last_stage(self) -> str:
        """The last stage, as an error names it."""
        return f"the last stage (stage {self.stage_count - 1})"

    @property
    def in_flight(self) -> int:
        """Passes (and releases) sent whose results have not been received."""
        return len(self._in_flight)

    def unanswered(self) -> list[PassRecord]:
        """What was sent and has no result yet, oldest first (a new chain sends it again)."""
        return [entry.record for entry in self._in_flight]

    def cancelled_unanswered(self) -> list[PassRecord]:
        """Those of ``unanswered`` that were cancelled (a new chain cancels them again)."""
        return [entry.record for entry in self._in_flight if entry.cancelled]

    @property
    def hop_seconds(self) -> float:
        """Mean transport time of one hop, over the passes that ran alone so far."""
        hops = self.passes_alone * (self.stage_count + 1)
        return self.transport_seconds / hops if hops else 0.0

    def close(self, shutdown: bool = True) -> None:
        """Send Shutdown down the chain (each stage closes in turn), then close
        our ends. Without ``shutdown`` (a broken chain being replaced) the
        sockets are just closed: each surviving stage sees its chain end and
        waits to be wired again."""
        if shutdown and self._to_first is not None and self._from_last is not None:
            try:
                wire.send_message(self._to_first, Shutdown())
                self._from_last.settimeout(SHUTDOWN_SECONDS)
                wire.receive_message(self._from_last)
            except (OSError, wire.ConnectionClosed):
                pass
        for connection in (self._to_first, self._from_last, *self._cancels):
            if connection is not None:
                connection.close()
        self._to_first = self._from_last = None
        self._cancels = []
        self.listener.close()
