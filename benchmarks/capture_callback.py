"""A non-last stage's graph callback in C (stages.capture, what the engine
uses) against the same callback in Python (the engine's earlier one, kept
here only to measure), side by side in one run: one-token decode passes of
SmolLM2's stage 0, alternating between two engines on the same file.

    python -m benchmarks.capture_callback [--passes 300] [--repetitions 5]
"""

from __future__ import annotations

import ctypes
import statistics
import time

import click
import numpy as np


def _python_callback_engine(path: str, settings):
    """A StageEngine whose capture is a Python ctypes callback, as before stages.capture."""
    import llama_cpp

    from stages import engine as engine_module

    ggml = engine_module._ggml_base
    ggml.ggml_get_name.argtypes, ggml.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    ggml.ggml_nbytes.argtypes, ggml.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    captured: list[np.ndarray] = []

    class PythonCapture:
        def __init__(self, wanted: str, width: int):
            self.wanted, self.width = wanted.encode(), width
            self.function = llama_cpp.ggml_backend_sched_eval_callback(self.on_node)
            self.callback = ctypes.cast(self.function, ctypes.c_void_p).value
            self.user_data = None

        def on_node(self, tensor, ask, user_data):  # noqa: ARG002
            if ask:
                return ggml.ggml_get_name(tensor) == self.wanted
            if ggml.ggml_get_name(tensor) != self.wanted:
                return True
            out = np.empty(ggml.ggml_nbytes(tensor) // 4, dtype=np.float32)
            ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
            captured[:] = [out.reshape(-1, self.width)]
            return False

        def start(self):
            captured.clear()

        def captured(self):
            return captured[0] if captured else None

    original = engine_module.NodeCapture
    engine_module.NodeCapture = lambda ggml_base, wanted, rows, width: PythonCapture(wanted, width)
    try:
        return engine_module.StageEngine(path, settings)
    finally:
        engine_module.NodeCapture = original


def _pass_seconds(engine, start: int, passes: int) -> float:
    """Median seconds of one-token passes after a 64-token context."""
    engine.remove(0)
    engine.decode(np.arange(64, dtype=np.int32), tokens=np.arange(100, 164, dtype=np.int32))
    times = []
    for index in range(passes):
        started = time.perf_counter()
        engine.decode(np.array([64 + index], np.int32), tokens=np.array([start + index], np.int32))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@click.command()
@click.option("--passes", default=300, show_default=True, type=click.IntRange(10))
@click.option("--repetitions", default=5, show_default=True, type=click.IntRange(1))
def main(passes: int, repetitions: int) -> None:
    from orchestrator.config import default_stage_paths
    from stages.engine import StageEngine
    from stages.settings import StageSettings

    path, settings = default_stage_paths()[0], StageSettings(n_ctx=512)
    engines = {"C (stages.capture)": StageEngine(path, settings),
               "Python ctypes callback": _python_callback_engine(path, settings)}
    outputs = [engine.decode(np.arange(8, dtype=np.int32), tokens=np.arange(300, 308, dtype=np.int32))
               for engine in engines.values()]
    assert np.array_equal(*outputs), "the two captures differ"
    medians: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repetitions):
        for name, engine in engines.items():
            medians[name].append(_pass_seconds(engine, 500, passes))
    print("| capture | stage-0 pass (ms), median (min-max) over repetitions |")
    print("| --- | ---: |")
    for name, values in medians.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.3f} ({min(values) * 1e3:.3f}-{max(values) * 1e3:.3f}) |")
    ratios = [c / p for c, p in zip(*medians.values())]
    print(f"\nC / Python: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"{passes} passes x {repetitions} repetitions, outputs identical")


if __name__ == "__main__":
    main()
