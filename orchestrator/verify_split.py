"""Prove a split exact: the same probe through the whole model and through its stages.

Runs in one process, without Ray: the question is whether the stage files
compute what the model computes, not how they are deployed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.config import VERIFY_SPLIT_STEPS
from stages.engine import StageEngine
from stages.gguf_file import ModelFileError
from stages.settings import StageSettings
from stages.stage_files import check_stage_files
from stages.tokenizer import Tokenizer

PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, astronauts first walked on the Moon, "
    "and the number 42 is said to answer everything."
)


@dataclass(frozen=True)
class SplitComparison:
    prompt_tokens: int
    greedy_tokens: int
    max_difference: float
    tokens_identical: bool

    @property
    def identical(self) -> bool:
        return self.max_difference == 0.0 and self.tokens_identical


def _through(engines: list[StageEngine], positions: np.ndarray, tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    hidden = None
    for engine in engines:
        if engine.is_first:
            hidden = engine.decode(positions, tokens=tokens, logit_rows=rows)
        else:
            hidden = engine.decode(positions, hidden=hidden, logit_rows=rows)
    return hidden  # type: ignore[return-value]


def compare_split(model_path: str, stage_paths: list[str], *, threads: int = 1) -> SplitComparison:
    """Logits of every probe position, then VERIFY_SPLIT_STEPS greedy tokens, both ways."""
    check_stage_files(stage_paths)
    infos = check_stage_files([model_path])
    if infos[0] is not None:
        raise ModelFileError(f"{model_path}: is a stage file; give the original model first")
    settings = StageSettings(n_ctx=512, threads=threads)
    probe = np.asarray(Tokenizer(model_path).tokenize(PROBE_TEXT), dtype=np.int32)
    whole = [StageEngine(model_path, settings)]
    stages = [StageEngine(path, settings) for path in stage_paths]
    try:
        positions = np.arange(len(probe), dtype=np.int32)
        rows = np.arange(len(probe), dtype=np.int32)
        expected = _through(whole, positions, probe, rows)
        actual = _through(stages, positions, probe, rows)
        difference = float(np.max(np.abs(expected - actual)))
        whole_tokens, stage_tokens = [], []
        for engines, produced, logits in ((whole, whole_tokens, expected), (stages, stage_tokens, actual)):
            position = len(probe)
            token = int(np.argmax(logits[-1]))
            for _ in range(VERIFY_SPLIT_STEPS):
                produced.append(token)
                step = _through(engines, np.array([position], np.int32), np.array([token], np.int32), np.array([0], np.int32))
                token = int(np.argmax(step[-1]))
                position += 1
        return SplitComparison(len(probe), VERIFY_SPLIT_STEPS, difference, whole_tokens == stage_tokens)
    finally:
        for engine in whole + stages:
            engine.close()
