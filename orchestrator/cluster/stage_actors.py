"""The stage actors of a pipeline: thin Ray shells over
orchestrator.workers.stage_server.StageServer, each in its stage's placement
bundle (orchestrator.cluster.reservation.Reservation), with the calls the
pipeline makes of them: read a stage file on its node, start, describe, pin,
report, kill. Ray carries only these control calls; the tokens go through
the chain's sockets (orchestrator.transport.chain)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from orchestrator.cluster.connect import actor_name, peak_rss_mb, pipeline_tag, readable_class_name
from orchestrator.cluster.metrics import StageMetrics
from orchestrator.cluster.ray_calls import one_line, ray_get
from orchestrator.cluster.reservation import Reservation
from orchestrator.config import ACTOR_START_SECONDS, STAGE_ANSWER_SECONDS
from orchestrator.transport.chain import PipelineError
from orchestrator.workers.stage_server import StageDescription, StageServer
from stages.backend import StageCompute
from stages.settings import StageSettings
from stages.stage_files import NodeStageFile, read_stage_file

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class StageReport:
    """What a stage did over a run: its blocks [first_block, end_block), its
    node, its busy time, the passes it ran, the cancelled passes it
    dropped unstarted or stopped mid-graph, and where it computed (compute)."""

    stage_index: int
    first_block: int
    end_block: int
    node_id: str
    host: str
    busy_seconds: float
    passes: int
    dropped_passes: int = 0
    stopped_passes: int = 0
    compute: StageCompute | None = None


class StageLoad(NamedTuple):
    """What a stage holds now: KV cells and sequences after its last pass, its
    process's resident memory in MiB and id; how often the stage was
    restarted, where it computes (compute: backend, devices, offloaded
    layers) and its Ray node, filled in by the coordinator, which restarts it
    and holds its StageDescription."""

    kv_cells: int
    sequences: int
    rss_mb: float
    process_id: int = 0
    restarts: int = 0
    compute: StageCompute | None = None
    passes: int = 0  # llama.cpp calls so far
    windows: int = 0  # sequences' windows they carried (over passes: batched passes)
    prefix_cells: int = 0  # KV cells holding cached prefixes (orchestrator.decoding.prefix_cache)
    node_id: str = ""
    busy_fraction: float = 0.0  # computing over the last BUSY_WINDOW_SECONDS (StageServer.recent)


def stage_file_reader():
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def read_stage_file_on_node(path: str) -> NodeStageFile:
        return read_stage_file(path, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())

    return read_stage_file_on_node


def stage_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    @readable_class_name  # the dashboard shows "StageActor", not "stage_actor_class.<locals>.StageActor"
    class StageActor:
        """Thin Ray shell over a StageServer (see orchestrator.workers.stage_server)."""

        def __init__(self, path: str, settings: StageSettings, wire_dtype: str, secret: bytes, loopback: bool,
                     certificate):
            """loopback: every peer is on this machine; listen on 127.0.0.1 only.
            certificate: the pipeline's tls.ChainCertificate with --tls, else None."""
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

        def connect_cancel(self, host: str, port: int) -> None:
            self.server.connect_cancel(host, port)

        def forget(self) -> None:
            self.server.forget()

        def stats(self) -> tuple[float, int, int, int]:
            server = self.server
            return server.busy_seconds, server.passes, server.dropped_passes, server.stopped_passes

        def load(self) -> StageLoad:
            import psutil

            process = psutil.Process()
            return StageLoad(self.server.kv_cells, self.server.kv_sequences, process.memory_info().rss / 1024**2,
                             process.pid, passes=self.server.passes, windows=self.server.windows_decoded,
                             prefix_cells=self.server.prefix_cells,
                             busy_fraction=self.server.recent.fraction(time.monotonic()))

        def peak_rss_mb(self) -> float:
            return peak_rss_mb()

        def __repr__(self) -> str:  # the name shown on the Ray dashboard and in logs
            if not hasattr(self, "server"):
                return "stage (loading)"
            stage = self.server.description
            return f"stage-{stage.stage_index} [blocks {stage.first_block}-{stage.end_block})"

    return StageActor


class StageActors:
    """One actor per stage, each started in its stage's placement bundle with
    the pipeline's settings, secret and certificate (handed over by Ray's
    authenticated calls), and named ``specpipe-stage-<index>.<tag>``
    (connect.actor_name; the pipeline's drafters share the tag). Kept
    (``kept_tag``: a service's, orchestrator.cluster.kept_stages) they are detached
    from this process and named with the service's tag, and the drafters,
    which die with it, with one of their own."""

    def __init__(self, reservation: Reservation, settings: StageSettings, wire_dtype: str, secret: bytes,
                 certificate, kept_tag: str = ""):
        self.reservation = reservation
        self.settings = settings
        self.wire_dtype = wire_dtype
        self.secret = secret
        self.certificate = certificate
        self.actors: list = []
        self.detached = bool(kept_tag)
        self.tag = kept_tag or pipeline_tag()
        self.drafter_tag = f"{self.tag}.{pipeline_tag()}" if kept_tag else self.tag
        self.restarts: dict[int, int] = {}  # stage index -> its restarts so far (each names its actor anew)

    def __getitem__(self, index: int):
        return self.actors[index]

    def __iter__(self):
        return iter(self.actors)

    def read_stage_files(self, paths: list[str], indices) -> list[NodeStageFile]:
        """Each stage file of ``indices`` read on the node that will load it (the driver may not hold it)."""
        reader = stage_file_reader()
        readings = [reader.options(scheduling_strategy=self.reservation.scheduling_strategy(index)).remote(paths[index])
                    for index in indices]
        return ray_get(readings, ACTOR_START_SECONDS, PipelineError, "stage files were not read on their nodes",
                       "could not read the stage files on their nodes")

    def _new(self, index: int, path: str, loopback: bool):
        """A new stage actor for stage ``index`` on its node (it loads in the background)."""
        name = actor_name("stage", index, self.tag, self.restarts.get(index, 0))
        lasting = {"lifetime": "detached"} if self.detached else {}
        return stage_actor_class().options(**self.reservation.actor_options(index, num_cpus=1), name=name,
                                           **lasting).remote(
            path, self.settings, self.wire_dtype, self.secret, loopback, self.certificate)

    def start(self, paths: list[str], loopback: bool, taken_over: dict | None = None) -> list[StageDescription]:
        """Every stage's actor, once each has loaded its file. taken_over:
        stage index -> a live actor of an earlier coordinator holding that
        stage (orchestrator.cluster.kept_stages), used instead of a new one once it
        has forgotten every KV sequence."""
        import ray

        taken_over = taken_over or {}
        self.actors = [taken_over[index] if index in taken_over else self._new(index, path, loopback)
                       for index, path in enumerate(paths)]
        try:
            ray.get([actor.forget.remote() for actor in taken_over.values()], timeout=ACTOR_START_SECONDS)
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

    def restart(self, index: int, path: str, loopback: bool, cpus) -> StageDescription:
        """Kill stage ``index``'s actor and start a new one in its placement (pinned to ``cpus`` if given)."""
        import ray

        ray.kill(self.actors[index])
        self.restarts[index] = self.restarts.get(index, 0) + 1
        self.actors[index] = self._new(index, path, loopback)
        late, failed = f"stage {index} did not restart", f"stage {index} could not be restarted"
        described = ray_get(self.actors[index].describe.remote(), ACTOR_START_SECONDS, PipelineError, late, failed)
        if cpus is not None:
            ray_get(self.actors[index].pin.remote(cpus), STAGE_ANSWER_SECONDS, PipelineError, late, failed)
        return described

    def wire(self, chain, stages: list[StageDescription]) -> None:
        """Join the stages into ``chain`` (a new orchestrator.transport.chain.SocketChain):
        each stage connects to the next and the last to the chain, then the
        chain to the first; every stage's cancels reach the chain too."""
        import ray


        try:
            # Every connection is proved by a handshake, so each acceptor must be
            # listening while its peer connects: the chain's run in a thread meanwhile.
            with ThreadPoolExecutor(1) as accepting:
                last = accepting.submit(chain.accept_last, len(stages))
                downstream = [(stage.host, stage.port) for stage in stages[1:]] + [chain.address]
                ray.get([actor.connect_downstream.remote(*address) for actor, address in zip(self.actors, downstream)],
                        timeout=ACTOR_START_SECONDS)
                last.result()
                chain.connect_first(stages[0].host, stages[0].port)
                for actor in self.actors:  # one at a time, in stage order
                    cancels = accepting.submit(chain.accept_cancel)
                    ray.get(actor.connect_cancel.remote(*chain.address), timeout=ACTOR_START_SECONDS)
                    cancels.result()
        except ray.exceptions.RayError as error:
            raise PipelineError(f"the chain could not be set up: {one_line(error)}") from None

    def pin(self, cpu_sets: list) -> None:
        """Pin each stage's process to its CPUs (None: any of its node's)."""
        ray_get([actor.pin.remote(cpus) for actor, cpus in zip(self.actors, cpu_sets)], STAGE_ANSWER_SECONDS,
                PipelineError, "the stages were not pinned to their CPUs", "the stages could not be pinned to their CPUs")

    def stats(self) -> list[tuple[float, int, int, int]]:
        return ray_get([actor.stats.remote() for actor in self.actors], STAGE_ANSWER_SECONDS, PipelineError,
                       "the stages did not report", "the stages could not report")

    def load_calls(self) -> list:
        """Ray object refs of each stage's StageLoad (ray.get or await them)."""
        return [actor.load.remote() for actor in self.actors]

    def peak_rss_mb(self) -> list[float]:
        """Peak resident memory of each stage's process, in MiB."""
        return ray_get([actor.peak_rss_mb.remote() for actor in self.actors], STAGE_ANSWER_SECONDS, PipelineError,
                       "the stages did not report their memory", "the stages could not report their memory")

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
