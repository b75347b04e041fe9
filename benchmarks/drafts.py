"""A draft model of realistic agreement, made from the target where it is used.

No trained draft/target pair with SmolLM2's vocabulary is on PyPI, and a
model drafting for itself agrees on every token, which measures nothing.
So the bench and the tests make one: the target requantized by llama.cpp's
quantizer from its Q4_1 to ``DRAFT_TYPE`` (stages.requantize; SmolLM2's rows
of 576 are not whole K-quant blocks, so its K types fall back to these
legacy ones). Its argmax agrees with the target's on about two tokens in
three of open chat and nearly all of a rewrite (``agreement``; measured
figures in docs/measurements.md). It costs what the target costs a token:
under an emulated curve the draft's step is its real one on this CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stages.requantize import requantize
from stages.settings import StageSettings

DRAFT_TYPE = "Q4_0"
PREFIX = "requantized:"  # a scenario's draft = "requantized:Q4_0"


def realistic_draft(model: str, folder: Path, type_name: str = DRAFT_TYPE) -> str:
    """The target requantized to ``type_name`` in ``folder`` (made once, then reused)."""
    path = Path(folder) / f"{Path(model).stem}.requantized-{type_name}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        requantize(model, path, type_name)
    return str(path)


def agreement(draft: str, texts: list[tuple[list[int], list[int]]], n_ctx: int = 2048) -> float:
    """The share of ``texts``' generated tokens that the draft's argmax
    predicts from the true text before them: for (prompt, the target's greedy
    output) pairs, the chance that a greedy draft token is accepted once the
    drafts before it were (the planner's acceptance, draft i given 1..i-1)."""
    from stages.engine import StageEngine

    engine = StageEngine(draft, StageSettings(n_ctx=n_ctx))
    try:
        right = total = 0
        for prompt, output in texts:
            if not output:
                continue
            tokens = np.asarray(prompt + output, dtype=np.int32)
            engine.remove(0, 0)
            rows = np.arange(len(prompt) - 1, len(tokens) - 1, dtype=np.int32)
            logits = engine.decode(np.arange(len(tokens), dtype=np.int32), tokens=tokens, logit_rows=rows)
            right += int((logits.argmax(axis=1) == np.asarray(output)).sum())
            total += len(output)
        return right / total if total else 0.0
    finally:
        engine.close()
