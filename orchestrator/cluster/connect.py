"""Connecting to Ray: an existing cluster, or a local instance started for one run;
and what its dashboard shows of a run (the line that names it, the actors' names)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

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
def ray_session(address: str | None, *, dashboard: bool = False, num_cpus: int | None = None,
                namespace: str | None = None) -> Iterator[str | None]:
    """Connect to ``address`` ("auto" honours RAY_ADDRESS), or start a local Ray.

    A local instance is shut down on exit; a cluster one connected to is left
    running. Yields a line naming the dashboard URL and how to log in to it
    and, for a local instance with a dashboard, the metrics endpoint (None when
    there is neither; dashboard_line). namespace: Ray's for this process
    (None: an anonymous one of its own). An already initialised Ray (tests
    share one per session) is used as it is.
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
                namespace=namespace,
            )
        else:
            context = ray.init(address=address, log_to_driver=False, configure_logging=False, namespace=namespace)
    except (ConnectionError, RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = ""
        if address is not None and os.environ.get("RAY_AUTH_MODE") != "token":
            hint = " (a cluster started with RAY_AUTH_MODE=token, as cluster.yaml does, needs it set here too)"
        raise ClusterError(f"could not {'start' if address is None else 'connect to'} Ray: {first_line}{hint}") from None
    try:
        metrics = None
        if address is None and metrics_port:
            metrics = f"http://{ray.util.get_node_ip_address()}:{metrics_port}/metrics"
        yield dashboard_line(context.dashboard_url, metrics, token_auth_enabled(), ray_command())
    finally:
        ray.shutdown()


def dashboard_line(dashboard_url: str | None, metrics_url: str | None, token_auth: bool, ray_cli: str) -> str | None:
    """The status line naming the dashboard (``dashboard_url`` as ray.init
    reports it, host:port) and how to get in, then the metrics endpoint; None
    when there is neither. With Ray's token authentication on (``token_auth``)
    the page asks for Ray's token, which ``<ray_cli> get-auth-token`` prints
    (ray_cli: Ray's command, ray_command())."""
    parts = []
    if dashboard_url:
        access = (f"it asks for Ray's token: `{ray_cli} get-auth-token` prints it" if token_auth
                  else "no token needed: Ray's token authentication is off")
        parts.append(f"Ray dashboard: http://{dashboard_url} ({access})")
    if metrics_url:
        parts.append(f"metrics: {metrics_url}")
    return "; ".join(parts) or None


def token_auth_enabled() -> bool:
    """Whether this process talks to Ray with token authentication (after
    ray.init: a local Ray turns it on unless RAY_AUTH_MODE says otherwise)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication, or one that moved it
        return os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    return is_token_auth_enabled()


def ray_command() -> str:
    """Ray's command beside this Python (.venv/bin/ray), which need not be on PATH; else plain ``ray``."""

    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else "ray"


def readable_class_name(cls: type) -> type:
    """``cls`` with its own name as its qualified name, for a class defined
    inside a function (so that importing its module does not import Ray): the
    dashboard's Actors page shows an actor's class by ``__qualname__``, which
    would read ``stage_actor_class.<locals>.StageActor``. Apply it before
    ``ray.remote``, which reads the name. (The class is still pickled by value:
    its module has no attribute of that name.)"""
    cls.__qualname__ = cls.__name__
    return cls


def actor_name(role: str, index: int, tag: str, restarts: int = 0) -> str:
    """The Ray name of a pipeline's actor, shown on the dashboard's Actors
    page: ``specpipe-stage-0.3f9a`` for stage 0 (role "stage", or "drafter")
    of the pipeline tagged 3f9a (pipeline_tag), ``specpipe-stage-0.3f9a.r1``
    after its first restart: ray.kill frees a name only milliseconds after it
    returns, and Ray refuses a name still held (docs/decisions.md)."""
    return f"specpipe-{role}-{index}.{tag}" + (f".r{restarts}" if restarts else "")


def pipeline_tag() -> str:
    """Four hex digits that no live stage 0 in this Ray namespace is named
    with: pipelines side by side (a test's, `orchestrate serve`'s replicas)
    name their actors apart. Random, not counted: a count would start again in
    each process, and the processes of one job (Serve's replicas) share its namespace."""
    import ray

    while True:
        tag = secrets.token_hex(2)
        try:
            ray.get_actor(actor_name("stage", 0, tag))
        except ValueError:  # no such actor: the tag is free
            return tag


def kept_group(name: str):
    """The placement group named ``name`` in this namespace (an earlier
    coordinator's, orchestrator.cluster.kept_stages), or None."""
    import ray

    if not name:
        return None
    try:
        return ray.util.get_placement_group(name)
    except ValueError:
        return None


def free_port() -> int:
    """A TCP port free on every interface of this machine now (the OS's pick).
    The one helper for it: Ray's metrics port, the bench's and the tests' servers."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MiB (getrusage counts KiB on Linux, bytes on macOS)."""

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024**2 if sys.platform == "darwin" else peak / 1024
