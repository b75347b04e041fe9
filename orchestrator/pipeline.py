"""The stages of a model in Ray actors, joined by a chain of sockets.

A ``Pipeline`` puts three parts together: where each stage runs (a
``cluster.Reservation`` over the pure ``placement`` decision, made up front),
the stage actors (thin Ray shells over ``stage_server.StageServer``), and the
per-token path (``chain.SocketChain``). Ray places the actors and carries the
control calls (describe, connect, stats); the tokens do not go through Ray.
Before any stage loads, each stage file's header is read on the node that is
to run it (the driver may not hold the other machines' files), and the set is
validated from those readings (stages.stage_files).

A stage actor that dies (its process killed, out of memory) is restarted on
its node (its placement bundle), the chain is wired anew through it and the
surviving stages, every live sequence's cache is rebuilt by replaying its
tokens (orchestrator.replay), and the passes that were in flight are sent
again: the caller sees a late result, never a wrong one (``_recover``). A
stage that hangs is named and the pipeline fails: it may still hold its
node's memory, and a second copy beside it could not load.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from orchestrator.chain import PassLate, PipelineError, SocketChain
from orchestrator.cluster import Reservation, one_line, peak_rss_mb
from orchestrator.defaults import ACTOR_START_SECONDS, MAX_RESTARTS, STAGE_ANSWER_SECONDS
from orchestrator.handshake import new_secret
from orchestrator.messages import Cancelled, PassResult, TokenChoice
from orchestrator.replay import KvLedger, PassRecord
from orchestrator.schedule import TargetPass
from orchestrator.shipping import Shipment, WholeModel, fetch_vocabulary, ship_whole_model
from orchestrator.stage_cpus import CpuSet, stage_cpu_sets
from orchestrator.stage_server import StageDescription, StageServer
from orchestrator.tls import new_chain_certificate
from speculators.tree import depths
from stages.settings import StageSettings
from stages.stage_files import NOT_FOUND, NodeStageFile, check_stage_files_on_nodes, read_stage_file

__all__ = ["Pipeline", "PipelineError", "StageLoad", "StageReport", "StageRestart"]

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class StageReport:
    """What a stage did over a run: its blocks [first_block, end_block), its
    node, its busy time, the passes it ran, and the cancelled passes it
    dropped unstarted or stopped mid-graph."""

    stage_index: int
    first_block: int
    end_block: int
    node_id: str
    host: str
    busy_seconds: float
    passes: int
    dropped_passes: int = 0
    stopped_passes: int = 0


@dataclass(frozen=True)
class StageRestart:
    """A lost stage brought back: which, why it was lost (one line), the nodes
    before and after, the seconds from noticing the loss to the chain carrying
    passes again (reload, rewiring and replay), and of those the replay's
    (rebuilding every live sequence's cache)."""

    stage_index: int
    reason: str
    old_node_id: str
    node_id: str
    seconds: float
    replay_seconds: float


class StageLoad(NamedTuple):
    """What a stage holds now: KV cells and sequences after its last pass, its
    process's resident memory in MiB and id, and how often the stage was
    restarted (filled in by the coordinator, which restarts it)."""

    kv_cells: int
    sequences: int
    rss_mb: float
    process_id: int = 0
    restarts: int = 0


def _stage_file_reader():
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def read_stage_file_on_node(path: str) -> NodeStageFile:
        return read_stage_file(path, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())

    return read_stage_file_on_node


def _stage_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class StageActor:
        """Thin Ray shell over a StageServer (see orchestrator.stage_server)."""

        def __init__(self, path: str, settings: StageSettings, wire_dtype: str, secret: bytes, loopback: bool,
                     certificate):
            """loopback: every peer is on this machine; listen on 127.0.0.1 only.
            certificate: the pipeline's tls.ChainCertificate with --tls, else None."""
            from orchestrator.metrics import StageMetrics

            context = ray.get_runtime_context()
            host = LOOPBACK if loopback else ray.util.get_node_ip_address()
            self.server = StageServer(path, settings, host, context.get_node_id(), wire_dtype, secret=secret,
                                      certificate=certificate)
            self.server.on_pass = StageMetrics(self.server.description.stage_index).record

        def describe(self) -> StageDescription:
            return self.server.description

        def connect_downstream(self, host: str, port: int) -> None:
            self.server.connect_downstream(host, port)

        def pin(self, cpus) -> None:
            self.server.pin(cpus)

        def connect_notify(self, host: str, port: int) -> None:
            self.server.connect_notify(host, port)

        def connect_cancel(self, host: str, port: int) -> None:
            self.server.connect_cancel(host, port)

        def stats(self) -> tuple[float, int, int, int]:
            server = self.server
            return server.busy_seconds, server.passes, server.dropped_passes, server.stopped_passes

        def load(self) -> StageLoad:
            import psutil

            process = psutil.Process()
            return StageLoad(self.server.kv_cells, self.server.kv_sequences, process.memory_info().rss / 1024**2,
                             process.pid)

        def peak_rss_mb(self) -> float:
            return peak_rss_mb()

        def __repr__(self) -> str:  # the name shown on the Ray dashboard and in logs
            if not hasattr(self, "server"):
                return "stage (loading)"
            stage = self.server.description
            return f"stage-{stage.stage_index} [blocks {stage.first_block}-{stage.end_block})"

    return StageActor


class Pipeline:
    """A running pipeline (a ``interfaces.Target``): ``forward`` sends one batch through every stage."""

    def __init__(
        self,
        stage_paths: list[str] | WholeModel,
        settings: StageSettings = StageSettings(),
        *,
        wire_dtype: str = "f32",
        place: dict[int, str] | None = None,
        notify_boundaries: bool = False,
        pass_deadline_minimum: float | None = None,
        max_restarts: int = MAX_RESTARTS,
        on_restart: Callable[[StageRestart], None] | None = None,
        tls: bool = False,
        overlapping: bool = False,
    ):
        """stage_paths: each stage's file, on the node that runs it, or a
        WholeModel on this machine: its stages are cut and shipped to their
        nodes first (orchestrator.shipping; ``shipments`` says what was sent).
        notify_boundaries: non-last stages report each pass leaving them
        (await_boundary); asynchronous speculation needs it.
        pass_deadline_minimum: the least seconds a pass's result may take
        (default defaults.PASS_DEADLINE_MINIMUM_SECONDS; the chain's deadline).
        max_restarts: how often each stage may be restarted after it died;
        on_restart: told of each restart (the metrics).
        tls: every chain and drafter connection in TLS, with a certificate made
        for this pipeline (orchestrator.tls), handed to the actors through Ray.
        overlapping: several stages compute at once (asynchronous speculation,
        a service); it decides how stages sharing a machine are pinned to its
        CPUs (orchestrator.stage_cpus; pin_stages changes it)."""
        import ray

        self.whole_model = stage_paths if isinstance(stage_paths, WholeModel) else None
        self.split = None  # the whole model's SplitPlan, once shipped
        self.shipments: list[Shipment] = []  # every stage file shipped, restarts' too
        stage_count = self.whole_model.stage_count if self.whole_model else len(stage_paths)
        self.stage_paths = [""] * stage_count if self.whole_model else list(stage_paths)
        self.settings = settings
        self.wire_dtype = wire_dtype
        self.notify_boundaries = notify_boundaries
        self.n_batch = settings.n_batch
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.restarts: list[StageRestart] = []
        self.stage_cpus: list[CpuSet | None] = []  # each stage process's CPUs; None: any
        self.actors: list = []
        self.chain: SocketChain | None = None
        self.ledger = KvLedger()  # what every stage caches, for a replay after a loss
        # every pass sent and not yet answered, oldest first, with the TargetPass it carries (None: forward's)
        self._passes: collections.deque[tuple[TargetPass | None, PassRecord]] = collections.deque()
        # The data plane's secret: it reaches the actors only through Ray's
        # authenticated calls, and every chain connection proves it holds it.
        self.secret = new_secret()
        self.certificate = new_chain_certificate() if tls else None  # --tls: every connection in TLS with it
        self.reservation = Reservation(stage_count, place)
        try:
            if self.whole_model is not None:
                self._ship(range(stage_count))
            found = self._read_stage_files(range(len(self.stage_paths)))
            self.stage_files = check_stage_files_on_nodes(self.stage_paths, found)
            # Every stage on this machine: no listener needs to be reachable from another.
            self.loopback = all(file.node_address == ray.util.get_node_ip_address() for file in found)
            self.stages = self._start_stages()
            self.n_vocab = self.stages[-1].n_vocab
            self.chain = self._wire()
            self.pin_stages(overlapping)
            if pass_deadline_minimum is not None:
                self.chain.deadline_minimum = pass_deadline_minimum
        except BaseException:
            self.close()
            raise

    def _ship(self, indices) -> None:
        """Stages ``indices`` of the whole model onto their nodes (only what they lack is sent)."""
        self.split, shipments = ship_whole_model(self.whole_model, self.reservation, indices, self.secret,
                                                 self.certificate, self.split)
        for shipment in shipments:
            self.stage_paths[shipment.stage_index] = shipment.path
        self.shipments += shipments

    def _read_stage_files(self, indices) -> list[NodeStageFile]:
        """Each stage file of ``indices`` read on the node that will load it (the driver may not hold it)."""
        import ray

        reader = _stage_file_reader()
        readings = [
            reader.options(scheduling_strategy=self.reservation.scheduling_strategy(index)).remote(self.stage_paths[index])
            for index in indices
        ]
        try:
            return ray.get(readings, timeout=ACTOR_START_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"stage files were not read on their nodes within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise PipelineError(f"could not read the stage files on their nodes: {one_line(error)}") from None

    def vocabulary_file(self) -> str:
        """A file on this machine the coordinator can read the vocabulary from
        (every stage file carries the whole vocabulary): the whole model when
        one was shipped, else stage 0's file's metadata, read on its node
        (shipping.fetch_vocabulary)."""
        if self.whole_model is not None:
            return self.whole_model.path
        return fetch_vocabulary(self.stage_paths[0], self.reservation.scheduling_strategy(0))

    def _start_stage(self, index: int):
        """A new stage actor for stage ``index`` on its node (it loads in the background)."""
        return _stage_actor_class().options(**self.actor_options(index, num_cpus=1)).remote(
            self.stage_paths[index], self.settings, self.wire_dtype, self.secret, self.loopback, self.certificate)

    def _start_stages(self) -> list[StageDescription]:
        import ray

        for index in range(len(self.stage_paths)):
            self.actors.append(self._start_stage(index))
        try:
            return ray.get([actor.describe.remote() for actor in self.actors], timeout=ACTOR_START_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"stages did not start within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise PipelineError(f"a stage failed to start: {self._why_not_started(error)}") from None

    def _why_not_started(self, first: Exception) -> str:
        """The most telling start-up error: Ray may report a stage as cancelled
        before it ran when another stage's failure came first; ask each."""
        import ray

        reasons = []
        for actor in self.actors:
            try:
                ray.get(actor.describe.remote(), timeout=STAGE_ANSWER_SECONDS)
            except ray.exceptions.RayError as error:  # GetTimeoutError included: a stage still loading
                reasons.append(one_line(error))
        telling = [reason for reason in reasons if "never ran" not in reason and "did not finish" not in reason]
        return (telling or reasons or [one_line(first)])[0]

    def _wire(self) -> SocketChain:
        """Each stage connects to the next, the last to us; then we connect to the first."""
        import ray

        from concurrent.futures import ThreadPoolExecutor

        host = LOOPBACK if self.loopback else ray.util.get_node_ip_address()
        chain = SocketChain(host, self.secret, self.n_vocab, self.ledger, self.certificate)
        try:
            # Every connection is proved by a handshake, so each acceptor must be
            # listening while its peer connects: ours run in a thread meanwhile.
            with ThreadPoolExecutor(1) as accepting:
                last = accepting.submit(chain.accept_last, len(self.stages))
                downstream = [(stage.host, stage.port) for stage in self.stages[1:]] + [chain.address]
                ray.get([actor.connect_downstream.remote(*address) for actor, address in zip(self.actors, downstream)],
                        timeout=ACTOR_START_SECONDS)
                last.result()
                chain.connect_first(self.stages[0].host, self.stages[0].port)
                if self.notify_boundaries:
                    for actor in self.actors[:-1]:  # one at a time, in stage order
                        boundary = accepting.submit(chain.accept_boundary)
                        ray.get(actor.connect_notify.remote(*chain.address), timeout=ACTOR_START_SECONDS)
                        boundary.result()
                for actor in self.actors:  # one at a time, in stage order
                    cancels = accepting.submit(chain.accept_cancel)
                    ray.get(actor.connect_cancel.remote(*chain.address), timeout=ACTOR_START_SECONDS)
                    cancels.result()
        except ray.exceptions.RayError as error:
            chain.close()
            raise PipelineError(f"the chain could not be set up: {one_line(error)}") from None
        except BaseException:
            chain.close()
            raise
        return chain

    def pin_stages(self, overlapping: bool) -> None:
        """Pin the stage processes for a schedule whose passes overlap or not
        (orchestrator.stage_cpus.stage_cpu_sets); a no-op when nothing changes."""
        # a stage's host is its machine's address (loopback: the driver's machine)
        machine_cpus = {stage.host: stage.cpus for stage in reversed(self.stages)}
        self.set_stage_cpus(stage_cpu_sets([stage.host for stage in self.stages], machine_cpus,
                                           self.settings.threads, overlapping))

    def set_stage_cpus(self, cpu_sets: list[CpuSet | None]) -> None:
        """Pin each stage's process to its CPUs (None: any of its node's)."""
        import ray

        if cpu_sets == self.stage_cpus:
            return
        try:
            ray.get([actor.pin.remote(cpus) for actor, cpus in zip(self.actors, cpu_sets)],
                    timeout=STAGE_ANSWER_SECONDS)
        except ray.exceptions.RayError as error:
            raise PipelineError(f"the stages could not be pinned to their CPUs: {one_line(error)}") from None
        self.stage_cpus = list(cpu_sets)

    def actor_options(self, index: int, *, num_cpus: float) -> dict:
        """Ray options that put an actor on stage ``index``'s node (drafters use them too)."""
        return self.reservation.actor_options(index, num_cpus=num_cpus)

    # -- the hot path -------------------------------------------------------
    def forward(
        self, positions: np.ndarray, tokens: np.ndarray, keep: int, logit_rows: np.ndarray | None = None,
        sequence: int = 0,
    ) -> PassResult:
        """Run one KV sequence's tokens int32[n] at positions int32[n] through every stage.

        keep: each stage first drops the sequence's cached positions >= keep.
        Returns the logits float32[len(logit_rows), n_vocab] (default: last row).
        """
        if logit_rows is None:
            logit_rows = np.array([len(tokens) - 1], dtype=np.int32)
        record = PassRecord(sequence, keep, np.asarray(positions, np.int32), np.asarray(tokens, np.int32),
                            np.asarray(logit_rows, np.int32))
        self._passes.append((None, record))
        self._send(record)
        return self.receive()

    def draft_step(self, batch: int = 8, repetitions: int = 3, sequence: int = 0) -> float:
        """What each extra token of a batch costs a pass here, in one-token
        passes (speculators.draft_length.step_from_timings): passes of one and
        of ``batch`` tokens, wall time, in ``sequence``, which the next pass
        with keep 0 clears (a generation's first)."""
        from speculators.draft_length import step_from_timings

        timings: dict[int, list[float]] = {1: [], batch: []}
        for _ in range(repetitions + 1):  # the first of each only warms up
            for tokens in timings:
                started = time.perf_counter()
                self.forward(np.arange(tokens, dtype=np.int32), np.ones(tokens, np.int32), 0, sequence=sequence)
                timings[tokens].append(time.perf_counter() - started)
        return step_from_timings(timings[1][1:], timings[batch][1:], batch)

    def submit(self, target_pass: TargetPass) -> None:
        """Start a pass of one sequence's window (its ``sequence`` is the KV
        sequence in every stage); results come back in submission order
        through receive(). Passes may overlap: the stages run them in order.
        A pass carries one window: a stage decodes one sequence per llama.cpp
        call (stages.engine), and separate passes let the stages work on
        different sequences at once (README, "Serving"). A window with
        sampling settings has its tokens chosen beside the last stage: the
        result carries them, not logits."""
        if len(target_pass.windows) != 1:
            raise PipelineError(f"a pass of {len(target_pass.windows)} sequences; this pipeline carries one per pass")
        window = target_pass.windows[0]
        parents = None if window.parents is None else np.asarray(window.batch_parents, np.int32)
        positions = (np.arange(window.first, window.first + len(window.inputs), dtype=np.int32) if parents is None
                     else (window.first + depths(parents)).astype(np.int32))
        choice = None if window.sampling is None else TokenChoice(
            np.asarray(window.drafts, np.int32), window.first + window.logit_rows[0] + 1, window.sampling,
            None if window.parents is None else np.asarray(window.parents, np.int32))
        record = PassRecord(window.sequence, window.first, positions, np.asarray(window.inputs, np.int32),
                            np.asarray(window.logit_rows, np.int32), choice, parents)
        self._passes.append((target_pass, record))
        self._send(record)

    def cancel(self, target_pass: TargetPass) -> None:
        """The pass is no longer wanted (a rejection invalidated its windows):
        stages that have not started it drop it, one running it stops it.
        Its receive() is then a ``Cancelled``, or its result if the stages
        were done before the cancel reached them."""
        for submitted, record in self._passes:
            if submitted is target_pass:
                self.chain.cancel(record)
                return

    def release(self, sequence: int) -> None:
        """Free a KV sequence in every stage, in order with the passes around it."""
        self._send(PassRecord.release(sequence))

    def receive(self) -> PassResult | Cancelled:
        """The result of the oldest pass in flight (or its ``Cancelled``). Past
        the chain's deadline, or if the chain breaks, a dead stage is restarted
        and the pass comes late; a hung stage (or one out of restarts) is
        named in a PipelineError."""
        while True:
            try:
                return self.chain.receive()
            except PassLate as late:
                self._recover(late)
            finally:  # answered (or failed) passes can no longer be cancelled
                while self._passes and not self.chain.holds(self._passes[0][1]):
                    self._passes.popleft()

    def await_boundary(self, stage_index: int) -> int:
        """Block until the next pass has left stage ``stage_index``; return its id
        (needs notify_boundaries)."""
        while True:
            try:
                return self.chain.await_boundary(stage_index)
            except PassLate as late:
                self._recover(late)

    def _send(self, record: PassRecord) -> None:
        try:
            self.chain.send(record)
        except PassLate as late:  # the record stays in flight: the new chain sends it again
            self._recover(late)

    # -- a lost stage -------------------------------------------------------
    def _recover(self, late: PassLate) -> None:
        """Restart every stage that died, wire a new chain, rebuild every
        sequence's cache and send the unanswered passes again; or raise the
        PipelineError that names the stage at fault."""
        noticed = time.perf_counter()
        unanswered, notices = self.chain.unanswered(), self.chain.notices_taken_in_flight()
        cancelled = self.chain.cancelled_unanswered()
        restarted: list[tuple[int, str, str]] = []  # (index, why, old node)
        while True:
            dead = self._dead_stages(late, restarted)
            old_chain = self.chain
            old_chain.close(shutdown=False)
            for index, reason in dead:
                restarted.append((index, reason, self.stages[index].node_id))
                self._restart_stage(index)
            self.chain = self._wire()
            self.chain.take_timing_from(old_chain)
            replaying = time.perf_counter()
            try:
                self._replay(unanswered, notices, cancelled)
                break
            except PassLate as again:  # lost again while replaying: the ledger still holds only settled passes
                late = again
        done = time.perf_counter()
        for index, reason, old_node in restarted:
            restart = StageRestart(index, reason, old_node, self.stages[index].node_id, done - noticed, done - replaying)
            self.restarts.append(restart)
            if self.on_restart is not None:
                self.on_restart(restart)

    def _dead_stages(self, late: PassLate, restarting: list[tuple[int, str, str]]) -> list[tuple[int, str]]:
        """(index, why) of each stage actor that died; a PipelineError naming
        the stage if one does not answer, if none died (one may be stuck inside
        llama.cpp), or if one died more often than max_restarts."""
        import ray

        calls = [actor.describe.remote() for actor in self.actors]
        dead = []
        for stage, call in zip(self.stages, calls):
            where = f"stage {stage.stage_index} on node {stage.node_id[:8]} ({stage.host}, process {stage.process_id})"
            try:
                ray.get(call, timeout=STAGE_ANSWER_SECONDS)
            except ray.exceptions.GetTimeoutError:
                raise PipelineError(f"{late}: {where} does not answer within {STAGE_ANSWER_SECONDS:.0f} s "
                                    "(hung or stopped)") from None
            except ray.exceptions.RayError as error:
                reason = one_line(error)
                used = sum(restart.stage_index == stage.stage_index for restart in self.restarts) + sum(
                    index == stage.stage_index for index, _, _ in restarting)
                if used >= self.max_restarts:
                    raise PipelineError(f"{late}: {where} died ({reason}); restarted {used} times already "
                                        f"(--max-restarts {self.max_restarts})") from None
                dead.append((stage.stage_index, reason))
        if not dead:
            raise PipelineError(f"{late}; every stage still answers (one may be stuck inside llama.cpp)")
        return dead

    def _restart_stage(self, index: int) -> None:
        """A new actor for stage ``index`` in its placement (the same node while
        it lives), once its file there is the one the stage ran."""
        import ray

        ray.kill(self.actors[index])
        if self.whole_model is not None:  # its node may be another one now
            self._ship([index])
        [file] = self._read_stage_files([index])
        if file.problem or file.info != self.stage_files[index]:
            problem = "the file is not there" if file.problem == NOT_FOUND else file.problem or "the file there differs"
            raise PipelineError(f"stage {index} cannot be restarted on node {file.node_address} "
                                f"({file.node_id[:8]}): {problem}")
        self.actors[index] = self._start_stage(index)
        try:
            self.stages[index] = ray.get(self.actors[index].describe.remote(), timeout=ACTOR_START_SECONDS)
            if self.stage_cpus:
                ray.get(self.actors[index].pin.remote(self.stage_cpus[index]), timeout=STAGE_ANSWER_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"stage {index} did not restart within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise PipelineError(f"stage {index} could not be restarted: {one_line(error)}") from None

    def _replay(self, unanswered: list[PassRecord], notices: list[int], cancelled: list[PassRecord]) -> None:
        """Rebuild every sequence's cache in the new chain (at most one pass per
        stage in flight, so results never pile up unread), then send the
        unanswered passes again (cancelling again those ``cancelled``) and
        take the boundary notices of theirs the caller already awaited."""
        for record in self.ledger.rebuild(self.n_batch):
            if self.chain.in_flight >= len(self.stages):
                self.chain.receive()
            self.chain.send(record)
        while self.chain.in_flight:
            self.chain.receive()
        for record in unanswered:
            self.chain.send(record)
        for record in cancelled:
            self.chain.cancel(record)
        for stage_index, count in enumerate(notices):
            for _ in range(count):
                self.chain.await_boundary(stage_index)

    @property
    def hop_seconds(self) -> float:
        """Mean transport time of one hop, over the passes that ran alone so far."""
        return self.chain.hop_seconds

    # -- reporting and shutdown ------------------------------------------
    def reports(self) -> list[StageReport]:
        import ray

        stats = ray.get([actor.stats.remote() for actor in self.actors])
        return [
            StageReport(stage.stage_index, stage.first_block, stage.end_block, stage.node_id, stage.host, *counts)
            for stage, counts in zip(self.stages, stats)
        ]

    def load_calls(self) -> list:
        """Ray object refs of each stage's StageLoad (ray.get or await them)."""
        return [actor.load.remote() for actor in self.actors]

    def peak_rss_mb(self) -> list[float]:
        """Peak resident memory of each stage's process, in MiB."""
        import ray

        return ray.get([actor.peak_rss_mb.remote() for actor in self.actors])

    def close(self) -> None:
        import ray

        if self.chain is not None:
            self.chain.close()
            self.chain = None
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        self.reservation.release()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
