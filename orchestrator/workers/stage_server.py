"""A stage's serving loop: receive a batch, decode it, pass the result on.

Plain class, no Ray: the Ray actor in ``orchestrator.cluster.stage_actors`` only builds one
and runs ``serve`` in a thread. The upstream peer (the coordinator for stage 0,
the previous stage otherwise) connects to this stage's listening socket; this
stage connects to its downstream peer (the next stage, or the coordinator after
the last stage).

Cancelled passes (PipeInfer's early cancellation): the coordinator sends
``Cancel`` on a connection of its own to every stage, read by a thread beside
the serving loop. A pass cancelled before it reaches the stage is dropped
without reaching llama.cpp; one the stage is running is stopped after its current
graph node (``StageEngine.abort``). Either way a ``Cancelled`` goes downstream
in its place and later stages forward it. The stages' caches stay consistent
without more: a cancelled pass is settled as not decoded (orchestrator.transport.ledger),
and the sequence's next pass drops every position from its keep on, at every
stage, whatever each held of the cancelled one.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from orchestrator.transport import wire
from orchestrator.workers.affinity import pin_threads, process_cpus
from orchestrator.workers.busy import BusyWindow
from orchestrator.config import CONNECT_SECONDS
from orchestrator.transport.handshake import (
    RESULT_ROLE,
    HandshakeError,
    accept_peer,
    cancel_role,
    connect_peer,
    upstream_role,
)
from orchestrator.transport.messages import Cancelled, PassResult, Shutdown, StageBatch, StageFailure
from orchestrator.workers.cancels import PassCancels
from orchestrator.workers.token_chooser import TokenChooser
from speculators.logprobs import TokenLogprobs
from stages.backend import StageCompute
from stages.cost_curve import CostCurveError, StageCurve
from stages.engine import PassAborted, StageEngine, StageError
from stages.settings import StageSettings
from stages.tree_check import side_rows_exact

if TYPE_CHECKING:
    from orchestrator.transport.tls import ChainCertificate

WIRE_DTYPES = {"f32": np.float32, "f16": np.float16}



@dataclass(frozen=True)
class StageDescription:
    """Where a stage runs and what it holds.

    first_block, end_block: the stage's blocks [first_block, end_block) of the whole model.
    host, port: its listening socket for the upstream peer.
    process_id: the stage's process on its node (to name it, or to stop it in tests).
    cpus: the CPUs its process could run on when it started (orchestrator.cluster.stage_cpus pins it to some).
    compute: its llama.cpp backend, devices and offloaded layers.
    source_fingerprint: the whole model's its file was cut from ("" for a whole model).
    side_rows_exact: a stage set up for token trees computes a side row as its
    path on this machine (stages.tree_check); True where it holds no trees, and
    unchecked (True) on a GPU build, whose batches are not promised invariant.
    """

    stage_index: int
    stage_count: int
    first_block: int
    end_block: int
    node_id: str
    host: str
    port: int
    n_vocab: int
    process_id: int = 0
    cpus: tuple[int, ...] = ()
    compute: StageCompute | None = None
    source_fingerprint: str = ""
    side_rows_exact: bool = True


class StageServer:
    """One loaded stage behind a socket."""

    def __init__(self, path: str, settings: StageSettings, host: str, node_id: str, wire_dtype: str = "f32", *,
                 secret: bytes, certificate: ChainCertificate | None = None):
        """secret: the pipeline's, for the handshake of every connection (orchestrator.transport.handshake);
        certificate: the pipeline's with --tls (orchestrator.transport.tls), else None."""
        self.secret = secret
        self.certificate = certificate
        self.engine = StageEngine(path, settings)
        # --cost-curve (measurements only): the least time each pass takes, emulating other machines
        self.floor: StageCurve | None = None
        if settings.cost_curve is not None:
            try:
                self.floor = settings.cost_curve.stage(self.engine.stage_index, self.engine.stage_count)
            except CostCurveError as error:
                self.engine.close()
                raise StageError(f"{path}: {error}") from None
        # called after each pass with (compute seconds, KV cells held, sequences held, sequences in the pass,
        # busy fraction); the Ray shell records metrics
        self.on_pass: Callable[[float, int, int, int, float], None] | None = None
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.chooser: TokenChooser | None = None  # the last stage's, made at its first choice
        self.listener = wire.listen(host)
        self.busy_seconds = 0.0
        self.recent = BusyWindow()
        self.passes = 0
        self.kv_cells = 0  # KV cells and sequences held after the last pass
        self.kv_sequences = 0
        self.prefix_cells = 0  # KV cells of the sequences that keep prefixes (StageSettings.prefix_sequences)
        self._downstream: socket.socket | None = None
        self._connections: list[socket.socket] = []  # of the chain being served
        self._thread: threading.Thread | None = None
        self._downstream_ready = threading.Event()
        self.cancels = PassCancels(self.engine.abort, self.engine.stage_index)  # read by a thread of its own (connect_cancel)
        self.windows_decoded = 0  # sequences' windows over all passes (more than passes: batched passes)
        self.dropped_passes = 0  # cancelled passes this stage never started
        self.stopped_passes = 0  # cancelled passes this stage stopped mid-graph
        self.description = StageDescription(
            stage_index=self.engine.stage_index,
            stage_count=self.engine.stage_count,
            first_block=self.engine.first_block,
            end_block=self.engine.end_block,
            node_id=node_id,
            host=host,
            port=self.listener.getsockname()[1],
            n_vocab=self.engine.n_vocab,
            process_id=os.getpid(),
            cpus=process_cpus(),
            compute=self.engine.compute,
            source_fingerprint=self.engine.source_fingerprint,
            side_rows_exact=side_rows_exact(self.engine) if self._checks_trees(settings) else True,
        )

    def _checks_trees(self, settings: StageSettings) -> bool:
        """Whether to check this machine's tree rows (stages.tree_check): set up for trees, on the CPU build."""
        return settings.tree_sequences > 0 and self.engine.compute.backend == "cpu"

    def pin(self, cpus: tuple[int, ...] | None) -> None:
        """Run every thread of this process (llama.cpp's, the serving thread,
        the runtime's) on ``cpus``; None: on every CPU it started with.
        Threads made later inherit their creator's set. Where the OS cannot pin
        (orchestrator.workers.affinity: not Linux), nothing happens."""
        pin_threads(self.description.cpus if cpus is None else cpus)

    def connect_cancel(self, host: str, port: int) -> None:
        """Take cancels from the coordinator (at ``host:port``) from now on, in a thread."""
        connection = connect_peer(host, port, self.secret, cancel_role(self.engine.stage_index), CONNECT_SECONDS,
                                  self.certificate)
        self._connections.append(connection)
        threading.Thread(target=self.cancels.read, args=(connection, self.cancels.generation),
                         name=f"stage-{self.engine.stage_index}-cancels", daemon=True).start()

    def connect_downstream(self, host: str, port: int) -> None:
        """Start serving the upstream peer in a thread (it first waits for it to
        connect and prove itself), then connect to the next peer (the next
        stage, or the coordinator after the last). Every stage connects at
        once, so each must already accept while it connects on.

        Called again after the chain broke (another stage was lost), it ends
        what is left of the old chain first and keeps the loaded model and
        the listening socket: the coordinator wires a new chain through it."""
        self._end_chain()
        self.cancels.new_chain()  # pass ids start again in a new chain
        self._downstream_ready.clear()
        self._downstream = None
        self._thread = threading.Thread(target=self.serve, name=f"stage-{self.engine.stage_index}", daemon=True)
        self._thread.start()
        role = RESULT_ROLE if self.engine.is_last else upstream_role(self.engine.stage_index + 1)
        try:
            self._downstream = connect_peer(host, port, self.secret, role, CONNECT_SECONDS, self.certificate)
            self._connections.append(self._downstream)
        finally:
            self._downstream_ready.set()

    def forget(self) -> None:
        """A coordinator started again takes this stage over: end what is
        left of the old chain and free every KV sequence (the old
        coordinator's record of them died with it). The model stays loaded."""
        self._end_chain()
        self.engine.remove(0, -1)
        self.kv_cells = self.kv_sequences = self.prefix_cells = 0

    def _end_chain(self) -> None:
        """Close the connections of the chain being served and wait for its thread."""
        for connection in self._connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
            except OSError:
                pass
            connection.close()
        self._connections = []
        if self._thread is not None:
            self._thread.join(CONNECT_SECONDS)
            self._thread = None

    def serve(self) -> None:
        """Serve one chain: pass by pass until Shutdown (then the stage closes)
        or until the chain breaks (then it waits to be wired again)."""
        try:
            upstream = accept_peer(self.listener, self.secret, upstream_role(self.engine.stage_index), CONNECT_SECONDS,
                                   self.certificate)
            self._connections.append(upstream)
        except (HandshakeError, OSError):
            upstream = None
        self._downstream_ready.wait(CONNECT_SECONDS)
        downstream = self._downstream
        if upstream is None or downstream is None:
            return
        try:
            self._serve_chain(upstream, downstream)
        except OSError:  # a neighbour or the coordinator is gone: the chain is broken
            pass
        except Exception as error:  # never a silent thread death: the coordinator hears why, then the chain ends
            try:
                wire.send_message(downstream, StageFailure(0, self.engine.stage_index,
                                                           f"the stage's loop failed: {type(error).__name__}: {error}"))
            except OSError:
                pass
        finally:
            upstream.close()
            downstream.close()

    def _serve_chain(self, upstream: socket.socket, downstream: socket.socket) -> None:
        while True:
            try:
                message = wire.receive_message(upstream)
                outgoing = self._handle(message, upstream)
            except wire.ConnectionClosed:
                return
            except wire.ProtocolError as error:  # out of step with upstream: report it and stop
                wire.send_message(downstream, StageFailure(0, self.engine.stage_index,
                                                           f"a bad frame from upstream: {error}"))
                return
            for message in outgoing:
                wire.send_message(downstream, message)
                if isinstance(message, Shutdown):
                    self.close()
                    return

    def _handle(self, message, upstream: socket.socket) -> list:
        """What goes downstream for a message from upstream (a batched pass:
        its other batches are read first, then every one of its passes' outcomes, in order)."""
        if isinstance(message, StageBatch):
            return self._take_passes(batched_pass(message, upstream))
        if isinstance(message, Cancelled):  # dropped by a stage before: it is not coming here
            with self.cancels.lock:
                self.cancels.took(message.pass_id)
            return [message]
        if isinstance(message, (Shutdown, StageFailure)):
            return [message]
        return [StageFailure(0, self.engine.stage_index, f"upstream sent {type(message).__name__}, not a batch")]

    def _take_passes(self, received: list[StageBatch | Cancelled]) -> list:
        """Run the batches of one pass (several: a batched pass), in order with
        the cancellations among them; a batch cancelled before it arrived is
        dropped, and the computation stops if a cancel of all of them comes while it runs."""
        if self.cancels.problem:
            return [StageFailure(received[0].pass_id, self.engine.stage_index, self.cancels.problem)]
        running, outcomes = self.cancels.take(received, self.engine.stage_index)
        self.dropped_passes += len(outcomes)
        try:
            if running:
                outcomes.update(zip((batch.pass_id for batch in running), self.run_passes(running)))
        finally:
            self.cancels.finished()
        return in_order(received, outcomes)

    def _hold_to_curve(self, batches: list[StageBatch], started: float) -> None:
        """Under --cost-curve, sleep until the pass has lasted the curve's time
        for its width (every batch's rows) and context; a cancel ends the
        sleep (PassAborted), as it would stop the pass on the emulated machine.
        Without a curve it costs the pass nothing."""
        if self.floor is None:
            return
        width = sum(len(batch.positions) for batch in batches)
        if width == 0:
            return
        context = max(int(batch.positions.max()) for batch in batches if len(batch.positions)) + 1
        rest = self.floor.seconds(width, context) - (time.perf_counter() - started)
        if rest > 0 and self.engine.abort.wait(rest):
            raise PassAborted("cancelled while the emulated pass ran")

    def close(self) -> None:
        """The stage is done: stop listening and free the model."""
        self.listener.close()
        self.engine.close()

    def run_pass(self, batch: StageBatch) -> StageBatch | PassResult | StageFailure | Cancelled:
        """Decode one batch (or release its sequence); return what goes downstream."""
        return self.run_passes([batch])[0]

    def run_passes(self, batches: list[StageBatch]) -> list[StageBatch | PassResult | StageFailure | Cancelled]:
        """Decode batches in one llama.cpp call (one, or a batched pass of
        several sequences); return what goes downstream for each."""
        engine = self.engine
        started, wall = time.perf_counter(), time.time()
        try:
            for batch in batches:
                if batch.source is None:
                    engine.remove(batch.keep, batch.sequence)
                else:
                    engine.copy(batch.source, batch.sequence, batch.keep)
            outputs = self._decode(batches)
            # the last stage chooses the tokens of a batch with a choice: token ids travel back, not logits
            chosen = [self._chosen(batch, output) for batch, output in zip(batches, outputs)]
            self._hold_to_curve(batches, started)
        except PassAborted:
            self.stopped_passes += len(batches)
            return [Cancelled(batch.pass_id, engine.stage_index, batch.stage_seconds + (time.perf_counter() - started,),
                              batch.stage_started + (wall,))
                    for batch in batches]
        except StageError as error:
            return [StageFailure(batches[0].pass_id, engine.stage_index, str(error))]
        except Exception as error:  # never a silent thread death: the coordinator hears why
            return [StageFailure(batches[0].pass_id, engine.stage_index, f"{type(error).__name__}: {error}")]
        seconds = time.perf_counter() - started
        self.busy_seconds += seconds
        self.recent.add(time.monotonic(), seconds)
        self.passes += 1
        self.windows_decoded += len(batches)
        # read here, in the serving thread: llama.cpp's cache must not be read while it decodes
        self.kv_cells, self.kv_sequences = engine.cells_held(), engine.sequences_held()
        self.prefix_cells = engine.prefix_cells()
        if self.on_pass is not None:
            self.on_pass(seconds, self.kv_cells, self.kv_sequences, len(batches), self.recent.fraction(time.monotonic()))
        return [self._passed_on(batch, output, tokens, batch.stage_seconds + (seconds,), batch.stage_started + (wall,))
                for batch, output, tokens in zip(batches, outputs, chosen)]

    def _decode(self, batches: list[StageBatch]) -> list[np.ndarray]:
        """Each batch's rows out (hidden states, or the last stage's logit rows), from one llama_decode."""
        engine = self.engine
        if len(batches) == 1 and len(batches[0].positions) == 0:  # a release or a copy: nothing to decode
            return [np.empty((0, engine.n_vocab if engine.is_last else engine.n_embd), np.float32)]
        if len({batch.tokens is None for batch in batches}) > 1:
            raise StageError("a batched pass mixes token ids and hidden states")
        first = batches[0]
        if len(batches) == 1:  # one sequence, a chain or a tree
            hidden = None if first.hidden is None else first.hidden.astype(np.float32, copy=False)
            return [engine.decode(first.positions, tokens=first.tokens, hidden=hidden, sequence=first.sequence,
                                  logit_rows=first.logit_rows, parents=first.parents)]
        starts = np.cumsum([0] + [len(batch.positions) for batch in batches])
        output = engine.decode(
            np.concatenate([batch.positions for batch in batches]),
            tokens=None if first.tokens is None else np.concatenate([batch.tokens for batch in batches]),
            hidden=None if first.hidden is None else np.concatenate([batch.hidden for batch in batches]).astype(
                np.float32, copy=False),
            sequence=np.concatenate([np.full(len(batch.positions), batch.sequence, np.int32) for batch in batches]),
            logit_rows=np.concatenate([batch.logit_rows + start for batch, start in zip(batches, starts)]))
        if not engine.is_last:
            return [output[start:end] for start, end in zip(starts, starts[1:])]
        rows = np.cumsum([0] + [len(batch.logit_rows) for batch in batches])
        return [output[start:end] for start, end in zip(rows, rows[1:])]

    def _chosen(self, batch: StageBatch, output: np.ndarray) -> tuple[np.ndarray, TokenLogprobs | None] | None:
        """The tokens the last stage chooses for a batch with a choice, and
        their logprobs if asked (orchestrator.workers.token_chooser); else None."""
        if not self.engine.is_last or batch.choice is None:
            return None
        if self.chooser is None:
            self.chooser = TokenChooser(self.engine.vocabulary_pointer)
        return self.chooser.choose(batch.sequence, batch.choice, output)

    def _passed_on(self, batch: StageBatch, output: np.ndarray, chosen: tuple[np.ndarray, TokenLogprobs | None] | None,
                   stage_seconds: tuple[float, ...], stage_started: tuple[float, ...]) -> StageBatch | PassResult:
        """What goes downstream for a decoded batch: its result from the last stage, else its hidden states."""
        if self.engine.is_last and chosen is not None:
            return PassResult(batch.pass_id, None, stage_seconds, tokens=chosen[0], logprobs=chosen[1],
                              stage_started=stage_started)
        if self.engine.is_last:
            return PassResult(batch.pass_id, output, stage_seconds, stage_started=stage_started)
        return replace(batch, hidden=output.astype(self.wire_dtype, copy=False), tokens=None,
                       stage_seconds=stage_seconds, stage_started=stage_started)


def batched_pass(first: StageBatch, upstream: socket.socket) -> list[StageBatch | Cancelled]:
    """``first`` and the ``first.more`` batches decoded with it (StageBatch.more),
    with the cancellations a stage before sent in their places."""
    received: list[StageBatch | Cancelled] = [first]
    waiting = first.more
    while waiting:
        message = wire.receive_message(upstream)
        if isinstance(message, StageBatch) and message.more == waiting - 1:
            waiting -= 1
        elif not isinstance(message, Cancelled):
            raise wire.ProtocolError(f"a batched pass waiting for {waiting} more batches got "
                                     f"{type(message).__name__} (more {getattr(message, 'more', '-')})")
        received.append(message)
    return received


def in_order(received: list[StageBatch | Cancelled], outcomes: dict[int, object]) -> list:
    """Every pass's outcome in the order received; the batches still
    travelling together counted down again (StageBatch.more). A failure
    of a batched pass is reported once, for its first pass."""
    ordered = [outcomes.get(message.pass_id, message) for message in received]
    failures = [message for message in ordered if isinstance(message, StageFailure)]
    if failures:
        return failures[:1]
    together = [index for index, message in enumerate(ordered) if isinstance(message, StageBatch)]
    for left, index in enumerate(reversed(together)):
        ordered[index] = replace(ordered[index], more=left)
    return ordered
