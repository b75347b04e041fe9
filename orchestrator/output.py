"""Writing a result file so that it appears complete or not at all."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from stages.errors import SpecpipeError


class OutputError(SpecpipeError):
    """A result file could not be written; the message names it."""


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` the file into PATH.partial (same suffix), then rename it to
    ``path``; on any failure nothing is left under either name."""
    partial = path.with_name(path.name + ".partial" + path.suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(partial)
        os.replace(partial, path)
    except OSError as error:
        raise OutputError(f"{path}: {error.strerror or error}") from None
    finally:
        partial.unlink(missing_ok=True)
