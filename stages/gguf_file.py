"""Reading GGUF models and stage files: metadata, tensor locations, identity, validation.

Nothing here loads weights: only the header is read, by a scanner that checks
every length and count before it reads (the gguf package's reader took 2.5 s
over SmolLM2's 49,152-token vocabulary, the scanner 0.1 s). Every failure is a ``ModelFileError`` whose message is one line that
names the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
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

MAX_TENSORLESS_BLOCKS = 4096  # the largest models have a few hundred
SHARD_PATTERN = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# Keys a model does not carry into its stages: the gguf package's reader's own, and llama.cpp's
# multi-file format's.
SYNTHETIC_KEY_PREFIXES = ("GGUF.", "split.")


class ModelFileError(SpecpipeError):
    """A model or stage file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TensorLocation:
    """One tensor's bytes inside a (possibly multi-file) model.

    shape: element counts in ggml order (ne[0] first). path: the file on this
    machine, or one elsewhere (read_model_files).
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


def same_slice(ran: StageFileInfo | None, found: StageFileInfo | None) -> bool:
    """Whether ``found`` is the slice of the model that ``ran`` is, wherever its file lies (a stage
    shipped again to another node's cache has another path). None: a whole model's file (no slice)."""
    if ran is None or found is None:
        return ran is found
    return dataclasses.replace(found, path=ran.path) == ran


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


def read_model(path: str | os.PathLike[str]) -> ModelFile:
    """Parse a model's header (all shards); tensor data is not read."""
    return read_model_files(shard_paths(Path(path)))


def read_model_files(locations: tuple) -> ModelFile:
    """Parse the header of a model held in ``locations`` (its shards in order):
    local Paths, or files elsewhere that open as a file would (an object with
    ``size`` and ``open("rb")``, as orchestrator.sources.remote_file.RemoteFile).
    Only the header of each is read; its digest makes the fingerprint, so a
    model has one fingerprint wherever it is read from."""
    fields: dict[str, FieldValue] = {}
    tensors: list[TensorLocation] = []
    fingerprint = hashlib.sha256()
    alignment = DEFAULT_ALIGNMENT
    for index, shard in enumerate(locations):
        header, digest = _scan_header(shard, decode_all=True, digest=True)
        if index == 0:
            fields, alignment = header.fields, header.alignment
        tensors += header.tensors
        fingerprint.update(digest)
    _check_model_keys(locations[0], fields, len(tensors))
    return ModelFile(tuple(locations), fields, tuple(tensors), alignment, fingerprint.hexdigest())


def _check_model_keys(path: Path, fields: dict[str, FieldValue], tensor_count: int) -> None:
    """The keys every model needs (ModelFile.architecture and block_count): present and of their types."""
    architecture = fields.get("general.architecture")
    if architecture is None:
        raise ModelFileError(f"{path}: GGUF file has no general.architecture")
    if architecture.value_type != _STRING:
        raise ModelFileError(f"{path}: general.architecture is a {_TYPE_NAMES[architecture.value_type]}, not a string")
    key = f"{architecture.value}.block_count"
    block_count = fields.get(key)
    if block_count is None:
        raise ModelFileError(f"{path}: GGUF file has no {_shown(key)}")
    if block_count.value_type not in _INTEGER_TYPES:
        raise ModelFileError(f"{path}: {_shown(key)} is a {_TYPE_NAMES[block_count.value_type]}, not an integer")
    # A block has tensors; a file of metadata only (a vocabulary file) is held to a bound instead.
    most = tensor_count if tensor_count else MAX_TENSORLESS_BLOCKS
    if not 0 <= block_count.value <= most:  # type: ignore[operator]
        raise ModelFileError(
            f"{path}: {_shown(key)} is {block_count.value}, not a block count (the file has {tensor_count} tensors)"
        )


# GGUF value types: struct format of fixed-size scalars; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_LAYOUTS = {fmt: struct.Struct("<" + fmt) for fmt in _SCALAR_FORMATS.values()}  # little-endian, as GGUF
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# The versions the gguf package and llama.cpp read (version 1 had 32-bit lengths).
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
_INT64_MAX = 2**63 - 1  # ggml counts elements in int64
# Fewest bytes a metadata entry (key length, type, a 1-byte value) and a tensor
# description (name length, dimension count, type, offset) can take.
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


def _shown(text: str) -> str:
    """Text from a file as it may appear in a one-line message: quoted if it is not plain."""
    return text if text and text.isprintable() else repr(text)


@dataclass(frozen=True)
class _Header:
    """What scanning a GGUF header found.

    fields: every metadata value with its types, or (a quick scan) the scalars
    and strings only, arrays skipped. tensors: empty in a quick scan.
    data_start: where tensor data begins; data_end: where the last tensor's
    data ends (both from the start of the file)."""

    fields: dict[str, FieldValue]
    tensors: tuple[TensorLocation, ...]
    alignment: int
    data_start: int
    data_end: int

    @property
    def scalars(self) -> dict[str, object]:
        return {key: field.value for key, field in self.fields.items()}


class _HeaderScanner:
    """Reads a GGUF header sequentially and checks it as llama.cpp does.

    Every length and count is checked against the bytes left in the file before
    anything is read or skipped, so a crafted one ends in ModelFileError at once,
    never in a huge allocation or a loop over 2**64 items.

    decode_all: arrays are decoded (else skipped), texts must be UTF-8 (else
    bad bytes are replaced) and the tensors are listed: what read_model needs.
    Without it the scan is what read_scalars needs, and about twice as fast."""

    def __init__(self, path, handle, decode_all: bool, size: int):
        self.path = path
        self.handle = handle
        self.decode_all = decode_all
        self.size = size
        self.position = 0  # kept here: the handle's tell() is slow over 100 000 tokens

    def corrupt(self, problem: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: corrupt GGUF file ({problem})")

    def left(self) -> int:
        return self.size - self.position

    def ensure(self, count: int) -> None:
        """Raise ModelFileError unless ``count`` more bytes are left."""
        if count > self.left():
            raise ModelFileError(
                f"{self.path}: truncated GGUF file (the header needs {count} bytes at byte {self.position}, "
                f"the file has {self.size})"
            )

    def read(self, count: int) -> bytes:
        self.ensure(count)
        data = self.handle.read(count)
        if len(data) != count:  # the file shrank while being read
            raise ModelFileError(f"{self.path}: truncated GGUF file (header ends early)")
        self.position += count
        return data

    def skip(self, count: int) -> None:
        self.ensure(count)
        self.handle.seek(count, os.SEEK_CUR)
        self.position += count

    def unpack(self, fmt: str):
        layout = _LAYOUTS[fmt]
        return layout.unpack(self.read(layout.size))[0]

    def count(self, item_bytes: int, what: str) -> int:
        """A uint64 count of items of at least ``item_bytes`` bytes each, checked to fit in the rest of the file."""
        position = self.position
        count = self.unpack("Q")
        if count * item_bytes > self.left():
            raise ModelFileError(
                f"{self.path}: truncated GGUF file ({what} at byte {position} is {count}, "
                f"more than the {self.left()} bytes left can hold)"
            )
        return count

    def text(self, key: str) -> str:
        """A string value of ``key``: UTF-8 in a full read (as the gguf package reads it)."""
        data = self.read(self.count(1, f"{_shown(key)} string length"))
        if not self.decode_all:
            return data.decode("utf-8", errors="replace")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: metadata key {_shown(key)} is not valid UTF-8") from None

    def name(self, what: str) -> str:
        """A key or tensor name: UTF-8, as the gguf reader requires."""
        position = self.position
        try:
            return self.read(self.count(1, f"{what} length")).decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"the {what} at byte {position} is not UTF-8") from None

    def value(self, key: str, value_type: int) -> FieldValue | None:
        """The value of ``key``, or None for an array in a quick scan (skipped)."""
        if value_type in _SCALAR_FORMATS:
            return FieldValue(self.unpack(_SCALAR_FORMATS[value_type]), value_type, None)
        if value_type == _STRING:
            return FieldValue(self.text(key), value_type, None)
        if value_type == _ARRAY:
            item_type = self.unpack("I")
            items = self.array(key, item_type)
            return None if items is None else FieldValue(items, value_type, item_type)
        raise self.corrupt(f"key {_shown(key)} has unknown value type {value_type}")

    def array(self, key: str, item_type: int) -> list | None:
        if item_type == _ARRAY:
            raise self.corrupt(f"key {_shown(key)} is an array of arrays, which GGUF readers do not support")
        if item_type == _STRING:
            length = self.count(8, f"{_shown(key)} array length")
            if self.decode_all:
                return [self.text(key) for _ in range(length)]
            for _ in range(length):
                self.skip(self.count(1, f"{_shown(key)} string length"))
            return None
        if item_type not in _SCALAR_FORMATS:
            raise self.corrupt(f"key {_shown(key)} is an array of unknown value type {item_type}")
        fmt = _SCALAR_FORMATS[item_type]
        item_bytes = _LAYOUTS[fmt].size
        length = self.count(item_bytes, f"{_shown(key)} array length")
        if not self.decode_all:
            self.skip(length * item_bytes)
            return None
        return list(struct.unpack(f"<{length}{fmt}", self.read(length * item_bytes)))

    def alignment(self, fields: dict[str, FieldValue]) -> int:
        """general.alignment (a uint32, a power of two), else GGUF's default."""
        if "general.alignment" not in fields:
            return DEFAULT_ALIGNMENT
        field = fields["general.alignment"]
        if field.value_type != _UINT32:
            raise self.corrupt(f"general.alignment is a {_TYPE_NAMES[field.value_type]}, not a uint32")
        alignment = field.value
        if alignment == 0 or alignment & (alignment - 1):  # type: ignore[operator]
            raise self.corrupt(f"general.alignment {alignment} is not a power of two")
        return alignment  # type: ignore[return-value]

    def tensor(self, names: set[str], alignment: int) -> TensorLocation:
        """Read one tensor's description; its offset is from the start of the data, for now."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self.name("tensor name")
        if name in names:
            raise self.corrupt(f"two tensors are named {_shown(name)}")
        names.add(name)
        dim_count = self.unpack("I")
        if dim_count > MAX_DIMS:
            raise self.corrupt(f"tensor {_shown(name)} has {dim_count} dimensions, more than {MAX_DIMS}")
        dims = tuple(self.unpack("Q") for _ in range(dim_count))
        ggml_type, offset = self.unpack("I"), self.unpack("Q")
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise self.corrupt(f"tensor {_shown(name)} has unknown tensor type {ggml_type}") from None
        elements = 1
        for dim in dims:
            elements *= dim
        if max(dims, default=0) > _INT64_MAX or elements > _INT64_MAX:
            raise self.corrupt(f"tensor {_shown(name)} has dimensions {list(dims)}: more elements than ggml can count")
        row = dims[0] if dims else 1
        if row % block_size:
            raise self.corrupt(f"tensor {_shown(name)}: rows of {row} values are not whole blocks of {block_size} "
                               f"({GGMLQuantizationType(ggml_type).name})")
        if offset % alignment:
            raise self.corrupt(f"tensor {_shown(name)} at offset {offset} is not aligned to {alignment} bytes")
        return TensorLocation(name, dims, ggml_type, elements // block_size * type_size, self.path, offset)

    def header(self) -> _Header:
        if self.size < 4 or self.read(4) != b"GGUF":
            raise ModelFileError(f"{self.path}: not a GGUF file (it does not start with the GGUF magic)")
        version = self.unpack("I")
        if version not in GGUF_VERSIONS:
            hint = " (a big-endian file?)" if version and not version & 0xFFFF else ""
            raise ModelFileError(f"{self.path}: unsupported GGUF version {version}{hint}; "
                                 f"versions {' and '.join(map(str, GGUF_VERSIONS))} can be read")
        tensor_count = self.count(_MIN_TENSOR_BYTES, "tensor count")
        key_count = self.count(_MIN_KEY_BYTES, "metadata key count")
        fields: dict[str, FieldValue] = {}
        keys: set[str] = set()
        for _ in range(key_count):
            key = self.name("key")
            if key in keys:
                raise self.corrupt(f"key {_shown(key)} appears twice")
            keys.add(key)
            value = self.value(key, self.unpack("I"))
            if value is not None:
                fields[key] = value
        alignment = self.alignment(fields)
        names: set[str] = set()
        tensors = [self.tensor(names, alignment) for _ in range(tensor_count)]
        data_start = -(-self.position // alignment) * alignment
        # no tensors (a vocabulary file): nothing follows the header, not even its padding
        data_end = data_start + max(tensor.offset + tensor.n_bytes for tensor in tensors) if tensors else self.position
        if not self.decode_all:
            return _Header(fields, (), alignment, data_start, data_end)
        model_fields = {key: value for key, value in fields.items() if not key.startswith(SYNTHETIC_KEY_PREFIXES)}
        located = tuple(dataclasses.replace(tensor, offset=data_start + tensor.offset) for tensor in tensors)
        return _Header(model_fields, located, alignment, data_start, data_end)


def _scan_header(path, decode_all: bool = False, digest: bool = False):
    """Check a GGUF file's header and that the file holds all its tensor data
    (ModelFileError if not). digest: also the SHA-256 of the header's bytes
    (up to the tensor data), returned beside it."""
    if isinstance(path, Path):
        if not path.exists():
            raise ModelFileError(f"{path}: no such file")
        if path.is_dir():
            raise ModelFileError(f"{path}: is a directory, not a GGUF file")
        if not path.is_file():
            raise ModelFileError(f"{path}: is not a regular file")
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size if isinstance(path, Path) else path.size
        scanner = _HeaderScanner(path, handle, decode_all, size)
        header = scanner.header()
        if header.data_end > size:
            raise ModelFileError(f"{path}: truncated GGUF file ({size} bytes, tensor data needs {header.data_end})")
        if not digest:
            return header
        handle.seek(0)
        return header, hashlib.sha256(handle.read(header.data_start)).digest()


def read_scalars(path: str | os.PathLike[str]) -> dict[str, object]:
    """Scalar and string metadata of one GGUF file, fast (arrays are skipped).

    Also checks the header and that the file holds all its tensor data: raises
    ModelFileError for a file that is missing, not GGUF, corrupt or truncated.
    """
    return _scan_header(Path(path)).scalars


def stage_info_of(path: str | os.PathLike[str]) -> StageFileInfo | None:
    """The stage metadata of a file (checked readable and complete), or None for a whole model."""
    scalars = read_scalars(path)
    return _stage_info(Path(path), scalars)


def stage_info(model: ModelFile) -> StageFileInfo | None:
    """The stage metadata of a parsed model, or None for a whole (unsplit) model."""
    return _stage_info(model.paths[0], model.metadata)


_STAGE_COUNTS = (KEY_STAGE_INDEX, KEY_STAGE_COUNT, KEY_FIRST_BLOCK, KEY_BLOCK_COUNT, KEY_TOTAL_BLOCKS)
_STAGE_TEXTS = (KEY_SOURCE_FINGERPRINT, KEY_SOURCE_NAME)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")  # hashlib's hexdigest of SHA-256


def _stage_info(path: Path, value: dict[str, object]) -> StageFileInfo | None:
    if KEY_STAGE_INDEX not in value:
        return None
    for key in _STAGE_COUNTS + _STAGE_TEXTS:
        if key not in value:
            raise ModelFileError(f"{path}: incomplete specpipe stage metadata (no {key})")
    for key in _STAGE_COUNTS:  # as the splitter writes them: uint32
        number = value[key]
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            shown = number if isinstance(number, (int, float)) else f"a {type(number).__name__}"
            raise ModelFileError(f"{path}: corrupt specpipe stage metadata ({key} is {shown}, not a count)")
    fingerprint, source_name = value[KEY_SOURCE_FINGERPRINT], value[KEY_SOURCE_NAME]
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise ModelFileError(f"{path}: corrupt specpipe stage metadata ({KEY_SOURCE_FINGERPRINT} is not a SHA-256)")
    if not isinstance(source_name, str) or not source_name.isprintable():  # it appears in messages
        raise ModelFileError(f"{path}: corrupt specpipe stage metadata ({KEY_SOURCE_NAME} is not a file name)")
    return StageFileInfo(
        path=path,
        stage_index=value[KEY_STAGE_INDEX],  # type: ignore[arg-type]
        stage_count=value[KEY_STAGE_COUNT],  # type: ignore[arg-type]
        first_block=value[KEY_FIRST_BLOCK],  # type: ignore[arg-type]
        block_count=value[KEY_BLOCK_COUNT],  # type: ignore[arg-type]
        total_blocks=value[KEY_TOTAL_BLOCKS],  # type: ignore[arg-type]
        source_fingerprint=fingerprint,
        source_name=source_name,
    )


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
    present = sum(1 for index in seen if index < count)
    if present < count:  # count comes from the file: list a few missing stages, not 2**32
        missing = itertools.islice((index + 1 for index in range(count) if index not in seen), 5)
        more = ", ..." if count - present > 5 else ""
        names = ", ".join(str(path) for path in paths)
        raise ModelFileError(
            f"stage {', '.join(map(str, missing))}{more} of {count} missing: have only {names}"
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
        names = ", ".join(str(path) for path in paths)
        raise ModelFileError(f"stages {names} cover blocks 0-{expected_first} of {first.total_blocks}: incomplete")
