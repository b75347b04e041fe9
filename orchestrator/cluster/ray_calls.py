"""Waiting on Ray and saying what went wrong: every wait on an actor with a
deadline (``ray_get``), every Ray error as the one line that names its cause
(``one_line``)."""

from __future__ import annotations

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
