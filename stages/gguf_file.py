"""Reading GGUF models and stage files: metadata, tensor locations, identity, validation.

Nothing here loads weights: the gguf package maps the file and only the header
is parsed. Every failure is a ``ModelFileError`` whose message is one line that
names the file.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Keys of this project's own namespace, written into every stage file.
KEY_STAGE_INDEX = "specpipe.stage.index"
KEY_STAGE_COUNT = "specpipe.stage.count"
KEY_FIRST_BLOCK = "specpipe.block.first"
KEY_BLOCK_COUNT = "specpipe.block.count"
KEY_TOTAL_BLOCKS = "specpipe.block.total"
KEY_SOURCE_FINGERPRINT = "specpipe.source.fingerprint"
KEY_SOURCE_NAME = "specpipe.source.name"

SHARD_PATTERN = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# Keys the gguf reader invents, and keys of llama.cpp's multi-file format.
SYNTHETIC_KEY_PREFIXES = ("GGUF.", "split.")


class ModelFileError(ValueError):
    """A model or stage file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TensorLocation:
    """One tensor's bytes inside a (possibly multi-file) model.

    shape: element counts in ggml order (ne[0] first).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    n_bytes: int
    path: Path
    offset: int


@dataclass(frozen=True)
class FieldValue:
    """A metadata value with its GGUF type (``sub_type`` for arrays)."""

    value: object
    value_type: int
    sub_type: int | None


@dataclass(frozen=True)
class ModelFile:
    """The parsed header of a model: one file or all shards of a multi-file model."""

    paths: tuple[Path, ...]
    fields: dict[str, FieldValue]
    tensors: tuple[TensorLocation, ...]
    alignment: int
    fingerprint: str

    @property
    def name(self) -> str:
        return self.paths[0].name

    @property
    def metadata(self) -> dict[str, object]:
        return {key: field.value for key, field in self.fields.items()}

    @property
    def architecture(self) -> str:
        return str(self.fields["general.architecture"].value)

    @property
    def block_count(self) -> int:
        return int(self.fields[f"{self.architecture}.block_count"].value)  # type: ignore[arg-type]

    @property
    def total_bytes(self) -> int:
        return sum(tensor.n_bytes for tensor in self.tensors)


@dataclass(frozen=True)
class StageFileInfo:
    """A stage file's place in the whole model (read from its specpipe.* metadata).

    Blocks [first_block, first_block + block_count) of total_blocks.
    """

    path: Path
    stage_index: int
    stage_count: int
    first_block: int
    block_count: int
    total_blocks: int
    source_fingerprint: str
    source_name: str

    @property
    def end_block(self) -> int:
        return self.first_block + self.block_count


def shard_paths(path: Path) -> tuple[Path, ...]:
    """All files of a model given its only file or its first shard."""
    match = SHARD_PATTERN.search(path.name)
    if not match:
        return (path,)
    number, count = int(match.group(1)), int(match.group(2))
    if number != 1:
        raise ModelFileError(f"{path}: give the first shard (-00001-of-{count:05d}.gguf), not shard {number}")
    stem = path.name[: match.start()]
    paths = tuple(path.with_name(f"{stem}-{index:05d}-of-{count:05d}.gguf") for index in range(1, count + 1))
    missing = [str(shard) for shard in paths if not shard.exists()]
    if missing:
        raise ModelFileError(f"{path}: missing shard(s) {', '.join(missing)}")
    return paths


def _read_one(path: Path):
    """Parse one GGUF file's header; raise ModelFileError for anything unreadable."""
    from gguf import GGUFReader  # imported here: the pure modules stay free of it

    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the gguf reader raises many types for a damaged file
        raise ModelFileError(f"{path}: truncated or corrupt GGUF file ({error})") from None
    size = path.stat().st_size
    end = max((tensor.data_offset + tensor.n_bytes for tensor in reader.tensors), default=0)
    if end > size:
        raise ModelFileError(f"{path}: truncated GGUF file ({size} bytes, tensor data needs {end})")
    return reader


def _header_digest(path: Path, data_offset: int) -> bytes:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read(data_offset)).digest()


def read_model(path: str | os.PathLike[str]) -> ModelFile:
    """Parse a model's header (all shards); tensor data is not read."""
    from gguf import GGUFValueType

    paths = shard_paths(Path(path))
    fields: dict[str, FieldValue] = {}
    tensors: list[TensorLocation] = []
    fingerprint = hashlib.sha256()
    alignment = 32
    for index, shard in enumerate(paths):
        reader = _read_one(shard)
        if index == 0:
            alignment = reader.alignment
            for key, field in reader.fields.items():
                if key.startswith(SYNTHETIC_KEY_PREFIXES):
                    continue
                value_type = field.types[0]
                sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
                try:
                    value = field.contents()
                except UnicodeDecodeError:
                    raise ModelFileError(f"{shard}: metadata key {key} is not valid UTF-8") from None
                fields[key] = FieldValue(value, int(value_type), int(sub_type) if sub_type is not None else None)
        for tensor in reader.tensors:
            tensors.append(
                TensorLocation(
                    name=tensor.name,
                    shape=tuple(int(dim) for dim in tensor.shape),
                    ggml_type=int(tensor.tensor_type),
                    n_bytes=int(tensor.n_bytes),
                    path=shard,
                    offset=int(tensor.data_offset),
                )
            )
        fingerprint.update(_header_digest(shard, reader.data_offset))
        del reader
    if "general.architecture" not in fields:
        raise ModelFileError(f"{paths[0]}: GGUF file has no general.architecture")
    model = ModelFile(paths, fields, tuple(tensors), alignment, fingerprint.hexdigest())
    if f"{model.architecture}.block_count" not in fields:
        raise ModelFileError(f"{paths[0]}: GGUF file has no {model.architecture}.block_count")
    return model


def stage_info(model: ModelFile) -> StageFileInfo | None:
    """The stage metadata of a file, or None for a whole (unsplit) model."""
    if KEY_STAGE_INDEX not in model.fields:
        return None
    value = model.metadata
    try:
        return StageFileInfo(
            path=model.paths[0],
            stage_index=int(value[KEY_STAGE_INDEX]),  # type: ignore[arg-type]
            stage_count=int(value[KEY_STAGE_COUNT]),  # type: ignore[arg-type]
            first_block=int(value[KEY_FIRST_BLOCK]),  # type: ignore[arg-type]
            block_count=int(value[KEY_BLOCK_COUNT]),  # type: ignore[arg-type]
            total_blocks=int(value[KEY_TOTAL_BLOCKS]),  # type: ignore[arg-type]
            source_fingerprint=str(value[KEY_SOURCE_FINGERPRINT]),
            source_name=str(value[KEY_SOURCE_NAME]),
        )
    except KeyError as missing:
        raise ModelFileError(f"{model.paths[0]}: incomplete specpipe stage metadata (no {missing.args[0]})") from None


def validate_stage_set(infos: list[StageFileInfo | None], paths: list[Path]) -> None:
    """Check that files form one complete model, in order. Raise ModelFileError otherwise.

    ``infos[i]`` is None for a file without stage metadata, which is only valid
    as the single file of a one-stage (whole model) run.
    """
    if not paths:
        raise ModelFileError("no model files given")
    if len(paths) == 1 and infos[0] is None:
        return
    for info, path in zip(infos, paths):
        if info is None:
            raise ModelFileError(
                f"{path}: not a specpipe stage file (no specpipe.* metadata); "
                "cut it with `orchestrate split`, or give it alone to run the whole model"
            )
    stages = [info for info in infos if info is not None]
    first = stages[0]
    for info in stages[1:]:
        if info.source_fingerprint != first.source_fingerprint:
            raise ModelFileError(
                f"{info.path} and {first.path} were cut from different models "
                f"({info.source_name} and {first.source_name})"
            )
    seen: dict[int, Path] = {}
    for info in stages:
        if info.stage_index in seen:
            raise ModelFileError(f"{info.path} and {seen[info.stage_index]} are both stage {info.stage_index + 1}")
        seen[info.stage_index] = info.path
    count = first.stage_count
    missing = [index + 1 for index in range(count) if index not in seen]
    if missing:
        names = ", ".join(str(path) for path in paths)
        raise ModelFileError(
            f"stage {', '.join(map(str, missing))} of {count} missing: have only {names}"
        )
    for position, info in enumerate(stages):
        if info.stage_index != position:
            raise ModelFileError(
                f"stage files out of order: {info.path} is stage {info.stage_index + 1} of {count} "
                f"but was given in position {position + 1}"
            )
    expected_first = 0
    for info in stages:
        if info.first_block != expected_first:
            raise ModelFileError(
                f"{info.path}: starts at block {info.first_block}, expected {expected_first} (not contiguous)"
            )
        expected_first = info.end_block
    if expected_first != first.total_blocks:
        raise ModelFileError(f"stages cover blocks 0-{expected_first} of {first.total_blocks}: incomplete")
