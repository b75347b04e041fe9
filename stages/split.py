"""Cut a GGUF model into stage files, streaming tensor data.

Each stage file is a complete GGUF model llama.cpp can load: every metadata key
of the source (with per-layer values sliced, see layer_rules), the stage's blocks
renumbered from ``blk.0``, and every tensor outside the blocks (token embedding,
output norm, output head, RoPE factors...), because llama.cpp refuses a model
without them. Tensor bytes are copied verbatim in chunks, never re-quantized and
never held in memory whole. Each output is written to ``<name>.partial`` and
renamed only once complete, so an interrupted split leaves no file that looks done.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stages.gguf_file import ModelFile, ModelFileError, TensorLocation, read_model, stage_info
from stages.layer_rules import LayerRules, SplitRuleError, layer_rules
from stages.plan import balanced_starts, stage_ranges
from stages.stage_image import StageImage, stage_image, write_atomically

BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")

# Called with (bytes written so far, bytes to write in all).
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class SplitPlan:
    """Blocks [first, end) for each stage of a model."""

    model: ModelFile
    ranges: tuple[tuple[int, int], ...]

    @property
    def starts(self) -> list[int]:
        return [first for first, _ in self.ranges]


def _block_index(tensor: TensorLocation) -> int | None:
    match = BLOCK_TENSOR.match(tensor.name)
    return int(match.group(1)) if match else None


def block_costs(model: ModelFile) -> list[int]:
    """Bytes of each block."""
    costs = [0] * model.block_count
    for tensor in model.tensors:
        index = _block_index(tensor)
        if index is not None and index < model.block_count:
            costs[index] += tensor.n_bytes
    return costs


def plan_split(model: ModelFile, stage_count: int, boundaries: list[int] | None = None) -> SplitPlan:
    """Choose (or check) the stage boundaries of a model.

    boundaries: first blocks of stages 2..n; None balances bytes.
    Raises SplitRuleError when the boundaries cannot split exactly.
    """
    if stage_info(model) is not None:
        raise ModelFileError(f"{model.paths[0]}: is already a stage file; split the original model")
    rules: LayerRules = layer_rules(model.metadata)
    if stage_count < 1:
        raise SplitRuleError("give at least one output file")
    if stage_count > model.block_count:
        raise SplitRuleError(f"{stage_count} stages but the model has only {model.block_count} blocks")
    if boundaries is None:
        try:
            starts = balanced_starts(block_costs(model), stage_count, rules.allowed_boundaries())
        except ValueError as error:
            raise SplitRuleError(f"{model.architecture}: {error}") from None
    else:
        if len(boundaries) != stage_count - 1:
            raise SplitRuleError(
                f"{stage_count} output files need {stage_count - 1} boundaries, got {len(boundaries)}"
            )
        starts = [0] + list(boundaries)
    rules.check_boundaries(starts)
    return SplitPlan(model, tuple(stage_ranges(starts, model.block_count)))


def _stage_tensors(model: ModelFile, first: int, end: int) -> list[tuple[str, TensorLocation]]:
    """(name in the slice, source tensor) for one stage, in source order."""
    selected = []
    for tensor in model.tensors:
        index = _block_index(tensor)
        if index is None:
            selected.append((tensor.name, tensor))
        elif first <= index < end:
            suffix = BLOCK_TENSOR.match(tensor.name).group(2)  # type: ignore[union-attr]
            selected.append((f"blk.{index - first}.{suffix}", tensor))
    return selected


def stage_file_image(plan: SplitPlan, stage_index: int) -> StageImage:
    """The bytes of stage ``stage_index``'s file (stages.stage_image)."""
    tensors = _stage_tensors(plan.model, *plan.ranges[stage_index])
    return stage_image(plan.model, plan.ranges, stage_index, tensors)


def split_model(
    model_path: str | os.PathLike[str],
    outputs: list[str | os.PathLike[str]],
    boundaries: list[int] | None = None,
    progress: ProgressCallback | None = None,
    only: int | None = None,
) -> SplitPlan:
    """Write one stage file per output. Returns the plan used.

    only: write just stage ``only`` (the file ``outputs[only]``), cut at the
    boundaries the full split would use, so that each machine can cut its own
    slice from the whole model and the slices still form one set. Other
    stages' tensors are not read, and their outputs need not be writable here.

    Every check happens before the first byte is written; each output appears
    under its name only when complete.
    """
    output_paths = [Path(output) for output in outputs]
    if only is not None and not 0 <= only < len(output_paths):
        raise SplitRuleError(
            f"there is no stage {only}: {len(output_paths)} output files make stages 0..{len(output_paths) - 1}"
        )
    model = read_model(model_path)
    plan = plan_split(model, len(output_paths), boundaries)
    if len({output.resolve() for output in output_paths}) != len(output_paths):
        raise ModelFileError("the same output file is named twice")
    stages_to_write = range(len(output_paths)) if only is None else [only]
    resolved_inputs = {path.resolve() for path in model.paths}
    for stage_index in stages_to_write:
        output = output_paths[stage_index]
        if output.resolve() in resolved_inputs:
            raise ModelFileError(f"{output}: output would overwrite the input model")
        if not output.parent.exists():
            raise ModelFileError(f"{output}: folder {output.parent} does not exist")

    total = sum(
        tensor.n_bytes
        for stage_index in stages_to_write
        for _, tensor in _stage_tensors(model, *plan.ranges[stage_index])
    )
    written = 0

    def advance(count: int) -> None:
        nonlocal written
        written += count
        if progress is not None:
            progress(written, total)

    for stage_index in stages_to_write:
        write_atomically(stage_file_image(plan, stage_index), output_paths[stage_index], advance)
    return plan
