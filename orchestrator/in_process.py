"""A target without Ray and without sockets: stage engines one after another in this process.

The decoding loop (orchestrator.decoding.loop) drives it as it drives a
``Pipeline``: ``InProcessPipeline`` holds the real llama.cpp engines of the stage
files, and each submitted pass runs through them at once, stage by stage (no
overlap between stages: it measures compute and exactness, not pipelining).
One path makes it the whole model. The model tier's tests and the device
check (benchmarks.device_check, which runs where Ray is not installed) use it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from orchestrator.decoding.targets import PassReplies, choice_of
from orchestrator.decoding.windows import TargetPass, Window
from orchestrator.transport.messages import PassResult
from orchestrator.workers.token_chooser import TokenChooser
from stages.engine import StageEngine
from stages.tree_shape import depths


def window_positions(window: Window) -> tuple[np.ndarray, np.ndarray | None]:
    """(positions int32[n_rows], tree parents int32[n_rows] or None for a chain) of a window's rows."""
    parents = None if window.parents is None else np.asarray(window.batch_parents, np.int32)
    if parents is None:
        return np.arange(window.first, window.first + len(window.inputs), dtype=np.int32), None
    return (window.first + depths(parents)).astype(np.int32), parents


class InProcessPipeline:
    """The engines of ``paths`` (stage files in order, or one whole model) as a
    target. stage_seconds of every result are zeros. A pass's logits come
    back, and the loop verifies them; but a pass with a window under a
    grammar has its tokens chosen here, as the last stage of a pipeline
    chooses them (orchestrator.workers.token_chooser)."""

    def __init__(self, paths: list[str], settings):
        self.engines = []
        try:
            for path in paths:
                self.engines.append(StageEngine(path, settings))
        except BaseException:
            self.close()
            raise
        self.n_batch = settings.n_batch
        self.stage_count = len(self.engines)
        self.pending: deque[PassResult | PassReplies] = deque()
        self.chooser = TokenChooser(self.engines[-1].vocabulary_pointer)

    def submit(self, target_pass: TargetPass) -> None:
        """Run the pass through every engine now: one window, or a batched
        pass's windows (chains of one width) in one llama.cpp call per engine,
        each window's rows at its own KV sequence."""
        windows = target_pass.windows
        placed = [window_positions(window) for window in windows]
        positions = np.concatenate([window_rows for window_rows, _ in placed])
        parents = placed[0][1] if len(windows) == 1 else None
        sequence = windows[0].sequence if len(windows) == 1 else np.concatenate(
            [np.full(len(window.inputs), window.sequence, np.int32) for window in windows])
        starts = np.cumsum([0] + [len(window.inputs) for window in windows])
        rows = np.concatenate([np.asarray(window.logit_rows, np.int32) + start for window, start in zip(windows, starts)])
        hidden = None
        for engine in self.engines:
            for window in windows:
                engine.remove(window.first, window.sequence)
            if engine.is_first:
                tokens = np.concatenate([np.asarray(window.inputs, np.int32) for window in windows])
                hidden = engine.decode(positions, tokens=tokens, sequence=sequence, logit_rows=rows, parents=parents)
            else:
                hidden = engine.decode(positions, hidden=hidden, sequence=sequence, logit_rows=rows, parents=parents)
        self.pending.append(self._result(windows, hidden))

    def _result(self, windows: tuple[Window, ...], logits: np.ndarray) -> PassResult | PassReplies:
        """The pass's logits, or, with a grammar, each window's chosen tokens."""
        seconds = (0.0,) * len(self.engines)
        if all(window.grammar is None for window in windows):
            return PassResult(0, logits, seconds)
        replies, start = [], 0
        for window in windows:
            rows = logits[start:start + len(window.logit_rows)]
            start += len(window.logit_rows)
            choice = choice_of(window)
            if choice is None:
                replies.append(PassResult(0, rows, seconds))
            else:
                tokens, logprobs = self.chooser.choose(window.sequence, choice, rows)
                replies.append(PassResult(0, None, seconds, tokens=tokens, logprobs=logprobs))
        return replies[0] if len(windows) == 1 else PassReplies(tuple(replies), tuple(window.sequence for window in windows))

    def cancel(self, target_pass: TargetPass) -> None:
        """Nothing to stop: the pass was computed when submitted."""

    def result_within(self, seconds: float) -> bool:
        """Every pass was computed when submitted."""
        return True

    def receive(self) -> PassResult | PassReplies:
        return self.pending.popleft()

    def release(self, sequence: int) -> None:
        for engine in self.engines:
            engine.remove(0, sequence)

    def copy(self, source: int, destination: int, length: int) -> None:
        for engine in self.engines:
            engine.copy(source, destination, length)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
