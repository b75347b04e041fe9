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

import numpy as np

from stages.gguf_file import (
    KEY_BLOCK_COUNT,
    KEY_FIRST_BLOCK,
    KEY_SOURCE_FINGERPRINT,
    KEY_SOURCE_NAME,
    KEY_STAGE_COUNT,
    KEY_STAGE_INDEX,
    KEY_TOTAL_BLOCKS,
    ModelFile,
    ModelFileError,
    TensorLocation,
    read_model,
    stage_info,
)
from stages.layer_rules import LayerRules, SplitRuleError, layer_rules, slice_metadata_overrides
from stages.plan import balanced_starts, stage_ranges

BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
COPY_CHUNK_BYTES = 16 * 1024 * 1024

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


def _write_stage(
    plan: SplitPlan, stage_index: int, output: Path, progress: Callable[[int], None], *, as_stage: bool = True
) -> None:
    """Write blocks plan.ranges[stage_index] as a stage file, or (as_stage False)
    as a whole model of its own (no specpipe.* keys: it runs blocks, norm and head)."""
    from gguf import GGUFValueType, GGUFWriter

    model = plan.model
    first, end = plan.ranges[stage_index]
    overrides = slice_metadata_overrides(model.metadata, first, end - first)
    writer = GGUFWriter(output, model.architecture)
    writer.data_alignment = model.alignment
    for key, field in model.fields.items():
        if key == "general.architecture":
            continue
        value = overrides.get(key, field.value)
        sub_type = GGUFValueType(field.sub_type) if field.sub_type is not None else None
        writer.add_key_value(key, value, GGUFValueType(field.value_type), sub_type)
    for key, value in overrides.items():
        if key not in model.fields:  # a sliding-window pattern the source left implicit
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.BOOL)
    if as_stage:
        writer.add_uint32(KEY_STAGE_INDEX, stage_index)
        writer.add_uint32(KEY_STAGE_COUNT, len(plan.ranges))
        writer.add_uint32(KEY_FIRST_BLOCK, first)
        writer.add_uint32(KEY_BLOCK_COUNT, end - first)
        writer.add_uint32(KEY_TOTAL_BLOCKS, model.block_count)
        writer.add_string(KEY_SOURCE_FINGERPRINT, model.fingerprint)
        writer.add_string(KEY_SOURCE_NAME, model.name)

    tensors = _stage_tensors(model, first, end)
    for name, tensor in tensors:
        # ggml order -> numpy order; the dtype argument only marks the shape as
        # element counts (raw_dtype says what the bytes are).
        writer.add_tensor_info(
            name, tuple(reversed(tensor.shape)), np.dtype(np.float32), tensor.n_bytes, raw_dtype=tensor.ggml_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    sources: dict[Path, object] = {}
    try:
        for _, tensor in tensors:
            source = sources.get(tensor.path)
            if source is None:
                source = sources[tensor.path] = open(tensor.path, "rb")
            writer.write_padding(out, out.tell())
            source.seek(tensor.offset)  # type: ignore[attr-defined]
            remaining = tensor.n_bytes
            while remaining:
                chunk = source.read(min(COPY_CHUNK_BYTES, remaining))  # type: ignore[attr-defined]
                if not chunk:
                    raise ModelFileError(f"{tensor.path}: ended early while copying {tensor.name}")
                out.write(chunk)
                remaining -= len(chunk)
                progress(len(chunk))
            writer.write_padding(out, tensor.n_bytes)
    finally:
        for source in sources.values():
            source.close()  # type: ignore[attr-defined]
        writer.close()


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
        output = output_paths[stage_index]
        partial = output.with_name(output.name + ".partial")
        try:
            _write_stage(plan, stage_index, partial, advance)
            os.replace(partial, output)
        except OSError as error:
            partial.unlink(missing_ok=True)
            raise ModelFileError(f"{output}: {error.strerror or error}") from None
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    return plan


def write_first_blocks(model_path: str | os.PathLike[str], output: str | os.PathLike[str], block_count: int) -> None:
    """A whole model made of the first block_count blocks of another (with its
    embedding, norm and head): a cheap, poor draft model of the same vocabulary."""
    model = read_model(model_path)
    plan = plan_split(model, 2, [block_count])
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    try:
        _write_stage(plan, 0, partial, lambda count: None, as_stage=False)
        os.replace(partial, output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
