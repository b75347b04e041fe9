"""A model requantized by llama.cpp's own quantizer (``llama_model_quantize``):
the same blocks at fewer bits, so its next-token choices agree with the
original's often, not always. The bench and the tests make their draft of
realistic agreement this way (benchmarks.drafts); nothing here is a user's path."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from stages.errors import SpecpipeError

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")


class RequantizeError(SpecpipeError):
    """The quantizer refused; the message is one line."""


def requantize(source: str | os.PathLike[str], destination: str | os.PathLike[str], type_name: str,
               threads: int = 2) -> Path:
    """Write ``source`` quantized to ``type_name`` (one of TYPES) at
    ``destination``, whole or not at all (``<name>.partial`` renamed once done)."""
    from stages.llama import llama_cpp

    from stages.engine import ensure_backend, quiet_logs

    if type_name not in TYPES:
        raise RequantizeError(f"unknown quantization {type_name!r} (choose {', '.join(TYPES)})")
    destination = Path(destination)
    partial = destination.with_name(destination.name + ".partial")
    ensure_backend()
    quiet_logs()  # a line per tensor otherwise
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.allow_requantize = True  # the source is quantized already
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(partial), ctypes.byref(params))
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RequantizeError(f"{source}: llama.cpp's quantizer failed ({status}) making {type_name}")
    partial.replace(destination)
    return destination
