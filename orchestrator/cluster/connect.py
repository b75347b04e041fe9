"""Connecting to Ray: an existing cluster, or a local instance started for one run."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from orchestrator.cluster.placement import NodeInfo
from stages.errors import SpecpipeError

def ray_environment() -> None:
    """Ray's settings for a Ray this process starts (called before ray.init;
    a variable already set wins). Ray otherwise tries to report usage over the
    network, which these machines lack; and it runs its workers (the stages)
    at nice 15, where any other process on the machine (a load generator, a
    build) takes their CPU first: the stages are the work, so nice 0.
    cluster.yaml sets the same for `ray start`."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")


class ClusterError(SpecpipeError):
    """Ray could not be reached or started; the message is one line."""


@contextlib.contextmanager
def ray_session(address: str | None, *, dashboard: bool = False, num_cpus: int | None = None) -> Iterator[str | None]:
    """Connect to ``address`` ("auto" honours RAY_ADDRESS), or start a local Ray.

    A local instance is shut down on exit; a cluster one connected to is left
    running. Yields a line naming the dashboard URL and, for a local instance
    with a dashboard, the metrics endpoint (None when there is neither). An
    already initialised Ray (tests share one per session) is used as it is.
    """
    ray_environment()
    import ray

    # Ray's token authentication stays on (its default); only its start-up
    # banner about it is silenced, so the command prints what it was asked to.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if ray.is_initialized():
        yield None
        return
    try:
        metrics_port = free_port() if dashboard else None
        if address is None:
            context = ray.init(
                address="local",
                include_dashboard=dashboard,
                num_cpus=num_cpus or os.cpu_count(),
                object_store_memory=300 * 1024**2,
                log_to_driver=False,
                configure_logging=False,
                _metrics_export_port=metrics_port,
            )
        else:
            context = ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = ""
        if address is not None and os.environ.get("RAY_AUTH_MODE") != "token":
            hint = " (a cluster started with RAY_AUTH_MODE=token, as cluster.yaml does, needs it set here too)"
        raise ClusterError(f"could not {'start' if address is None else 'connect to'} Ray: {first_line}{hint}") from None
    try:
        url = context.dashboard_url
        parts = [f"Ray dashboard: http://{url}"] if url else []
        if address is None and metrics_port:
            parts.append(f"metrics: http://{ray.util.get_node_ip_address()}:{metrics_port}/metrics")
        yield "; ".join(parts) or None
    finally:
        ray.shutdown()


def free_port() -> int:
    """A TCP port free on every interface of this machine now (the OS's pick).
    The one helper for it: Ray's metrics port, the bench's and the tests' servers."""
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def alive_nodes() -> list[NodeInfo]:
    import ray

    return [
        NodeInfo(
            node["NodeID"], node["NodeManagerAddress"], float(node["Resources"].get("CPU", 0)), dict(node["Resources"])
        )
        for node in ray.nodes()
        if node["Alive"]
    ]


def one_line(error: BaseException) -> str:
    """The message of the StageError behind a Ray error, else its last line."""
    text = str(error)
    for line in reversed(text.splitlines()):
        if "StageError:" in line:
            return line.split("StageError:", 1)[1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def ray_get(refs, seconds: float, error: type[SpecpipeError], late: str, failed: str):
    """``ray.get(refs)`` within ``seconds``: past them ``error("<late> within N s")``,
    on any other Ray error ``error("<failed>: <its one line>")``, so every
    wait on an actor has a deadline and every failure one line that names it."""
    import ray

    try:
        return ray.get(refs, timeout=seconds)
    except ray.exceptions.GetTimeoutError:
        raise error(f"{late} within {seconds:.0f} s") from None
    except ray.exceptions.RayError as cause:
        raise error(f"{failed}: {one_line(cause)}") from None


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MiB (getrusage counts KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024**2 if sys.platform == "darwin" else peak / 1024


class Reservation:
    """Where each stage's actors and tasks run, reserved up front.

    The placement decision is the pure ``placement.plan_placement``; for a
    "spread" plan the constructor reserves one CPU on each of n different
    nodes (a STRICT_SPREAD placement group), or fails with a ClusterError if the
    cluster cannot give them within PLACEMENT_SECONDS.
    Then ``scheduling_strategy`` and ``actor_options`` only read. ``release``
    gives the reservation back.
    """

    def __init__(self, stage_count: int, place: dict[int, str] | None = None):
        import ray

        from orchestrator.config import PLACEMENT_SECONDS
        from orchestrator.cluster.placement import plan_placement

        self.stage_count = stage_count
        self.plan = plan_placement(alive_nodes(), stage_count, ray.get_runtime_context().get_node_id(), place)
        self.placement_group = None
        if self.plan.strategy == "spread":
            self.placement_group = ray.util.placement_group([{"CPU": 1}] * stage_count, strategy="STRICT_SPREAD")
            try:
                ray.get(self.placement_group.ready(), timeout=PLACEMENT_SECONDS)
            except ray.exceptions.GetTimeoutError:
                self.release()
                raise ClusterError(
                    f"could not place {stage_count} stages on {stage_count} different nodes (each needs 1 free CPU)"
                ) from None

    def scheduling_strategy(self, stage_index: int):
        """The Ray scheduling strategy that puts a task or actor on stage ``stage_index``'s node."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if self.placement_group is not None:
            return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=stage_index)
        return NodeAffinitySchedulingStrategy(self.plan.node_ids[stage_index], soft=False)

    def actor_options(self, stage_index: int, *, num_cpus: float) -> dict:
        """Ray options that put an actor on stage ``stage_index``'s node (in its placement bundle)."""
        return {
            "max_restarts": 0,
            "scheduling_strategy": self.scheduling_strategy(stage_index),
            # in a placement group the bundle reserved the CPU; pinned to a node, nothing is reserved
            "num_cpus": num_cpus if self.placement_group is not None else 0,
        }

    def release(self) -> None:
        import ray

        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
