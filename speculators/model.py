"""Greedy chain drafting with a small GGUF model of the target's vocabulary."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for left, right in zip(first, second):
        if left != right:
            break
        length += 1
    return length


DRAFT_DEVICES = ("auto", "cpu", "gpu")


def draft_gpu_layers(device: str) -> int:
    """n_gpu_layers of a draft model on ``device`` (--draft-device), for this
    process's llama.cpp build: cpu none (the seed's setup: the target on the
    GPU, its draft on the CPU cores beside it); gpu all, refused on a build
    without a GPU; auto: all where the build has a GPU, else none."""
    from stages.backend import detect
    from stages.engine import StageError
    from stages.settings import ALL_LAYERS

    if device not in DRAFT_DEVICES:
        raise StageError(f"unknown draft device {device!r} (choose {', '.join(DRAFT_DEVICES)})")
    backend = detect()
    if device == "gpu" and not backend.offloads:
        raise StageError(f"--draft-device gpu: this llama.cpp build ({backend.name}) has no GPU")
    return 0 if device == "cpu" or not backend.offloads else ALL_LAYERS


def load_draft_engine(path: str, *, n_ctx: int = 4096, threads: int = 1, sequences: int = 1, device: str = "auto"):
    """A draft model's engine on ``device`` (draft_gpu_layers), with
    ``sequences`` KV sequences (one per request it drafts for)."""
    from stages.engine import StageEngine, StageError
    from stages.settings import StageSettings

    engine = StageEngine(path, StageSettings(n_ctx=n_ctx, threads=threads, sequences=sequences,
                                             n_gpu_layers=draft_gpu_layers(device)))
    if engine.stage_count != 1:
        engine.close()
        raise StageError(f"{path}: a draft model must be a whole model, not a stage file")
    return engine


class ModelSpeculator:
    """Drafts the draft model's argmax, while its probability is at least p_min.

    The draft model keeps its own KV cache of the tokens it has seen; a new
    context rolls it back to the common prefix and decodes only what is new.
    ``ModelSpeculator(path)`` loads its own draft model (on ``device``,
    load_draft_engine, with ``threads`` and ``sequences`` KV sequences, the
    others drafted in by its ``sibling``s); ``on(engine, sequence)``
    drafts in one KV sequence of a draft model shared by several requests.
    step_seconds: under an emulated cost curve (stages.cost_curve), the least
    time one step (one drafted token) takes; 0: as long as it really takes.
    """

    def __init__(self, path: str, *, p_min: float = 0.0, n_ctx: int = 4096, threads: int = 1,
                 step_seconds: float = 0.0, device: str = "auto", sequences: int = 1):
        engine = load_draft_engine(path, n_ctx=n_ctx, threads=threads, device=device, sequences=sequences)
        self._use(engine, 0, p_min, step_seconds)

    def sibling(self, sequence: int) -> ModelSpeculator:
        """A speculator drafting in KV sequence ``sequence`` of this one's draft model."""
        return ModelSpeculator.on(self.engine, sequence, self.p_min, self.step_seconds)

    @classmethod
    def on(cls, engine, sequence: int, p_min: float = 0.0, step_seconds: float = 0.0) -> ModelSpeculator:
        speculator = cls.__new__(cls)
        speculator._use(engine, sequence, p_min, step_seconds)
        return speculator

    def _use(self, engine, sequence: int, p_min: float, step_seconds: float) -> None:
        self.engine = engine
        self.sequence = sequence
        self.p_min = p_min
        self.step_seconds = step_seconds
        self.cached: list[int] = []  # tokens at positions 0..len-1 of the draft's KV sequence

    def extend(self, context: Sequence[int]) -> int | None:
        started = time.perf_counter()
        token = self._next_token(context)
        rest = self.step_seconds - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        return token

    def _next_token(self, context: Sequence[int]) -> int | None:
        keep = min(common_prefix_length(self.cached, context), len(context) - 1)  # always decode the last token
        self.engine.remove(keep, self.sequence)
        del self.cached[keep:]
        batch = self.engine.settings.n_batch
        logits = None
        for first in range(keep, len(context), batch):
            chunk = np.asarray(context[first : first + batch], dtype=np.int32)
            positions = np.arange(first, first + len(chunk), dtype=np.int32)
            logits = self.engine.decode(positions, tokens=chunk, sequence=self.sequence)[-1]
        self.cached = list(context)
        token = int(np.argmax(logits))
        if self.p_min > 0.0:
            shifted = np.exp(logits.astype(np.float64) - float(logits[token]))
            if 1.0 / shifted.sum() < self.p_min:  # probability of the argmax
                return None
        return token
