"""The stages of a model in Ray actors, joined by a chain of sockets.

A ``Pipeline`` puts three parts together: where each stage runs (a
``reservation.Reservation`` over the pure ``placement`` decision, made up front),
the stage actors (orchestrator.cluster.stage_actors), and the per-token path
(orchestrator.transport.chain.SocketChain). Ray places the actors and carries
the control calls (describe, connect, stats); the tokens do not go through
Ray. Before any stage loads, each stage file's header is read on the node
that is to run it (the driver may not hold the other machines' files), and
the set is validated from those readings (stages.stage_files). A stage actor
that dies is restarted and its cache rebuilt by replay
(orchestrator.cluster.recovery): the caller sees a late result, never a
wrong one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from orchestrator.cluster import recovery
from orchestrator.cluster.connect import ClusterError
from orchestrator.cluster.reservation import Reservation
from orchestrator.cluster.kept_stages import FoundStage, KeptStages, find_kept, holds
from orchestrator.cluster.recovery import ChainRelink, StageRestart, StageWaiting
from orchestrator.cluster.shipping import Shipment, ModelToShip, fetch_vocabulary, ship_whole_model
from orchestrator.cluster.stage_actors import LOOPBACK, StageActors, StageLoad, StageReport
from orchestrator.cluster.stage_cpus import CpuSet, stage_cpu_sets
from orchestrator.config import MAX_RESTARTS, PASS_CURVE_SIZES, STAGE_ANSWER_SECONDS, TREE_CURVE_SIZES
from orchestrator.decoding.windows import TargetPass, Window
from orchestrator.decoding.targets import PassReplies, choice_of
from orchestrator.transport.chain import PassLate, PipelineError, SocketChain
from orchestrator.transport.handshake import new_secret
from orchestrator.transport.ledger import KvLedger, PassRecord
from orchestrator.transport.liveness import StageDeadlines
from orchestrator.transport.messages import Cancelled, PassResult
from orchestrator.transport.tls import new_chain_certificate
from speculators.draft_length import DRAFT_STEP_TOKENS, curve_step
from speculators.tree import TREE_COST_LIMIT
from stages.tree_shape import depths
from stages.cost_curve import BatchCurve
from stages.settings import StageSettings
from stages.gguf_file import same_slice
from stages.stage_files import NOT_FOUND, check_stage_files_on_nodes

__all__ = ["ChainRelink", "Pipeline", "PipelineError", "StageLoad", "StageReport", "StageRestart"]


class Pipeline:
    """A running pipeline (an orchestrator.decoding.targets.Target): ``forward`` sends one batch through every stage."""

    def __init__(
        self,
        stage_paths: list[str] | ModelToShip,
        settings: StageSettings = StageSettings(),
        *,
        wire_dtype: str = "f32",
        place: dict[int, str] | None = None,
        prefer: dict[int, str] | None = None,
        pass_deadline_minimum: float | None = None,
        deadlines: StageDeadlines = StageDeadlines(),
        max_restarts: int = MAX_RESTARTS,
        on_restart: Callable[[StageRestart], None] | None = None,
        tls: bool = False,
        overlapping: bool = False,
        kept: KeptStages | None = None,
    ):
        """stage_paths: each stage's file, on the node that runs it, or a
        ModelToShip on this machine: its stages are cut and shipped to their
        nodes first (orchestrator.cluster.shipping; ``shipments`` says what was sent).
        place: pins (--place); prefer: the nodes a whole model's stages were
        shipped to before, left for a spare node when lost (placement).
        pass_deadline_minimum: the least seconds a pass's result may take
        (default defaults.PASS_DEADLINE_MINIMUM_SECONDS; the chain's deadline);
        deadlines: how soon a stage that says nothing is found silent, then hung or lost.
        max_restarts: how often each stage may be restarted after it died;
        on_restart: told of each restart (the metrics).
        tls: every chain and drafter connection in TLS, with a certificate made
        for this pipeline (orchestrator.transport.tls), handed to the actors through Ray.
        overlapping: several stages compute at once (asynchronous speculation,
        a service); it decides how stages sharing a machine are pinned to its
        CPUs (orchestrator.cluster.stage_cpus; pin_stages changes it).
        kept: a service's stages that outlive this coordinator
        (orchestrator.cluster.kept_stages): its secret and certificate (tls is then
        the certificate's), and the stages an earlier coordinator left are
        taken over where they hold what this one would load."""
        import ray

        self.whole_model = stage_paths if isinstance(stage_paths, ModelToShip) else None
        self.split = None  # the whole model's SplitPlan, once shipped
        self.shipments: list[Shipment] = []  # every stage file shipped, restarts' too
        stage_count = self.whole_model.stage_count if self.whole_model else len(stage_paths)
        if settings.cost_curve is not None:  # before anything is placed
            settings.cost_curve.check(stage_count)
        self.stage_paths = [""] * stage_count if self.whole_model else list(stage_paths)
        self.settings = settings
        self.wire_dtype = wire_dtype
        self.n_batch = settings.n_batch
        self.max_restarts = max_restarts
        self.deadlines = deadlines
        self.on_restart = on_restart
        self.restarts: list[StageRestart] = []
        self.relinks: list[ChainRelink] = []  # the chain wired anew with every stage alive (recovery)
        self.stage_cpus: list[CpuSet | None] = []  # each stage process's CPUs; None: any
        self.chain: SocketChain | None = None
        self.ledger = KvLedger()  # what every stage caches, for a replay after a loss
        # The data plane's secret: it reaches the actors only through Ray's
        # authenticated calls, and every chain connection proves it holds it.
        self.secret = kept.secret if kept else new_secret()
        # --tls: every connection in TLS with it
        self.certificate = kept.certificate if kept else new_chain_certificate() if tls else None
        left, names_used = find_kept(kept.tag) if kept else ({}, {})
        if prefer is not None:  # a stage an earlier coordinator moved is preferred where it is now
            prefer = {**prefer, **{index: stage.description.node_id for index, stage in left.items()}}
        self.reservation = Reservation(stage_count, place, prefer, kept.group_name if kept else "")
        self.actors = StageActors(self.reservation, settings, wire_dtype, self.secret, self.certificate,
                                  kept.tag if kept else "")
        self.actors.restarts.update(names_used)
        try:
            if self.whole_model is not None:
                self._ship(range(stage_count))
            found = self.actors.read_stage_files(self.stage_paths, range(stage_count))
            self.stage_files = check_stage_files_on_nodes(self.stage_paths, found)
            # Every stage on this machine: no listener needs to be reachable from another.
            self.loopback = all(file.node_address == ray.util.get_node_ip_address() for file in found)
            self.stages = self.actors.start(self.stage_paths, self.loopback, self._take_over(left))
            self.n_vocab = self.stages[-1].n_vocab
            self.stage_count = len(self.stages)
            self.chain = self.new_chain()
            self.pin_stages(overlapping)
            if pass_deadline_minimum is not None:
                self.chain.deadline_minimum = pass_deadline_minimum
        except BaseException:
            self.close()
            raise

    def _take_over(self, left: dict[int, FoundStage]) -> dict:
        """Of the stages an earlier coordinator left, those holding the slice
        this one would load (kept.holds) on the node its placement names:
        index -> actor. Any other is killed (a new one takes its place)."""
        import ray

        taken = {}
        for index, stage in left.items():
            node = self.reservation.node_ids[index] if self.reservation.node_ids else stage.description.node_id
            if index < len(self.stage_files) and holds(stage.description, self.stage_files[index]) \
                    and stage.description.node_id == node:
                taken[index] = stage.actor
            else:
                ray.kill(stage.actor)
                self.actors.restarts[index] = stage.restarts + 1
        return taken

    def _ship(self, indices) -> None:
        """Stages ``indices`` of the whole model onto their nodes (only what they lack is sent)."""
        self.split, shipments = ship_whole_model(self.whole_model, self.reservation, indices, self.secret,
                                                 self.certificate, self.split)
        for shipment in shipments:
            self.stage_paths[shipment.stage_index] = shipment.path
        self.shipments += shipments

    def vocabulary_file(self) -> str:
        """A file on this machine the coordinator can read the vocabulary from
        (every stage file carries the whole vocabulary): the whole model when
        one was shipped, else stage 0's file's metadata, read on its node
        (shipping.fetch_vocabulary)."""
        if self.whole_model is not None:
            return self.whole_model.vocabulary_path
        return fetch_vocabulary(self.stage_paths[0], self.reservation.scheduling_strategy(0))

    def new_chain(self) -> SocketChain:
        """A new chain: each stage connects to the next, the last to us; then we connect to the first."""
        import ray

        host = LOOPBACK if self.loopback else ray.util.get_node_ip_address()
        chain = SocketChain(host, self.secret, self.n_vocab, self.ledger, self.certificate, self.deadlines)
        try:
            self.actors.wire(chain, self.stages)
        except BaseException:
            chain.close()
            raise
        return chain

    def pin_stages(self, overlapping: bool) -> None:
        """Pin the stage processes for a schedule whose passes overlap or not
        (orchestrator.cluster.stage_cpus.stage_cpu_sets); a no-op when nothing changes."""
        # a stage's host is its machine's address (loopback: the driver's machine)
        machine_cpus = {stage.host: stage.cpus for stage in reversed(self.stages)}
        self.set_stage_cpus(stage_cpu_sets([stage.host for stage in self.stages], machine_cpus,
                                           self.settings.threads, overlapping))

    def set_stage_cpus(self, cpu_sets: list[CpuSet | None]) -> None:
        """Pin each stage's process to its CPUs (None: any of its node's)."""
        if cpu_sets != self.stage_cpus:
            self.actors.pin(cpu_sets)
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
        self._send(record)
        return self._receive_one()

    def draft_step(self, batch: int = DRAFT_STEP_TOKENS, repetitions: int = 3, sequence: int = 0) -> float:
        """What each extra token of a batch costs a pass here, in one-token
        passes (speculators.draft_length.step_from_timings): passes of one and
        of ``batch`` tokens, wall time, in ``sequence``, which the next pass
        with keep 0 clears (a generation's first)."""
        return self.pass_costs(batch, repetitions, sequence)[1]

    def pass_costs(self, batch: int = DRAFT_STEP_TOKENS, repetitions: int = 3,
                   sequence: int = 0) -> tuple[float, float]:
        """(the median one-token pass in seconds, draft_step's step), from the same passes."""
        curve = self.pass_curve((1, batch), repetitions, sequence)
        return curve.at(1), curve_step(curve, batch)

    def speculation_costs(self, trees: bool) -> tuple[float, float, BatchCurve | None]:
        """What a run's drafting is priced by: (the one-token pass in seconds,
        draft_step's step, and with ``trees`` the pass at every width a tree
        may take, for the tree rule; else None). The trees' curve holds the
        passes of one and of 8 tokens, so the first two come from it: nothing
        is timed twice. It stops at the first width past 8 whose pass costs
        more than TREE_COST_LIMIT one-token passes: no tree grows that wide
        (speculators.tree.offered_rows), and on a compute-bound machine the
        widths to 512 took most of a tree run's start (24 of 39 s, this CPU)."""
        if not trees:
            return (*self.pass_costs(), None)
        curve = self.pass_curve(TREE_CURVE_SIZES, dearer_than=TREE_COST_LIMIT)
        return curve.at(1), curve_step(curve), curve

    def pass_curve(self, sizes: tuple[int, ...] = PASS_CURVE_SIZES, repetitions: int = 2,
                   sequence: int = 0, *, dearer_than: float | None = None) -> BatchCurve:
        """The median pass of each width in ``sizes`` (within n_batch), in
        seconds, wall time, in ``sequence`` (released after): what continuous
        batching reads a pass's cost from (schedule.Batching), where a line
        through two widths cannot show a memory-bound machine's flat start and
        the width where it ends. One untimed pass warms up first.
        dearer_than: stop after the first width past DRAFT_STEP_TOKENS whose
        pass costs more than this many one-token passes (wider ones are read
        by extrapolation, dearer still)."""
        sizes = tuple(size for size in sizes if size <= self.n_batch)
        self.forward(np.arange(sizes[0], dtype=np.int32), np.ones(sizes[0], np.int32), 0, sequence=sequence)
        measured: list[float] = []
        for tokens in sizes:
            timings = []
            for _ in range(repetitions):
                started = time.perf_counter()
                self.forward(np.arange(tokens, dtype=np.int32), np.ones(tokens, np.int32), 0, sequence=sequence)
                timings.append(time.perf_counter() - started)
            measured.append(sorted(timings)[len(timings) // 2])
            if dearer_than is not None and tokens > DRAFT_STEP_TOKENS and measured[-1] > dearer_than * measured[0]:
                break
        self.release(sequence)  # the measurement holds no cells after it
        return BatchCurve(sizes[: len(measured)], tuple(measured))

    def submit(self, target_pass: TargetPass) -> None:
        """Start a pass (each window's ``sequence`` is its KV sequence in every
        stage); results come back in submission order through receive().
        Passes may overlap: the stages run them in order. A pass of several
        windows (a batched pass: chains of one width, of consecutive
        sequences, as the schedule's Batching makes them) travels as one
        record per window, which every stage decodes in one llama.cpp call
        (StageBatch.more). A window with sampling settings has its tokens
        chosen beside the last stage: the result carries them, not logits."""
        records = [_record_of(window, origin=target_pass) for window in target_pass.windows]
        for index, record in enumerate(records):
            self._send(record, more=len(records) - 1 - index)

    def cancel(self, target_pass: TargetPass) -> None:
        """The pass is no longer wanted (a rejection invalidated its windows):
        stages that have not started it drop it, one running it stops it.
        Its receive() is then a ``Cancelled``, or its result if the stages
        were done before the cancel reached them."""
        self.chain.cancel_origin(target_pass)

    def release(self, sequence: int) -> None:
        """Free a KV sequence in every stage, in order with the passes around it."""
        self._send(PassRecord.release(sequence))

    def copy(self, source: int, destination: int, length: int) -> None:
        """Every stage makes KV sequence ``destination`` hold ``source``'s first
        ``length`` positions (a shared prefix), in order with the passes around it."""
        self._send(PassRecord.copy(source, destination, length))

    def result_within(self, seconds: float) -> bool:
        """Whether the oldest pass's result is in within ``seconds`` (a broken
        or silent chain says True: receive finds out and recovers)."""
        return self.chain.result_within(seconds)

    def receive(self) -> PassResult | Cancelled | PassReplies:
        """The result of the oldest pass in flight (or its ``Cancelled``; for a
        batched pass, every window's, as PassReplies). Past the chain's
        deadline, or if the chain breaks, a dead stage is restarted and the
        pass comes late; a hung stage (or one out of restarts) is named in a
        PipelineError."""
        origin = self.chain.next_origin()
        first = self._receive_one()
        if not isinstance(origin, TargetPass) or len(origin.windows) == 1:
            return first
        rest = [self._receive_one() for _ in origin.windows[1:]]
        return PassReplies((first, *rest), tuple(window.sequence for window in origin.windows))

    def _receive_one(self) -> PassResult | Cancelled:
        """The chain's oldest result, a lost stage restarted on the way."""
        while True:
            try:
                return self.chain.receive()
            except PassLate as late:
                recovery.recover(self, late)

    def _send(self, record: PassRecord, more: int = 0) -> None:
        try:
            self.chain.send(record, more)
        except PassLate as late:  # the record stays in flight: the new chain sends it again
            recovery.recover(self, late)

    # -- a lost stage (orchestrator.cluster.recovery) ---------------------
    def restart_stage(self, index: int) -> None:
        """A new actor for stage ``index`` in its placement (the same node while
        it lives, else a spare where the placement allows), once its file
        there is the one the stage ran."""
        try:
            self.reservation.follow_lost(index)
        except ClusterError as error:
            raise StageWaiting(str(error)) from None
        if self.whole_model is not None:  # its node may be another one now
            self._ship([index])
        [file] = self.actors.read_stage_files(self.stage_paths, [index])
        if file.problem or not same_slice(self.stage_files[index], file.info):
            problem = "the file is not there" if file.problem == NOT_FOUND else file.problem or "the file there differs"
            raise PipelineError(f"stage {index} cannot be restarted on node {file.node_address} "
                                f"({file.node_id[:8]}): {problem}")
        self.stage_files[index] = file.info  # its path there
        self.stages[index] = self.actors.restart(index, self.stage_paths[index], self.loopback,
                                                 self.stage_cpus[index] if self.stage_cpus else None)

    def resume(self) -> bool:
        """After a StageWaiting: start each stage that does not answer, now
        that a node has room for it (False while none has), wire a new chain
        and release every KV sequence the stages still hold (their requests
        ended with the loss): the pipeline then holds nothing."""
        import ray

        for index, actor in enumerate(self.actors):
            try:
                ray.get(actor.describe.remote(), timeout=STAGE_ANSWER_SECONDS)
                continue
            except ray.exceptions.RayError:  # died, or silent with its node
                old_node, started = self.stages[index].node_id, time.perf_counter()
            try:
                self.restart_stage(index)
            except StageWaiting:
                return False
            restart = StageRestart(index, "started again once a node had room", old_node,
                                   self.stages[index].node_id, time.perf_counter() - started, 0.0)
            self.restarts.append(restart)
            if self.on_restart is not None:
                self.on_restart(restart)
        old_chain, self.chain = self.chain, self.new_chain()
        self.chain.take_timing_from(old_chain)
        try:
            for sequence in self.ledger.sequences():
                self.release(sequence)
        except StageWaiting:  # lost again on the way
            return False
        return True

    @property
    def hop_seconds(self) -> float:
        """Mean transport time of one hop, over the passes that ran alone so far."""
        return self.chain.hop_seconds

    # -- reporting and shutdown ------------------------------------------
    def inexact_tree_stages(self) -> list[int]:
        """The stages whose token-tree side rows differ from their paths on
        their machines (stages.tree_check): trees there could change the text.
        Only the CPU build checks (its output is promised to equal one-token
        decoding: batch invariance); a GPU build promises no such thing (its
        batches are not invariant either), so its trees stay, verified losslessly."""
        return [stage.stage_index for stage in self.stages if not stage.side_rows_exact]

    def reports(self) -> list[StageReport]:
        return [StageReport(stage.stage_index, stage.first_block, stage.end_block, stage.node_id, stage.host, *counts,
                            compute=stage.compute)
                for stage, counts in zip(self.stages, self.actors.stats())]

    def load_calls(self) -> list:
        """Ray object refs of each stage's StageLoad (ray.get or await them)."""
        return self.actors.load_calls()

    def peak_rss_mb(self) -> list[float]:
        """Peak resident memory of each stage's process, in MiB."""
        return self.actors.peak_rss_mb()

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()
            self.chain = None
        self.actors.kill()
        self.reservation.release()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _record_of(window: Window, origin: TargetPass) -> PassRecord:
    """The pass that carries one window, as the ledger keeps it and the chain
    sends it: rows at their positions (a tree's at its depths), and the
    target's choice made beside the last stage when the window has sampling."""
    parents = None if window.parents is None else np.asarray(window.batch_parents, np.int32)
    positions = (np.arange(window.first, window.first + len(window.inputs), dtype=np.int32) if parents is None
                 else (window.first + depths(parents)).astype(np.int32))
    return PassRecord(window.sequence, window.first, positions, np.asarray(window.inputs, np.int32),
                      np.asarray(window.logit_rows, np.int32), choice_of(window), parents, origin)
