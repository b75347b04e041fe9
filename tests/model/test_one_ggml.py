"""The process holds one copy of each ggml library, the one libllama loaded.

llama-cpp-python's wheel holds copies (not links) of libggml.so, .so.0 and
.so.0.x.y; libllama loads the .so.0. The stages read ggml's registry
(stages.backend.detect) and ggml's tensor calls (stages.engine, for the
hidden-state capture) from the library they open themselves: opening
another of the names loaded a second copy with its own registry and state,
and on the CUDA build the first model load then died of a segmentation
fault (docs/backends.md, 2026-12-04). Checked in a fresh process, through
its memory map, after a stage engine loaded a model and the backend was read."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from stages.backend import detect
from stages.engine import StageEngine
from stages.settings import StageSettings
detect()
StageEngine(sys.argv[1], StageSettings(n_ctx=256)).close()
files = {line.split()[-1] for line in open("/proc/self/maps") if "libggml" in line}
print("\\n".join(sorted(files)))
"""


def test_each_ggml_library_is_loaded_once(splits):
    done = subprocess.run([sys.executable, "-c", SCRIPT, splits[2][0]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    files = done.stdout.split()
    for library in ("libggml-base", "libggml.", "libggml-cpu"):
        assert len([file for file in files if f"/{library}" in file]) == 1, files
