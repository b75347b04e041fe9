"""Drafting with a small GGUF model of the target's vocabulary: chains of its
argmax (or, when sampling, its coupled draws), and token trees of its most
probable continuations (speculators.model_tree)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from speculators.corrections import CORRECTION_RANKS
from speculators.model_tree import TreeGrowth, children_of
from speculators.sampling import SamplingSettings, choose_token
from speculators.tree import DraftTree
from stages.backend import detect
from stages.settings import ALL_LAYERS, StageSettings


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
    from stages.engine import StageError

    if device not in DRAFT_DEVICES:
        raise StageError(f"unknown draft device {device!r} (choose {', '.join(DRAFT_DEVICES)})")
    backend = detect()
    if device == "gpu" and not backend.offloads:
        raise StageError(f"--draft-device gpu: this llama.cpp build ({backend.name}) has no GPU")
    return 0 if device == "cpu" or not backend.offloads else ALL_LAYERS


def load_draft_engine(path: str, *, n_ctx: int = 4096, threads: int = 1, sequences: int = 1, device: str = "auto",
                      tree_branches: int = 0):
    """A draft model's engine on ``device`` (draft_gpu_layers), with
    ``sequences`` KV sequences (one per request it drafts for), or one and
    ``tree_branches`` KV ids to grow token trees in (speculators.model_tree)."""
    from stages.engine import StageEngine, StageError

    engine = StageEngine(path, StageSettings(n_ctx=n_ctx, threads=threads, sequences=sequences,
                                             n_gpu_layers=draft_gpu_layers(device), tree_sequences=tree_branches))
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
    time one step (one drafted token, or one round of a growing tree) takes;
    0: as long as it really takes. tree_branches: KV ids for growing token
    trees (grow_tree) or corrections (speculators.corrections; one sequence
    only); with them it keeps the draft's runners-up of each token it drafts.
    """

    def __init__(self, path: str, *, p_min: float = 0.0, n_ctx: int = 4096, threads: int = 1,
                 step_seconds: float = 0.0, device: str = "auto", sequences: int = 1, tree_branches: int = 0):
        engine = load_draft_engine(path, n_ctx=n_ctx, threads=threads, device=device, sequences=sequences,
                                   tree_branches=tree_branches)
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
        # position -> the draft's next best tokens there, for each token it drafted (corrections.py forks on them)
        self.runners_up: dict[int, list[int]] = {}
        self.round_seconds: dict[int, float] | None = None  # a correction round's seconds by its rows, once timed

    def extend(self, context: Sequence[int], sampling: SamplingSettings | None = None) -> int | None:
        """The next draft token: the draft's argmax, or with ``sampling`` (not
        greedy) its coupled draw, sampled with the uniform the target uses at
        that position (speculators.model_tree says why)."""
        started = time.perf_counter()
        logits = self._context_logits(context)
        token = int(np.argmax(logits))
        if self.p_min > 0.0:
            shifted = np.exp(logits.astype(np.float64) - float(logits[token]))
            if 1.0 / shifted.sum() < self.p_min:  # probability of the argmax
                token = None
        if token is not None and sampling is not None and not sampling.greedy:
            token = choose_token(logits, len(context), sampling)
        if token is not None and self.engine.tree_sequences:  # corrections fork in tree ids: none, none kept
            self.note_runner_up(len(context), token, logits, sampling)
        rest = self.step_seconds - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        return token

    def grow_tree(self, context: Sequence[int], *, rows: int, depth: int, leaves: int,
                  sampling: SamplingSettings | None = None, seconds: float = 1.0, acceptance: float = 0.5) -> DraftTree:
        """SpecExec's tree of the draft's most likely accepted continuations of
        ``context`` (speculators.model_tree): at most ``rows`` rows, ``depth``
        deep, ``leaves`` leaves, grown for at most ``seconds``; acceptance: the
        weight of the draft's own choice at a node. A draft engine without
        tree ids (one shared by several requests) drafts a chain."""
        if not self.engine.tree_sequences or self.sequence != 0:
            drafts: list[int] = []
            while len(drafts) < min(rows, depth) and (token := self.extend([*context, *drafts], sampling)) is not None:
                drafts.append(token)
            return DraftTree.chain(int(context[-1]), drafts)
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        growth = TreeGrowth(self.engine, context, self._context_logits(context), sampling, depth, self.step_seconds,
                            acceptance)
        rest = self.step_seconds - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        growth.grow(rows, deadline)
        self.cached = [*context, *growth.main_tokens()]
        return growth.tree(rows, leaves)

    def note_runner_up(self, position: int, token: int, logits: np.ndarray, sampling: SamplingSettings | None) -> None:
        """Keep the draft's CORRECTION_RANKS most probable tokens other than
        ``token`` (what it drafted at ``position``): where the target rejects
        the draft there, its own token is often one of them (speculators.corrections)."""
        others = [other for other, _ in children_of(logits, position, sampling, top_k=CORRECTION_RANKS + 1)
                  if other != token]
        self.runners_up[position] = others[:CORRECTION_RANKS]

    def _context_logits(self, context: Sequence[int]) -> np.ndarray:
        """The draft's logits after ``context``: its cache rolled back to the
        common prefix, the rest decoded."""
        keep = self.roll_back(context)
        batch = self.engine.settings.n_batch
        logits = None
        for first in range(keep, len(context), batch):
            chunk = np.asarray(context[first : first + batch], dtype=np.int32)
            positions = np.arange(first, first + len(chunk), dtype=np.int32)
            logits = self.engine.decode(positions, tokens=chunk, sequence=self.sequence)[-1]
        self.cached = list(context)
        return logits

    def roll_back(self, context: Sequence[int]) -> int:
        """Drop the cached cells after the prefix ``context`` shares with them
        (always leaving its last token to decode), and every tree branch;
        the runners-up drafted after that prefix go too. Returns the cells kept."""
        keep = min(common_prefix_length(self.cached, context), len(context) - 1)
        self.engine.remove(keep, self.sequence)
        del self.cached[keep:]
        self.runners_up = {position: token for position, token in self.runners_up.items() if position <= keep}
        return keep
