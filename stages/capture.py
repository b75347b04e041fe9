"""The hidden-state capture of a non-last stage, as a C graph callback.

llama.cpp calls a context's ``cb_eval`` for every node of every pass (544
calls a pass for SmolLM2's stage 0). As a Python ctypes callback that cost
about 0.34 ms of Python per pass, plus the ctypes transitions, in a pass of
~5 ms (measured here). ``capture.c`` does the same in C: it asks for the last
block's output node by name, copies it into a numpy buffer, and stops the
graph. It is compiled on first use with the C compiler llama-cpp-python's own
build needs (so every node that runs a stage has one), into the cache folder,
keyed by the source's digest; ggml's three functions are handed in as
pointers, so it links against nothing.

The same library holds the abort callback that stops a pass mid-graph when
the coordinator cancels it (``AbortFlag``): llama.cpp asks it after every
node, so it too must not be Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from stages.errors import SpecpipeError

SOURCE = Path(__file__).with_name("capture.c")


class CaptureError(SpecpipeError):
    """The capture helper could not be built or loaded; the message is one line."""


class _Capture(ctypes.Structure):
    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("wanted", ctypes.c_char * 64),
        ("buffer", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("captured", ctypes.c_size_t),
    ]


NOT_FITTING = ctypes.c_size_t(-1).value


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specpipe"


def library_path() -> Path:
    """The compiled helper, built now if it is not there yet."""
    source = SOURCE.read_bytes()
    target = _cache_folder() / f"capture-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".partial")
    os.close(handle)
    try:
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", partial, str(SOURCE)],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)  # whole or not at all: stages building at once both succeed
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        raise CaptureError(f"could not build {SOURCE.name} with the C compiler: {detail.strip()[:300]}") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


class AbortFlag:
    """Stops the pass running in a llama.cpp context: llama.cpp asks
    ``callback`` (C, in stages/capture.c) after every graph node whether to
    stop, and it reads an int that ``set`` raises from any thread."""

    def __init__(self) -> None:
        self._library = ctypes.CDLL(str(library_path()))
        self.callback = ctypes.cast(self._library.specpipe_abort_requested, ctypes.c_void_p).value
        self._flag = ctypes.c_int(0)
        self.user_data = ctypes.addressof(self._flag)
        self._event = threading.Event()  # the same flag, for a Python thread to wait on

    def set(self) -> None:
        self._flag.value = 1
        self._event.set()

    def clear(self) -> None:
        self._flag.value = 0
        self._event.clear()

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, or until the flag is set; True when it was."""
        return self._event.wait(seconds)

    @property
    def is_set(self) -> bool:
        return bool(self._flag.value)


class NodeCapture:
    """Copies graph node ``wanted`` (float32[rows, width]) out of each pass."""

    def __init__(self, ggml_base: ctypes.CDLL, wanted: str, rows: int, width: int):
        """ggml_base: the loaded libggml-base; rows: the most a pass has (n_batch)."""
        self._library = ctypes.CDLL(str(library_path()))
        self.callback = ctypes.cast(self._library.specpipe_capture_node, ctypes.c_void_p).value
        self.width = width
        self._buffer = np.empty((rows, width), dtype=np.float32)
        self._state = _Capture(
            get_name=ctypes.cast(ggml_base.ggml_get_name, ctypes.c_void_p).value,
            nbytes=ctypes.cast(ggml_base.ggml_nbytes, ctypes.c_void_p).value,
            tensor_get=ctypes.cast(ggml_base.ggml_backend_tensor_get, ctypes.c_void_p).value,
            wanted=wanted.encode(),
            buffer=self._buffer.ctypes.data,
            capacity=self._buffer.nbytes,
            captured=0,
        )
        self.user_data = ctypes.addressof(self._state)

    def start(self) -> None:
        """Before a pass: nothing captured yet."""
        self._state.captured = 0

    def captured(self) -> np.ndarray | None:
        """The node's rows from the last pass (a copy), or None if it never ran."""
        size = self._state.captured
        if size == 0:
            return None
        if size == NOT_FITTING:
            raise CaptureError(f"the node {self._state.wanted.decode()} was larger than {self._buffer.nbytes} bytes")
        return self._buffer.reshape(-1)[: size // 4].reshape(-1, self.width).copy()
