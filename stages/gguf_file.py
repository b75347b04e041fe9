"""Reading GGUF models and stage files: metadata, tensor locations, identity, validation.

Nothing here loads weights: the gguf package maps the file and only the header
is parsed. Every failure is a ``ModelFileError`` whose message is one line that
names the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from stages.errors import SpecpipeError

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


class ModelFileError(SpecpipeError):
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


# GGUF value types: struct format of fixed-size scalars; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _HeaderScanner:
    """Reads a GGUF header sequentially; arrays are skipped, not decoded."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "rb")

    def read(self, count: int) -> bytes:
        data = self.handle.read(count)
        if len(data) != count:
            raise ModelFileError(f"{self.path}: truncated GGUF file (header ends early)")
        return data

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.read(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("Q")).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> object:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALAR_FORMATS:
                self.handle.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    self.value(item_type)
            return None
        raise ModelFileError(f"{self.path}: corrupt GGUF file (unknown value type {value_type})")


def read_scalars(path: str | os.PathLike[str]) -> dict[str, object]:
    """Scalar and string metadata of one GGUF file, fast (arrays are skipped).

    Also checks the file holds all its tensor data: raises ModelFileError for a
    file that is missing, not GGUF, or truncated.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    scanner = _HeaderScanner(path)
    try:
        if scanner.read(4) != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
        scanner.unpack("I")  # version
        tensor_count, key_count = scanner.unpack("Q"), scanner.unpack("Q")
        scalars: dict[str, object] = {}
        for _ in range(key_count):
            key = scanner.string()
            value = scanner.value(scanner.unpack("I"))
            if value is not None:
                scalars[key] = value
        end = 0
        for _ in range(tensor_count):
            scanner.string()
            dims = [scanner.unpack("Q") for _ in range(scanner.unpack("I"))]
            ggml_type, offset = scanner.unpack("I"), scanner.unpack("Q")
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except ValueError:
                raise ModelFileError(f"{path}: corrupt GGUF file (unknown tensor type {ggml_type})") from None
            elements = 1
            for dim in dims:
                elements *= dim
            end = max(end, offset + elements * type_size // block_size)
        alignment = int(scalars.get("general.alignment", 32))  # type: ignore[arg-type]
        data_start = -(-scanner.handle.tell() // alignment) * alignment
    finally:
        scanner.handle.close()
    size = path.stat().st_size
    if data_start + end > size:
        raise ModelFileError(f"{path}: truncated GGUF file ({size} bytes, tensor data needs {data_start + end})")
    return scalars


def stage_info_of(path: str | os.PathLike[str]) -> StageFileInfo | None:
    """The stage metadata of a file (checked readable and complete), or None for a whole model."""
    scalars = read_scalars(path)
    return _stage_info(Path(path), scalars)


def stage_info(model: ModelFile) -> StageFileInfo | None:
    """The stage metadata of a parsed model, or None for a whole (unsplit) model."""
    return _stage_info(model.paths[0], model.metadata)


def _stage_info(path: Path, value: dict[str, object]) -> StageFileInfo | None:
    if KEY_STAGE_INDEX not in value:
        return None
    try:
        return StageFileInfo(
            path=path,
            stage_index=int(value[KEY_STAGE_INDEX]),  # type: ignore[arg-type]
            stage_count=int(value[KEY_STAGE_COUNT]),  # type: ignore[arg-type]
            first_block=int(value[KEY_FIRST_BLOCK]),  # type: ignore[arg-type]
            block_count=int(value[KEY_BLOCK_COUNT]),  # type: ignore[arg-type]
            total_blocks=int(value[KEY_TOTAL_BLOCKS]),  # type: ignore[arg-type]
            source_fingerprint=str(value[KEY_SOURCE_FINGERPRINT]),
            source_name=str(value[KEY_SOURCE_NAME]),
        )
    except KeyError as missing:
        raise ModelFileError(f"{path}: incomplete specpipe stage metadata (no {missing.args[0]})") from None


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
    for info in stages[1:]:
        if info.stage_count != first.stage_count:
            raise ModelFileError(
                f"{first.path} is from a {first.stage_count}-stage split but {info.path} "
                f"from a {info.stage_count}-stage split"
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
