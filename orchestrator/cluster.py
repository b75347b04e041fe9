"""Connecting to Ray: an existing cluster, or a local instance started for one run."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from orchestrator.placement import NodeInfo

# Ray otherwise tries to report usage over the network, which these machines lack.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class ClusterError(RuntimeError):
    """Ray could not be reached or started; the message is one line."""


@contextlib.contextmanager
def ray_session(address: str | None, *, dashboard: bool = False, num_cpus: int | None = None) -> Iterator[str | None]:
    """Connect to ``address`` ("auto" honours RAY_ADDRESS), or start a local Ray.

    A local instance is shut down on exit; a cluster one connected to is left
    running. Yields a line naming the dashboard URL and, for a local instance
    with a dashboard, the metrics endpoint (None when there is neither). An
    already initialised Ray (tests share one per session) is used as it is.
    """
    import ray

    # Ray's token authentication stays on (its default); only its start-up
    # banner about it is silenced, so the command prints what it was asked to.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if ray.is_initialized():
        yield None
        return
    try:
        metrics_port = _free_port() if dashboard else None
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


def _free_port() -> int:
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
