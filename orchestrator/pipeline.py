"""The stages of a model in Ray actors, joined by a chain of sockets.

Ray places the actors and carries the control calls (describe, connect, stats);
the per-token path does not go through Ray: a plain actor call costs ~1-2 ms
on these machines, as much as a whole stage of a small model. Instead each
stage connects a TCP socket to the next, and the coordinator sends a batch to
stage 0 and reads the logits back from the last stage (orchestrator.wire).
Before any stage loads, each stage file's header is read on the node that is to
run it (the driver may not hold the other machines' files), and the set is
validated from those readings.
"""

from __future__ import annotations

import collections
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator import wire
from orchestrator.cluster import alive_nodes
from orchestrator.messages import Boundary, PassResult, Shutdown, StageBatch, StageFailure
from orchestrator.placement import plan_placement
from orchestrator.stage_server import StageDescription, StageServer
from stages.engine import StageSettings
from stages.gguf_file import ModelFileError, StageFileInfo, stage_info_of, validate_stage_set

ACTOR_START_SECONDS = 300.0


class PipelineError(RuntimeError):
    """A pipeline could not start or run; the message is one line."""


@dataclass(frozen=True)
class StageReport:
    """What a stage did over a run: its blocks [first_block, end_block), its node, its busy time."""

    stage_index: int
    first_block: int
    end_block: int
    node_id: str
    host: str
    busy_seconds: float
    passes: int


def check_stage_files(paths: list[str]) -> list[StageFileInfo | None]:
    """Validate a set of stage files on this machine before anything is loaded (ModelFileError if not)."""
    infos = [stage_info_of(path) for path in paths]
    validate_stage_set(infos, [Path(path) for path in paths])
    return infos


NOT_FOUND = "not found"


@dataclass(frozen=True)
class NodeStageFile:
    """A stage file's header as read on the node that is to run the stage.

    problem: "" if the file is a readable GGUF file, NOT_FOUND if there is no
    such file on that node, else why it cannot be used (one line).
    """

    node_address: str
    node_id: str
    info: StageFileInfo | None
    problem: str = ""


def read_stage_file(path: str, node_address: str, node_id: str) -> NodeStageFile:
    """Read a stage file's header on this node (run there as a Ray task)."""
    if not os.path.exists(path):
        return NodeStageFile(node_address, node_id, None, NOT_FOUND)
    try:
        return NodeStageFile(node_address, node_id, stage_info_of(path))
    except ModelFileError as error:
        return NodeStageFile(node_address, node_id, None, str(error))


def check_stage_files_on_nodes(paths: list[str], found: list[NodeStageFile]) -> list[StageFileInfo | None]:
    """Validate a set of stage files from their headers as read on their nodes
    (``found[i]`` for ``paths[i]``); ModelFileError names the node of a bad file."""
    for stage_index, (path, file) in enumerate(zip(paths, found)):
        node = f"node {file.node_address} ({file.node_id[:8]})"
        if file.problem == NOT_FOUND:
            raise ModelFileError(f"stage {stage_index} file {path} not found on {node}")
        if file.problem:
            raise ModelFileError(f"stage {stage_index} file on {node}: {file.problem}")
    infos = [file.info for file in found]
    validate_stage_set(infos, [Path(path) for path in paths])
    return infos


def one_line(error: BaseException) -> str:
    """The message of the StageError behind a Ray error, else its last line."""
    text = str(error)
    for line in reversed(text.splitlines()):
        if "StageError:" in line:
            return line.split("StageError:", 1)[1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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

        def __init__(self, path: str, settings: StageSettings, wire_dtype: str):
            from orchestrator.metrics import StageMetrics

            context = ray.get_runtime_context()
            self.server = StageServer(path, settings, ray.util.get_node_ip_address(), context.get_node_id(), wire_dtype)
            self.server.on_pass = StageMetrics(self.server.description.stage_index).record

        def describe(self) -> StageDescription:
            return self.server.description

        def connect_downstream(self, host: str, port: int) -> None:
            self.server.connect_downstream(host, port)

        def connect_notify(self, host: str, port: int) -> None:
            self.server.connect_notify(host, port)

        def stats(self) -> tuple[float, int]:
            return self.server.busy_seconds, self.server.passes

        def peak_rss_mb(self) -> float:
            return peak_rss_mb()

        def __repr__(self) -> str:  # the name shown on the Ray dashboard and in logs
            if not hasattr(self, "server"):
                return "stage (loading)"
            stage = self.server.description
            return f"stage-{stage.stage_index} [blocks {stage.first_block}-{stage.end_block})"

    return StageActor


@dataclass
class _InFlight:
    """A submitted pass: its id, when it was sent, and whether another pass
    was in flight at the same time (then wall time minus compute is not transport)."""

    pass_id: int
    started: float
    overlapped: bool


class Pipeline:
    """A running pipeline: ``forward`` sends one batch through every stage."""

    def __init__(
        self,
        stage_paths: list[str],
        settings: StageSettings = StageSettings(),
        *,
        wire_dtype: str = "f32",
        place: dict[int, str] | None = None,
        notify_boundaries: bool = False,
    ):
        """notify_boundaries: non-last stages report each pass leaving them
        (await_boundary); asynchronous speculation needs it."""
        import ray

        self.stage_paths = list(stage_paths)
        local_node = ray.get_runtime_context().get_node_id()
        self._plan = plan_placement(alive_nodes(), len(stage_paths), local_node, place)
        self._placement_group = None
        self.actors = []
        try:
            # Each file is read on the node that will load it (the driver may not hold it).
            self.stage_files = self._check_stage_files_on_their_nodes()
        except BaseException:
            self.close()
            raise
        actor_class = _stage_actor_class()
        for index, path in enumerate(stage_paths):
            options = self.actor_options(index, num_cpus=1)
            self.actors.append(actor_class.options(**options).remote(path, settings, wire_dtype))
        try:
            self.stages: list[StageDescription] = ray.get(
                [actor.describe.remote() for actor in self.actors], timeout=ACTOR_START_SECONDS
            )
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise PipelineError(f"stages did not start within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            self.close()
            raise PipelineError(f"a stage failed to start: {one_line(error)}") from None
        self.n_vocab = self.stages[-1].n_vocab
        self.n_batch = settings.n_batch

        # Wire the chain: each stage connects to the next; the last to us.
        host = ray.util.get_node_ip_address()
        self._listener = wire.listen(host)
        downstream = [(stage.host, stage.port) for stage in self.stages[1:]]
        downstream.append((host, self._listener.getsockname()[1]))
        ray.get([actor.connect_downstream.remote(*address) for actor, address in zip(self.actors, downstream)])
        self._to_first = wire.connect(self.stages[0].host, self.stages[0].port)
        self._listener.settimeout(30.0)
        self._from_last: socket.socket = self._accept()
        self._boundaries: list[socket.socket] = []
        if notify_boundaries:
            for actor in self.actors[:-1]:  # one at a time, so accept() order is stage order
                ray.get(actor.connect_notify.remote(host, self._listener.getsockname()[1]))
                self._boundaries.append(self._accept())
        self._pass_id = 0
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._boundary_seen = [0] * len(self._boundaries)  # last pass id each stage reported
        self._closed = False
        # Wall time of passes minus the stages' own compute: the transport cost
        # of all len(stages) + 1 hops (coordinator -> stages -> coordinator),
        # over the passes that ran alone.
        self.transport_seconds = 0.0
        self.passes = 0

    def _check_stage_files_on_their_nodes(self) -> list[StageFileInfo | None]:
        import ray

        reader = _stage_file_reader()
        readings = [
            reader.options(scheduling_strategy=self.scheduling_strategy(index)).remote(path)
            for index, path in enumerate(self.stage_paths)
        ]
        try:
            found = ray.get(readings, timeout=ACTOR_START_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"stage files were not read on their nodes within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise PipelineError(f"could not read the stage files on their nodes: {one_line(error)}") from None
        return check_stage_files_on_nodes(self.stage_paths, found)

    def _accept(self) -> socket.socket:
        connection, _ = self._listener.accept()
        connection.settimeout(None)
        return wire.tune(connection)

    def actor_options(self, index: int, *, num_cpus: float) -> dict:
        """Ray options that put an actor on stage ``index``'s node (in its placement bundle)."""
        return {
            "max_restarts": 0,
            "scheduling_strategy": self.scheduling_strategy(index),
            # in a placement group the bundle reserved the CPU; pinned to a node, nothing is reserved
            "num_cpus": num_cpus if self._plan.strategy == "spread" else 0,
        }

    def scheduling_strategy(self, index: int):
        """The Ray scheduling strategy that puts a task or actor on stage ``index``'s node."""
        import ray
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        plan, count = self._plan, len(self.stage_paths)
        if plan.strategy == "spread":
            if self._placement_group is None:
                self._placement_group = ray.util.placement_group([{"CPU": 1}] * count, strategy="STRICT_SPREAD")
                try:
                    ray.get(self._placement_group.ready(), timeout=60)
                except ray.exceptions.GetTimeoutError:
                    ray.util.remove_placement_group(self._placement_group)
                    self._placement_group = None
                    raise PipelineError(
                        f"could not place {count} stages on {count} different nodes (each needs 1 free CPU)"
                    ) from None
            return PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=index)
        return NodeAffinitySchedulingStrategy(plan.node_ids[index], soft=False)

    # -- the hot path -------------------------------------------------------
    def forward(
        self, positions: np.ndarray, tokens: np.ndarray, keep: int, logit_rows: np.ndarray | None = None
    ) -> PassResult:
        """Run tokens int32[n] at positions int32[n] through every stage.

        keep: each stage first drops cached positions >= keep.
        Returns the logits float32[len(logit_rows), n_vocab] (default: last row).
        """
        self.submit(positions, tokens, keep, logit_rows)
        return self.receive()

    def submit(
        self, positions: np.ndarray, tokens: np.ndarray, keep: int, logit_rows: np.ndarray | None = None
    ) -> int:
        """Start a pass (see forward) and return its id; results come back in
        submission order through receive(). A pass may be submitted while
        another is in flight: the stages run them in order, one after the other."""
        if logit_rows is None:
            logit_rows = np.array([len(tokens) - 1], dtype=np.int32)
        self._pass_id += 1
        overlapping = bool(self._in_flight)
        for entry in self._in_flight:
            entry.overlapped = True
        self._in_flight.append(_InFlight(self._pass_id, time.perf_counter(), overlapping))
        wire.send_message(self._to_first, StageBatch(self._pass_id, keep, positions, logit_rows, tokens=tokens))
        return self._pass_id

    def await_boundary(self, stage_index: int) -> int:
        """Block until the next pass has left stage ``stage_index``; return its id
        (needs notify_boundaries). receive() consumes notices not awaited."""
        notice = wire.receive_message(self._boundaries[stage_index])
        if not isinstance(notice, Boundary) or notice.pass_id != self._boundary_seen[stage_index] + 1:
            raise PipelineError(f"stage {stage_index} reported {notice} after pass {self._boundary_seen[stage_index]}")
        self._boundary_seen[stage_index] = notice.pass_id
        return notice.pass_id

    def receive(self) -> PassResult:
        """The logits of the oldest pass in flight."""
        entry = self._in_flight.popleft()
        pass_id = entry.pass_id
        for stage_index in range(len(self._boundaries)):
            while self._boundary_seen[stage_index] < pass_id:
                self.await_boundary(stage_index)
        reply = wire.receive_message(self._from_last)
        if isinstance(reply, StageFailure):
            raise PipelineError(f"stage {reply.stage_index} failed: {reply.message}")
        if not isinstance(reply, PassResult) or reply.pass_id != pass_id:
            raise PipelineError(f"unexpected reply {type(reply).__name__} to pass {pass_id}")
        if not entry.overlapped:  # wall time minus compute is transport only for a pass that ran alone
            self.transport_seconds += time.perf_counter() - entry.started - sum(reply.stage_seconds)
            self.passes += 1
        return reply

    @property
    def hop_seconds(self) -> float:
        """Mean transport time of one hop, over all passes so far."""
        hops = self.passes * (len(self.stages) + 1)
        return self.transport_seconds / hops if hops else 0.0

    # -- reporting and shutdown ------------------------------------------
    def reports(self) -> list[StageReport]:
        import ray

        stats = ray.get([actor.stats.remote() for actor in self.actors])
        return [
            StageReport(stage.stage_index, stage.first_block, stage.end_block, stage.node_id, stage.host, busy, passes)
            for stage, (busy, passes) in zip(self.stages, stats)
        ]

    def peak_rss_mb(self) -> list[float]:
        """Peak resident memory of each stage's process, in MiB."""
        import ray

        return ray.get([actor.peak_rss_mb.remote() for actor in self.actors])

    def close(self) -> None:
        import ray

        if not getattr(self, "_closed", True):
            self._closed = True
            try:
                wire.send_message(self._to_first, Shutdown())
                self._from_last.settimeout(10.0)
                wire.receive_message(self._from_last)
            except (OSError, wire.ConnectionClosed):
                pass
            self._to_first.close()
            self._from_last.close()
            for connection in self._boundaries:
                connection.close()
            self._listener.close()
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "_placement_group", None) is not None:
            ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

