"""The bytes of a stage file, described before any is written: a header, then
each tensor's bytes as a range of the source file, with zero padding between.

``split`` writes an image to disk and ``orchestrator.cluster.shipping`` streams one to
another machine from any offset (a resumed transfer), both reading the source
in chunks: no stage is ever held in memory whole. The header (metadata and
tensor table, a few MiB at most: the vocabulary is the largest part) is made
with gguf's own writer, so a stage file is exactly what ``GGUFWriter`` would
write. Pure: no llama.cpp, no Ray.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
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
)
from stages.layer_rules import slice_metadata_overrides

CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class SourceRange:
    """``length`` bytes of ``path`` from ``offset`` (a tensor's data). path: a
    file on this machine, or one elsewhere with ``open_ranges()`` (a
    ByteSource: orchestrator.sources.remote_file.RemoteFile)."""

    path: Path
    offset: int
    length: int


class FileRanges:
    """A ByteSource over a file on this machine: ``read(offset, length)``
    yields its bytes [offset, offset + length) in chunks of at most
    ``chunk_bytes``; ``close()`` when done."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "rb")

    def read(self, offset: int, length: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        self.handle.seek(offset)
        while length:
            chunk = self.handle.read(min(chunk_bytes, length))
            if not chunk:
                raise ModelFileError(f"{self.path}: ended early (a tensor's data runs past its end)")
            length -= len(chunk)
            yield chunk

    def close(self) -> None:
        self.handle.close()


def open_ranges(location):
    """A ByteSource over ``location``: a file here, or one elsewhere that opens its own."""
    return FileRanges(location) if isinstance(location, Path) else location.open_ranges()


@dataclass(frozen=True)
class Zeros:
    """``length`` zero bytes (alignment padding)."""

    length: int


@dataclass(frozen=True)
class StageImage:
    """A file as its header bytes and then its parts, in order. size: its length in bytes."""

    header: bytes
    parts: tuple[SourceRange | Zeros, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(part.length for part in self.parts)

    def chunks(self, start: int = 0, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The file's bytes from offset ``start`` to its end, at most ``chunk_bytes`` at a time.
        A source shorter than its tensor table says is a ModelFileError.
        Each tensor's bytes are asked of its source as one range."""
        if not 0 <= start <= self.size:
            raise ValueError(f"offset {start} is outside a file of {self.size} bytes")
        position = 0  # of the current part's first byte in the file
        if start < len(self.header):
            for low in range(start, len(self.header), chunk_bytes):
                yield self.header[low:low + chunk_bytes]
        position = len(self.header)
        sources: dict[object, object] = {}
        try:
            for part in self.parts:
                skip = max(0, start - position)
                position += part.length
                if skip >= part.length:
                    continue
                if isinstance(part, Zeros):
                    yield bytes(part.length - skip)
                    continue
                source = sources.get(part.path)
                if source is None:
                    source = sources[part.path] = open_ranges(part.path)
                yield from source.read(part.offset + skip, part.length - skip, chunk_bytes)  # type: ignore[attr-defined]
        finally:
            for source in sources.values():
                source.close()  # type: ignore[attr-defined]

    def write(self, output: Path, progress=lambda count: None) -> None:
        """Write the file to ``output`` (the caller renames it into place);
        progress(count) after each chunk of tensor data."""
        with open(output, "wb") as out:
            out.write(self.header)
            for chunk in self.chunks(len(self.header)):
                out.write(chunk)
                progress(len(chunk))


def _pad(length: int, alignment: int) -> int:
    return -length % alignment


def _header_bytes(writer) -> bytes:
    """What ``writer`` writes before the tensor data: written to a temporary file and read back."""
    with tempfile.TemporaryDirectory(prefix="specpipe-header-") as folder:
        path = Path(folder) / "header.gguf"
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return path.read_bytes()


def _writer_with_metadata(model: ModelFile, overrides: dict):
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(None, model.architecture)
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
    return writer


def stage_image(model: ModelFile, ranges: tuple[tuple[int, int], ...], stage_index: int, tensors) -> StageImage:
    """The file of stage ``stage_index`` (blocks ``ranges[stage_index]``): its
    tensors as (name in the slice, source TensorLocation) in order."""
    first, end = ranges[stage_index]
    writer = _writer_with_metadata(model, slice_metadata_overrides(model.metadata, first, end - first))
    writer.add_uint32(KEY_STAGE_INDEX, stage_index)
    writer.add_uint32(KEY_STAGE_COUNT, len(ranges))
    writer.add_uint32(KEY_FIRST_BLOCK, first)
    writer.add_uint32(KEY_BLOCK_COUNT, end - first)
    writer.add_uint32(KEY_TOTAL_BLOCKS, model.block_count)
    writer.add_string(KEY_SOURCE_FINGERPRINT, model.fingerprint)
    writer.add_string(KEY_SOURCE_NAME, model.name)
    for name, tensor in tensors:
        # ggml order -> numpy order; the dtype argument only marks the shape as
        # element counts (raw_dtype says what the bytes are).
        writer.add_tensor_info(
            name, tuple(reversed(tensor.shape)), np.dtype(np.float32), tensor.n_bytes, raw_dtype=tensor.ggml_type
        )
    header = _header_bytes(writer)
    parts: list[SourceRange | Zeros] = []
    position = len(header)
    for _, tensor in tensors:
        before = _pad(position, model.alignment)
        after = _pad(tensor.n_bytes, model.alignment)
        if before:
            parts.append(Zeros(before))
        parts.append(SourceRange(tensor.path, tensor.offset, tensor.n_bytes))
        if after:
            parts.append(Zeros(after))
        position += before + tensor.n_bytes + after
    return StageImage(header, tuple(parts))


def vocabulary_image(model: ModelFile) -> StageImage:
    """A GGUF file of the model's metadata and no tensors: enough for
    llama.cpp to load the vocabulary (``vocab_only``), a few MiB."""
    return StageImage(_header_bytes(_writer_with_metadata(model, {})), ())


def write_atomically(image: StageImage, output: Path, progress=lambda count: None) -> None:
    """Write ``image`` to ``output.partial``, then rename it to ``output``:
    an interrupted write leaves no file that looks complete."""
    partial = output.with_name(output.name + ".partial")
    try:
        image.write(partial, progress)
        os.replace(partial, output)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise ModelFileError(f"{output}: {error.strerror or error}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
