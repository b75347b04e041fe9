"""A target without Ray and without sockets: stage engines one after another in this process.

The decoding loop (orchestrator.decoding.loop) drives it as it drives a
``Pipeline``: ``EngineChain`` holds the real llama.cpp engines of the stage
files, and each submitted pass runs through them at once, stage by stage (no
overlap between stages: it measures compute and exactness, not pipelining).
One path makes it the whole model. The model tier's tests and the device
check (benchmarks.device_check, which runs where Ray is not installed) use it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from orchestrator.decoding.schedule import TargetPass, Window
from orchestrator.transport.messages import PassResult
from speculators.tree import depths


def window_positions(window: Window) -> tuple[np.ndarray, np.ndarray | None]:
    """(positions int32[n_rows], tree parents int32[n_rows] or None for a chain) of a window's rows."""
    parents = None if window.parents is None else np.asarray(window.batch_parents, np.int32)
    if parents is None:
        return np.arange(window.first, window.first + len(window.inputs), dtype=np.int32), None
    return (window.first + depths(parents)).astype(np.int32), parents


class EngineChain:
    """The engines of ``paths`` (stage files in order, or one whole model) as a
    target; one window per pass. stage_seconds of every result are zeros."""

    def __init__(self, paths: list[str], settings):
        from stages.engine import StageEngine

        self.engines = []
        try:
            for path in paths:
                self.engines.append(StageEngine(path, settings))
        except BaseException:
            self.close()
            raise
        self.n_batch = settings.n_batch
        self.stage_count = len(self.engines)
        self.pending: deque[PassResult] = deque()

    def submit(self, target_pass: TargetPass) -> None:
        (window,) = target_pass.windows
        positions, parents = window_positions(window)
        rows = np.asarray(window.logit_rows, dtype=np.int32)
        hidden = None
        for engine in self.engines:
            engine.remove(window.first, window.sequence)
            if engine.is_first:
                hidden = engine.decode(positions, tokens=np.asarray(window.inputs, np.int32),
                                       sequence=window.sequence, logit_rows=rows, parents=parents)
            else:
                hidden = engine.decode(positions, hidden=hidden, sequence=window.sequence, logit_rows=rows,
                                       parents=parents)
        self.pending.append(PassResult(0, hidden, (0.0,) * len(self.engines)))

    def cancel(self, target_pass: TargetPass) -> None:
        """Nothing to stop: the pass was computed when submitted."""

    def receive(self) -> PassResult:
        return self.pending.popleft()

    def await_boundary(self, stage_index: int) -> int:
        return 0

    def release(self, sequence: int) -> None:
        for engine in self.engines:
            engine.remove(0, sequence)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
