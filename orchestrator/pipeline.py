"""The stages of a model in Ray actors, joined by a chain of sockets.

A ``Pipeline`` puts three parts together: where each stage runs (a
``cluster.Reservation`` over the pure ``placement`` decision, made up front),
the stage actors (thin Ray shells over ``stage_server.StageServer``), and the
per-token path (``chain.SocketChain``). Ray places the actors and carries the
control calls (describe, connect, stats); the tokens do not go through Ray.
Before any stage loads, each stage file's header is read on the node that is
to run it (the driver may not hold the other machines' files), and the set is
validated from those readings (stages.stage_files).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from orchestrator.chain import PassLate, PipelineError, SocketChain
from orchestrator.cluster import Reservation, one_line, peak_rss_mb
from orchestrator.defaults import ACTOR_START_SECONDS, STAGE_ANSWER_SECONDS
from orchestrator.handshake import new_secret
from orchestrator.messages import PassResult
from orchestrator.schedule import TargetPass
from orchestrator.stage_server import StageDescription, StageServer
from stages.gguf_file import StageFileInfo
from stages.settings import StageSettings
from stages.stage_files import NodeStageFile, check_stage_files_on_nodes, read_stage_file

__all__ = ["Pipeline", "PipelineError", "StageLoad", "StageReport"]


@dataclass(frozen=True)
class StageReport:
    """What a stage did over a run: its blocks [first_block, end_block), its
    node, its busy time, and the passes it ran."""

    stage_index: int
    first_block: int
    end_block: int
    node_id: str
    host: str
    busy_seconds: float
    passes: int


class StageLoad(NamedTuple):
    """What a stage holds now: KV cells and sequences after its last pass, and
    its process's resident memory in MiB."""

    kv_cells: int
    sequences: int
    rss_mb: float


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

        def __init__(self, path: str, settings: StageSettings, wire_dtype: str, secret: bytes):
            from orchestrator.metrics import StageMetrics

            context = ray.get_runtime_context()
            self.server = StageServer(path, settings, ray.util.get_node_ip_address(), context.get_node_id(), wire_dtype,
                                      secret=secret)
            self.server.on_pass = StageMetrics(self.server.description.stage_index).record

        def describe(self) -> StageDescription:
            return self.server.description

        def connect_downstream(self, host: str, port: int) -> None:
            self.server.connect_downstream(host, port)

        def connect_notify(self, host: str, port: int) -> None:
            self.server.connect_notify(host, port)

        def stats(self) -> tuple[float, int]:
            return self.server.busy_seconds, self.server.passes

        def load(self) -> StageLoad:
            import psutil

            return StageLoad(self.server.kv_cells, self.server.kv_sequences,
                             psutil.Process().memory_info().rss / 1024**2)

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
        stage_paths: list[str],
        settings: StageSettings = StageSettings(),
        *,
        wire_dtype: str = "f32",
        place: dict[int, str] | None = None,
        notify_boundaries: bool = False,
        pass_deadline_minimum: float | None = None,
    ):
        """notify_boundaries: non-last stages report each pass leaving them
        (await_boundary); asynchronous speculation needs it.
        pass_deadline_minimum: the least seconds a pass's result may take
        (default defaults.PASS_DEADLINE_MINIMUM_SECONDS; the chain's deadline)."""
        self.stage_paths = list(stage_paths)
        self.n_batch = settings.n_batch
        self.actors: list = []
        self.chain: SocketChain | None = None
        # The data plane's secret: it reaches the actors only through Ray's
        # authenticated calls, and every chain connection proves it holds it.
        self.secret = new_secret()
        self.reservation = Reservation(len(stage_paths), place)
        try:
            self.stage_files = self._check_stage_files_on_their_nodes()
            self.stages = self._start_stages(settings, wire_dtype)
            self.chain = self._wire(notify_boundaries)
            if pass_deadline_minimum is not None:
                self.chain.deadline_minimum = pass_deadline_minimum
        except BaseException:
            self.close()
            raise
        self.n_vocab = self.stages[-1].n_vocab

    def _check_stage_files_on_their_nodes(self) -> list[StageFileInfo | None]:
        """Each file is read on the node that will load it (the driver may not hold it)."""
        import ray

        reader = _stage_file_reader()
        readings = [
            reader.options(scheduling_strategy=self.reservation.scheduling_strategy(index)).remote(path)
            for index, path in enumerate(self.stage_paths)
        ]
        try:
            found = ray.get(readings, timeout=ACTOR_START_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"stage files were not read on their nodes within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise PipelineError(f"could not read the stage files on their nodes: {one_line(error)}") from None
        return check_stage_files_on_nodes(self.stage_paths, found)

    def _start_stages(self, settings: StageSettings, wire_dtype: str) -> list[StageDescription]:
        import ray

        actor_class = _stage_actor_class()
        for index, path in enumerate(self.stage_paths):
            options = self.actor_options(index, num_cpus=1)
            self.actors.append(actor_class.options(**options).remote(path, settings, wire_dtype, self.secret))
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

    def _wire(self, notify_boundaries: bool) -> SocketChain:
        """Each stage connects to the next, the last to us; then we connect to the first."""
        import ray

        from concurrent.futures import ThreadPoolExecutor

        chain = SocketChain(ray.util.get_node_ip_address(), self.secret)
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
                if notify_boundaries:
                    for actor in self.actors[:-1]:  # one at a time, in stage order
                        boundary = accepting.submit(chain.accept_boundary)
                        ray.get(actor.connect_notify.remote(*chain.address), timeout=ACTOR_START_SECONDS)
                        boundary.result()
        except ray.exceptions.RayError as error:
            chain.close()
            raise PipelineError(f"the chain could not be set up: {one_line(error)}") from None
        except BaseException:
            chain.close()
            raise
        return chain

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
        with self._naming_the_stage():
            self.chain.send(positions, tokens, keep, logit_rows, sequence)
        return self.receive()

    def submit(self, target_pass: TargetPass) -> None:
        """Start a pass of one sequence's window (its ``sequence`` is the KV
        sequence in every stage); results come back in submission order
        through receive(). Passes may overlap: the stages run them in order.
        A pass carries one window: a stage decodes one sequence per llama.cpp
        call (stages.engine), and separate passes let the stages work on
        different sequences at once (README, "Serving")."""
        if len(target_pass.windows) != 1:
            raise PipelineError(f"a pass of {len(target_pass.windows)} sequences; this pipeline carries one per pass")
        window = target_pass.windows[0]
        positions = np.arange(window.first, window.first + len(window.inputs), dtype=np.int32)
        with self._naming_the_stage():
            self.chain.send(positions, np.asarray(window.inputs, np.int32), window.first,
                            np.asarray(window.logit_rows, np.int32), window.sequence)

    def release(self, sequence: int) -> None:
        """Free a KV sequence in every stage, in order with the passes around it."""
        with self._naming_the_stage():
            self.chain.release(sequence)

    def receive(self) -> PassResult:
        """The logits of the oldest pass in flight. Past the chain's deadline, or
        if the chain breaks, the error names the stage that is dead or hung."""
        with self._naming_the_stage():
            return self.chain.receive()

    def await_boundary(self, stage_index: int) -> int:
        """Block until the next pass has left stage ``stage_index``; return its id
        (needs notify_boundaries)."""
        with self._naming_the_stage():
            return self.chain.await_boundary(stage_index)

    @contextlib.contextmanager
    def _naming_the_stage(self) -> Iterator[None]:
        """A late pass or a broken chain (PassLate) becomes an error naming the stage at fault."""
        try:
            yield
        except PassLate as late:
            raise self._name_the_stage(late) from None

    def _name_the_stage(self, late: PassLate) -> PipelineError:
        """Ask each stage actor through Ray (its own thread answers while its
        stage decodes): one that died, or that does not answer, is named."""
        import ray

        calls = [actor.describe.remote() for actor in self.actors]
        for stage, call in zip(self.stages, calls):
            where = f"stage {stage.stage_index} on node {stage.node_id[:8]} ({stage.host}, process {stage.process_id})"
            try:
                ray.get(call, timeout=STAGE_ANSWER_SECONDS)
            except ray.exceptions.GetTimeoutError:
                return PipelineError(f"{late}: {where} does not answer within {STAGE_ANSWER_SECONDS:.0f} s "
                                     "(hung or stopped)")
            except ray.exceptions.RayError as error:
                return PipelineError(f"{late}: {where} died ({one_line(error)})")
        return PipelineError(f"{late}; every stage still answers (one may be stuck inside llama.cpp)")

    @property
    def hop_seconds(self) -> float:
        """Mean transport time of one hop, over the passes that ran alone so far."""
        return self.chain.hop_seconds

    # -- reporting and shutdown ------------------------------------------
    def reports(self) -> list[StageReport]:
        import ray

        stats = ray.get([actor.stats.remote() for actor in self.actors])
        return [
            StageReport(stage.stage_index, stage.first_block, stage.end_block, stage.node_id, stage.host, busy, passes)
            for stage, (busy, passes) in zip(self.stages, stats)
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
