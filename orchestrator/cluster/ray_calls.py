"""Waiting on Ray and saying what went wrong: every wait on an actor with a
deadline (``ray_get``), every Ray error as the one line that names its cause
(``one_line``)."""

from __future__ import annotations

import glob
import os

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

    node = getattr(ray._private.worker.global_worker, "node", None)  # this driver's Ray node (no public API)
    held = held_log(node.get_logs_dir_path(), process_id) if node is not None else None
    return held or f"its log: worker-*-{process_id}.err in Ray's session logs on node {node_id[:8]}"


def held_log(logs: str, process_id: int) -> str | None:
    """The words "its log: PATH (its fatal error)" for a worker's stderr log in the folder logs, or None.
    Ray's log monitor moves a dead worker's logs to old/ beside them once it
    holds many files open, and a long session reuses process ids: the newest
    file of that process id, in either folder, is the one."""
    name = f"worker-*-{process_id}.err"
    newest = _newest(glob.glob(os.path.join(logs, name)) + glob.glob(os.path.join(logs, "old", name)))
    if newest is None:
        return None
    for path in _where_now(newest):
        try:
            with open(path, errors="replace") as log:
                fatal = [line.strip() for line in log if line.startswith("Fatal Python error")]
        except OSError:
            continue
        return f"its log: {path}" + (f" ({fatal[-1]})" if fatal else "")
    return f"its log: {newest}"


def _newest(paths: list[str]) -> str | None:
    """The most recently written of these files that still exist (the log monitor may move one meanwhile)."""
    written = []
    for path in paths:
        for where in _where_now(path):
            try:
                written.append((os.path.getmtime(where), where))
                break
            except OSError:  # gone
                continue
    return max(written)[1] if written else None


def _where_now(path: str) -> tuple[str, str]:
    """Where a log listed at ``path`` may be now: there, or in old/ beside it (the log monitor moves it)."""
    return path, os.path.join(os.path.dirname(path), "old", os.path.basename(path))
