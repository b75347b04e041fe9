"""Which block boundaries split a model exactly, and what metadata a slice needs.

A slice file renumbers its blocks from ``blk.0``. llama.cpp derives some
per-layer behaviour from the block *index* (Gemma 3 makes every 6th layer
global attention, SmolLM3 skips RoPE on every 4th, Llama 4 interleaves MoE
layers). Renumbering silently changes such behaviour unless the slice says
explicitly what each of its layers is, or the boundary falls on a multiple of
the period. The rules below were read from llama.cpp's model loaders
(``src/models/*.cpp`` of the version pinned in pyproject.toml):

* sliding-window patterns set by ``load_swa_pattern(ml, n, dense_first)`` can be
  written as an explicit per-layer array (``<arch>.attention.sliding_window_pattern``),
  which llama.cpp reads in preference to the period, so any boundary is exact;
* per-layer metadata arrays (one entry per block) are sliced;
* ``<arch>.leading_dense_block_count`` is rewritten relative to the slice;
* periods llama.cpp hard-codes or reads as a step cannot be expressed, so the
  boundary must be a multiple of them;
* a few layouts cannot be cut at all (multi-token-prediction blocks at the end,
  layers that share another layer's KV cache) and are refused.

Pure: metadata in (a plain ``dict`` of key to Python value), decisions out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stages.errors import SpecpipeError

# arch -> (period, dense_first): arguments of llama.cpp's load_swa_pattern().
SLIDING_WINDOW_PERIODS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma-embedding": (6, False),
    "cohere2": (4, False),
    "cohere2moe": (4, True),
    "exaone4": (4, False),
    "exaone-moe": (4, False),
    "olmo2": (4, False),
    "plamo3": (8, False),
    "llama4": (4, False),
    "gpt-oss": (2, False),
    "afmoe": (4, False),
    "mellum": (4, False),
    "muse-glimmer": (4, False),
    "smallthinker": (4, True),
    "laguna": (4, True),
    "modern-bert": (3, True),
}

# arch -> period hard-coded in llama.cpp (RoPE skipped on every n-th layer).
FIXED_BOUNDARY_PERIODS: dict[str, int] = {
    "smollm3": 4,
    "llama4": 4,
    "afmoe": 4,
}

# Metadata keys (under "<arch>.") holding a layer step that must divide a boundary.
PERIOD_KEYS = ("interleave_moe_layer_step", "full_attention_interval")

# arch -> why it cannot be split at all.
UNSPLITTABLE: dict[str, str] = {
    "gemma3n": "its later layers reuse the KV cache of earlier layers",
}


class SplitRuleError(SpecpipeError):
    """A model or boundary that cannot be split exactly."""


@dataclass(frozen=True)
class LayerRules:
    """What splitting this model requires.

    boundary_period: every stage boundary must be a multiple of it (1: any).
    period_reason: why, for error messages ("" when boundary_period is 1).
    """

    architecture: str
    block_count: int
    boundary_period: int
    period_reason: str

    def check_boundaries(self, starts: list[int]) -> None:
        """Raise SplitRuleError unless ``starts`` (first block of each stage) is exact."""
        if not starts or starts[0] != 0:
            raise SplitRuleError("the first stage must start at block 0")
        for previous, current in zip(starts, starts[1:]):
            if current <= previous:
                raise SplitRuleError(f"boundaries must increase: {starts[1:]}")
        if starts[-1] >= self.block_count:
            raise SplitRuleError(
                f"boundary {starts[-1]} leaves the last stage empty "
                f"(the model has {self.block_count} blocks, 0..{self.block_count - 1})"
            )
        for boundary in starts[1:]:
            if boundary % self.boundary_period:
                valid = list(range(self.boundary_period, self.block_count, self.boundary_period))
                raise SplitRuleError(
                    f"boundary {boundary} cannot be exact for {self.architecture}: "
                    f"{self.period_reason}; valid boundaries are multiples of "
                    f"{self.boundary_period}: {valid}"
                )

    def allowed_boundaries(self) -> list[int]:
        return list(range(self.boundary_period, self.block_count, self.boundary_period))


def layer_rules(metadata: dict[str, object]) -> LayerRules:
    """Decide the boundary constraints of a model from its GGUF metadata."""
    architecture = str(metadata["general.architecture"])
    block_count = int(metadata[f"{architecture}.block_count"])  # type: ignore[arg-type]
    if architecture in UNSPLITTABLE:
        raise SplitRuleError(f"{architecture} cannot be split: {UNSPLITTABLE[architecture]}")
    next_token_layers = int(metadata.get(f"{architecture}.nextn_predict_layers", 0) or 0)  # type: ignore[arg-type]
    if next_token_layers:
        raise SplitRuleError(
            f"{architecture} with {next_token_layers} multi-token-prediction blocks "
            "at the end cannot be split (llama.cpp counts them by position)"
        )
    if architecture == "llama4" and metadata.get("llama4.attention.sliding_window") == 0:
        raise SplitRuleError(
            "llama4 without chunked attention skips RoPE on the model's last layer only, "
            "which a slice cannot express"
        )

    periods: list[tuple[int, str]] = []
    if architecture in FIXED_BOUNDARY_PERIODS:
        step = FIXED_BOUNDARY_PERIODS[architecture]
        periods.append((step, f"llama.cpp skips RoPE on every {step}th layer"))
    for key in PERIOD_KEYS:
        value = metadata.get(f"{architecture}.{key}")
        if isinstance(value, int) and value > 1:
            periods.append((value, f"{architecture}.{key} is {value}"))
    period = 1
    for step, _ in periods:
        period = period * step // math.gcd(period, step)
    reason = "; ".join(text for _, text in periods)
    return LayerRules(architecture, block_count, period, reason)


def sliding_window_pattern(metadata: dict[str, object]) -> list[bool] | None:
    """The whole model's per-layer sliding-window flags, as llama.cpp derives them.

    None when the architecture has no index-dependent sliding window.
    """
    architecture = str(metadata["general.architecture"])
    if architecture not in SLIDING_WINDOW_PERIODS:
        return None
    block_count = int(metadata[f"{architecture}.block_count"])  # type: ignore[arg-type]
    key = f"{architecture}.attention.sliding_window_pattern"
    stored = metadata.get(key)
    if isinstance(stored, list):
        return [bool(flag) for flag in stored]
    period, dense_first = SLIDING_WINDOW_PERIODS[architecture]
    if isinstance(stored, int):
        period = stored
    if dense_first:
        return [period == 0 or layer % period != 0 for layer in range(block_count)]
    return [period == 0 or layer % period < period - 1 for layer in range(block_count)]


def slice_metadata_overrides(
    metadata: dict[str, object], first_block: int, block_count: int
) -> dict[str, object]:
    """Metadata values a slice of blocks [first_block, first_block + block_count) must carry.

    Returns key -> new value; lists become GGUF arrays of the source's element type,
    except the sliding-window pattern, which is written as a bool array.
    """
    architecture = str(metadata["general.architecture"])
    total_blocks = int(metadata[f"{architecture}.block_count"])  # type: ignore[arg-type]
    end_block = first_block + block_count
    overrides: dict[str, object] = {f"{architecture}.block_count": block_count}
    for key, value in metadata.items():
        if key.startswith(f"{architecture}.") and isinstance(value, list) and len(value) == total_blocks:
            overrides[key] = value[first_block:end_block]
    pattern = sliding_window_pattern(metadata)
    if pattern is not None:
        overrides[f"{architecture}.attention.sliding_window_pattern"] = pattern[first_block:end_block]
    dense_key = f"{architecture}.leading_dense_block_count"
    if dense_key in metadata:
        overrides[dense_key] = max(0, int(metadata[dense_key]) - first_block)  # type: ignore[arg-type]
    return overrides
