"""Waiting on Ray and saying what went wrong: every wait on an actor with a
deadline (``ray_get``), every Ray error as the one line that names its cause
(``one_line``)."""

from __future__ import annotations

import glob

from stages.errors import SpecpipeError


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


def worker_log(node_id: str, process_id: int) -> str:
    """Where to read why a Ray worker process died (a stage that
    crashed natively: Ray's workers write a Python backtrace of a fatal
    signal to their stderr log): the file where this machine holds it
    (Ray's session logs, shared by the nodes of one machine), with the fatal
    error it names, if any; else the file's name on its node."""
    import ray

    name = f"worker-*-{process_id}.err"
    node = getattr(ray._private.worker.global_worker, "node", None)  # this driver's Ray node (no public API)
    found = sorted(glob.glob(f"{node.get_logs_dir_path()}/{name}")) if node is not None else []
    if not found:
        return f"its log: {name} in Ray's session logs on node {node_id[:8]}"
    with open(found[-1], errors="replace") as log:
        fatal = [line.strip() for line in log if line.startswith("Fatal Python error")]
    return f"its log: {found[-1]}" + (f" ({fatal[-1]})" if fatal else "")
