"""Malformed GGUF headers: every reader of a file ends in ModelFileError, nothing else.

Small GGUF files are built here byte by byte (``Builder`` remembers where each
length, count, type and offset lies), then damaged: targeted cases (a string
length of 2**62, an array count of 2**60, alignment 0, ...) and Hypothesis
mutations (rewritten fields, flipped, inserted and deleted bytes, truncation).
Each reader must return normally (the file is still valid) or raise
ModelFileError with one line that names the file, within a time limit and
without allocating more than a few MiB (as tracemalloc counts).
"""

from __future__ import annotations

import contextlib
import signal
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

import gguf  # imported before any memory is measured
import hypothesis
import hypothesis.strategies as st
import pytest

from stages.gguf_file import ModelFileError, read_model, read_scalars, stage_info, stage_info_of
from stages.stage_files import NOT_FOUND, check_stage_files, read_stage_file
from support.gguf_reading import assert_read_as_the_gguf_package_reads


# GGUF value types and their struct formats (8 is a string, 9 an array).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
F32_TENSOR, Q8_0_TENSOR = 0, 8  # ggml types: 4-byte floats; blocks of 32 values in 34 bytes
SECONDS_PER_READ = 2.0
MEMORY_LIMIT = 8 * 1024**2  # bytes a reader may allocate for a file of a few hundred bytes


class Builder:
    """Writes a GGUF file field by field and remembers where each number lies.

    ``slots[name]`` is (offset, struct format) of a length, count, type, dimension,
    offset or scalar value, for the tests to overwrite."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.slots: dict[str, tuple[int, str]] = {}

    def number(self, fmt: str, value, name: str) -> None:
        self.slots[name] = (len(self.data), fmt)
        self.data += struct.pack("<" + fmt, value)

    def string(self, text: str | bytes, name: str) -> None:
        raw = text.encode() if isinstance(text, str) else text
        self.number("Q", len(raw), f"{name} length")
        self.data += raw

    def value(self, value_type: int, value, name: str) -> None:
        if value_type == STRING:
            self.string(value, name)
        elif value_type == ARRAY:
            item_type, items = value
            self.number("I", item_type, f"{name} item type")
            self.number("Q", len(items), f"{name} count")
            for index, item in enumerate(items):
                self.value(item_type, item, f"{name}[{index}]")
        else:
            self.number(FORMATS[value_type], value, name)

    def pad(self, alignment: int) -> None:
        self.data += bytes(-len(self.data) % alignment)


def tensor_bytes(dims: tuple[int, ...], ggml_type: int) -> int:
    elements = 1
    for dim in dims:
        elements *= dim
    return elements * 4 if ggml_type == F32_TENSOR else elements // 32 * 34


WHOLE_KEYS = [
    ("general.architecture", STRING, "llama"),
    ("general.name", STRING, "fuzz"),
    ("general.alignment", U32, 32),
    ("llama.block_count", U32, 2),
    ("llama.context_length", U64, 2048),
    ("llama.rope.freq_base", F32, 10000.0),
    ("llama.attention.layer_norm_rms_epsilon", F64, 1e-5),
    ("fuzz.small", I8, -3),
    ("fuzz.byte", U8, 200),
    ("fuzz.short", I16, -300),
    ("fuzz.ushort", U16, 60000),
    ("fuzz.long", I64, -(2**40)),
    ("fuzz.flag", BOOL, True),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "a", "b\nc"])),
    ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, -1.0, -2.5])),
    ("tokenizer.ggml.token_type", ARRAY, (I32, [3, 1, 1])),
    ("fuzz.empty", ARRAY, (U8, [])),
]
STAGE_KEYS = [
    ("specpipe.stage.index", U32, 0),
    ("specpipe.stage.count", U32, 1),
    ("specpipe.block.first", U32, 0),
    ("specpipe.block.count", U32, 2),
    ("specpipe.block.total", U32, 2),
    ("specpipe.source.fingerprint", STRING, "0123456789abcdef" * 4),
    ("specpipe.source.name", STRING, "whole.gguf"),
]
TENSORS = [  # name, dims (ggml order), ggml type
    ("token_embd.weight", (4, 3), F32_TENSOR),
    ("blk.0.attn_norm.weight", (4,), F32_TENSOR),
    ("blk.1.ffn_down.weight", (32, 2), Q8_0_TENSOR),
]


def build(keys=WHOLE_KEYS, tensors=TENSORS, *, version: int = 3, alignment: int = 32) -> Builder:
    """A valid GGUF file (the caller may damage it through ``slots``)."""
    out = Builder()
    out.data += b"GGUF"
    out.number("I", version, "version")
    out.number("Q", len(tensors), "tensor count")
    out.number("Q", len(keys), "key count")
    for key, value_type, value in keys:
        out.string(key, f"key {key}")
        out.number("I", value_type, f"type {key}")
        out.value(value_type, value, key)
    offset = 0
    for name, dims, ggml_type in tensors:
        out.string(name, f"tensor {name}")
        out.number("I", len(dims), f"dims {name}")
        for index, dim in enumerate(dims):
            out.number("Q", dim, f"dim {index} {name}")
        out.number("I", ggml_type, f"ggml type {name}")
        out.number("Q", offset, f"offset {name}")
        offset += -(-tensor_bytes(dims, ggml_type) // alignment) * alignment
    out.pad(alignment)
    for name, dims, ggml_type in tensors:
        out.data += bytes(index % 251 for index in range(tensor_bytes(dims, ggml_type)))
        out.pad(alignment)
    return out


def overwrite(file: Builder, slot: str, value: int) -> bytes:
    """The file with one number replaced (wrapped to the slot's width, so -1 is all ones)."""
    offset, fmt = file.slots[slot]
    width = struct.calcsize("<" + fmt)
    data = bytearray(file.data)
    data[offset : offset + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(data)


class TookTooLong(BaseException):
    """Raised by the timer; a BaseException, so no reader's error handling can swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    def expire(signum, frame):
        raise TookTooLong(f"{what} took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


READERS = {
    "read_model": read_model,
    "read_scalars": read_scalars,
    "stage_info_of": stage_info_of,
    "check_stage_files": lambda path: check_stage_files([str(path)]),
    "stage_info(read_model)": lambda path: stage_info(read_model(path)),
}


def outcomes(path: Path) -> dict[str, object]:
    """Each reader's result for the file, or its ModelFileError; anything else propagates."""
    results: dict[str, object] = {}
    for name, reader in READERS.items():
        with time_limit(SECONDS_PER_READ, f"{name} of {path.name}"):
            try:
                results[name] = reader(path)
            except ModelFileError as error:
                message = str(error)
                assert len(message.splitlines()) == 1, f"{name}: {message!r}"
                assert str(path) in message, f"{name}: {message!r}"
                results[name] = error
    node_file = read_stage_file(str(path), "10.0.0.1", "node-id-0123456789")
    if not path.exists():
        assert node_file.problem == NOT_FOUND
    elif isinstance(results["stage_info_of"], ModelFileError):
        assert node_file.problem == str(results["stage_info_of"])
    else:
        assert node_file.problem == "" and node_file.info == results["stage_info_of"]
    return results


def check_readers(path: Path) -> dict[str, object]:
    """Every reader ends in its one error type or reads; the readers agree with each other."""
    results = outcomes(path)
    model = results["read_model"]
    if not isinstance(model, ModelFileError):  # what read_model accepts, the quick reader accepts
        assert not isinstance(results["read_scalars"], ModelFileError), results["read_scalars"]
        if not isinstance(results["stage_info_of"], ModelFileError):
            assert results["stage_info(read_model)"] == results["stage_info_of"]
    return results


def refused(path: Path, *fragments: str) -> None:
    """Every reader refuses the file with a ModelFileError naming each fragment."""
    for name, result in check_readers(path).items():
        assert isinstance(result, ModelFileError), f"{name} read {path.name}: {result!r}"
        for fragment in fragments:
            assert fragment in str(result), f"{name}: {result}"


@pytest.fixture
def write(tmp_path):
    def write(data: bytes, name: str = "crafted.gguf") -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        return path

    return write


def test_the_built_files_are_valid(write):
    whole = check_readers(write(bytes(build().data)))
    model = whole["read_model"]
    assert model.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "b\nc"]
    assert model.metadata["fuzz.long"] == -(2**40) and model.block_count == 2
    assert [(tensor.name, tensor.shape, tensor.offset - model.tensors[0].offset) for tensor in model.tensors] == [
        ("token_embd.weight", (4, 3), 0), ("blk.0.attn_norm.weight", (4,), 64), ("blk.1.ffn_down.weight", (32, 2), 96)
    ]
    assert whole["stage_info_of"] is None and whole["read_scalars"]["fuzz.flag"] is True
    stage = check_readers(write(bytes(build(WHOLE_KEYS + STAGE_KEYS).data)))
    assert stage["stage_info_of"].block_count == 2 and stage["stage_info(read_model)"] == stage["stage_info_of"]
    assert check_readers(write(bytes(build(version=2).data)))["read_model"].block_count == 2


def test_every_value_type_reads_as_the_gguf_package_reads_it(write):
    """Each scalar type, strings, and arrays of strings, floats, ints and none (the real model: tests/model)."""
    assert_read_as_the_gguf_package_reads(write(bytes(build(WHOLE_KEYS + STAGE_KEYS).data)))


def test_a_file_the_gguf_writer_wrote_is_read(tmp_path):
    import numpy as np

    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("blk.0.attn_norm.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    results = check_readers(path)
    assert results["read_model"].tensors[0].shape == (8,) and results["stage_info_of"] is None


# (what is damaged, slot, value, a fragment of the message; None: it may still read)
HUGE = [2**33, 2**60, 2**62, 2**63, 2**64 - 1]
CASES = [
    *[("key length", "key general.name length", value, "truncated") for value in HUGE],
    *[("string value length", "general.name length", value, "truncated") for value in HUGE],
    *[("tensor name length", "tensor blk.0.attn_norm.weight length", value, "truncated") for value in HUGE],
    *[("string array count", "tokenizer.ggml.tokens count", value, "truncated") for value in HUGE],
    *[("string in an array", "tokenizer.ggml.tokens[1] length", value, "truncated") for value in HUGE],
    *[("float array count", "tokenizer.ggml.scores count", value, "truncated") for value in HUGE],
    *[("empty array count", "fuzz.empty count", value, "truncated") for value in HUGE],
    *[("tensor count", "tensor count", value, "truncated") for value in HUGE],
    *[("key count", "key count", value, "truncated") for value in HUGE],
    ("key count one more", "key count", len(WHOLE_KEYS) + 1, ""),
    ("tensor count one more", "tensor count", len(TENSORS) + 1, None),  # the padding reads as a tensor
    ("alignment 0", "general.alignment", 0, "alignment"),
    ("alignment 3", "general.alignment", 3, "alignment"),
    ("alignment 48", "general.alignment", 48, "alignment"),
    ("alignment 2**31", "general.alignment", 2**31, ""),
    ("alignment -1", "general.alignment", -1, "alignment"),
    ("alignment as a string", "type general.alignment", STRING, ""),
    ("alignment as an int32", "type general.alignment", I32, "alignment"),
    ("alignment as a float", "type general.alignment", F32, "alignment"),
    ("version 0", "version", 0, "version"),
    ("version 1", "version", 1, "version"),
    ("version 4", "version", 4, "version"),
    ("version 99", "version", 99, "version"),
    ("version big-endian 3", "version", 3 << 24, "version"),
    ("version 2**32-1", "version", 2**32 - 1, "version"),
    ("unknown value type 13", "type fuzz.flag", 13, "type"),
    ("unknown value type 2**32-1", "type fuzz.flag", 2**32 - 1, "type"),
    ("array of unknown items", "tokenizer.ggml.token_type item type", 13, "type"),
    ("array of arrays", "tokenizer.ggml.token_type item type", ARRAY, "array"),
    ("empty array of arrays", "fuzz.empty item type", ARRAY, "array"),
    ("empty array of unknown items", "fuzz.empty item type", 99, "type"),
    ("5 dimensions", "dims blk.0.attn_norm.weight", 5, "dimensions"),
    ("2**32-1 dimensions", "dims blk.0.attn_norm.weight", 2**32 - 1, ""),
    ("dimension 2**63", "dim 0 blk.0.attn_norm.weight", 2**63, ""),
    ("dimension -1", "dim 0 blk.0.attn_norm.weight", -1, ""),
    ("dimension 2**40", "dim 0 blk.0.attn_norm.weight", 2**40, ""),
    ("dimensions overflowing int64", "dim 1 token_embd.weight", 2**62, ""),
    ("quantized row not whole blocks", "dim 0 blk.1.ffn_down.weight", 31, "block"),
    ("unknown ggml type 4", "ggml type blk.0.attn_norm.weight", 4, "tensor type"),
    ("unknown ggml type 2**32-1", "ggml type blk.0.attn_norm.weight", 2**32 - 1, "tensor type"),
    ("offset beyond the file", "offset blk.1.ffn_down.weight", 4096, "truncated"),
    ("offset 2**62", "offset blk.1.ffn_down.weight", 2**62, "truncated"),
    ("offset 2**64-1", "offset blk.1.ffn_down.weight", 2**64 - 1, ""),
    ("offset unaligned", "offset blk.1.ffn_down.weight", 97, "align"),
    ("block count a string", "type llama.block_count", STRING, ""),
    ("architecture a number", "type general.architecture", U64, ""),
]


@contextlib.contextmanager
def allocations():
    """Yields a function that gives the most memory Python allocated (traced) inside the block."""
    peak = []
    tracemalloc.start()
    try:
        yield lambda: peak[0]
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.parametrize("what, slot, value, fragment", CASES, ids=[case[0] for case in CASES])
def test_a_damaged_field_is_refused_fast_and_without_allocating(write, what, slot, value, fragment):
    for keys in (WHOLE_KEYS, WHOLE_KEYS + STAGE_KEYS):
        path = write(overwrite(build(keys), slot, value))
        started = time.perf_counter()
        with allocations() as peak:
            if fragment is None:
                check_readers(path)
            else:
                refused(path, fragment)
        seconds = time.perf_counter() - started
        assert peak() < MEMORY_LIMIT, f"{what}: the readers allocated {peak()} bytes"
        assert seconds < 2.0, f"{what}: the readers took {seconds:.2f} s"


def replaced(keys, key: str, value_type: int, value) -> list:
    return [(key, value_type, value) if entry[0] == key else entry for entry in keys]


STAGE_KEYS_OF_ANOTHER_TYPE = {
    "stage index a string": replaced(STAGE_KEYS, "specpipe.stage.index", STRING, "0"),
    "stage count a float": replaced(STAGE_KEYS, "specpipe.stage.count", F32, 1.0),
    "first block negative": replaced(STAGE_KEYS, "specpipe.block.first", I32, -1),
    "block count an array": replaced(STAGE_KEYS, "specpipe.block.count", ARRAY, (U32, [2])),
    "fingerprint a number": replaced(STAGE_KEYS, "specpipe.source.fingerprint", U64, 7),
    "no source name": STAGE_KEYS[:-1],
    "source name on two lines": replaced(STAGE_KEYS, "specpipe.source.name", STRING, "a.gguf\nerror: b"),
    "fingerprint not a SHA-256": replaced(STAGE_KEYS, "specpipe.source.fingerprint", STRING, "0123"),
}


@pytest.mark.parametrize("what", sorted(STAGE_KEYS_OF_ANOTHER_TYPE))
def test_stage_metadata_of_another_type_is_refused(write, what):
    """A stage key of another type than the splitter writes cannot be trusted."""
    results = check_readers(write(bytes(build(WHOLE_KEYS + STAGE_KEYS_OF_ANOTHER_TYPE[what]).data)))
    for reader in ("stage_info_of", "check_stage_files", "stage_info(read_model)"):
        assert isinstance(results[reader], ModelFileError), f"{reader}: {results[reader]!r}"


def test_a_stage_count_of_2_to_the_32_is_refused_fast(write):
    """The missing stages are listed, a few of them, not four billion."""
    keys = replaced(STAGE_KEYS, "specpipe.stage.count", U32, 2**32 - 1)
    path = write(bytes(build(WHOLE_KEYS + keys).data))
    results = check_readers(path)
    assert "stage 2, 3, 4, 5, 6, ... of 4294967295 missing" in str(results["check_stage_files"])


MODELS_WITHOUT_WHAT_IT_NEEDS = {
    "no architecture": [key for key in WHOLE_KEYS if key[0] != "general.architecture"],
    "no block count": [key for key in WHOLE_KEYS if key[0] != "llama.block_count"],
    "architecture not a string": replaced(WHOLE_KEYS, "general.architecture", U32, 7),
    "block count not an integer": replaced(WHOLE_KEYS, "llama.block_count", F32, 2.0),
    "block count negative": replaced(WHOLE_KEYS, "llama.block_count", I32, -2),
    "more blocks than tensors": replaced(WHOLE_KEYS, "llama.block_count", U64, 2**40),
}


@pytest.mark.parametrize("what", sorted(MODELS_WITHOUT_WHAT_IT_NEEDS))
def test_a_model_without_what_it_needs_is_refused(write, what):
    results = check_readers(write(bytes(build(MODELS_WITHOUT_WHAT_IT_NEEDS[what]).data)))
    assert isinstance(results["read_model"], ModelFileError)


def test_repeated_key_and_tensor_names_are_refused(write):
    repeated_key = WHOLE_KEYS + [("fuzz.small", I8, 4)]
    refused(write(bytes(build(repeated_key).data)), "fuzz.small")
    repeated_tensor = TENSORS + [TENSORS[1]]
    assert isinstance(check_readers(write(bytes(build(tensors=repeated_tensor).data)))["read_model"], ModelFileError)


def test_names_that_are_not_utf8_or_span_lines(write):
    """Text from the file never breaks the one-line message."""
    for key in (b"fuzz.\xff\xfe", b"fuzz.two\nlines"):
        keys = [*WHOLE_KEYS, (key, U8, 1), (key, U8, 2)]  # repeated: so that every reader refuses
        check_readers(write(bytes(build(keys).data)))
    for name in (b"blk.0.\xff", b"blk.0.two\nlines"):
        tensors = [*TENSORS, (name, (4,), F32_TENSOR), (name, (4,), F32_TENSOR)]
        check_readers(write(bytes(build(tensors=tensors).data)))
    check_readers(write(bytes(build([*WHOLE_KEYS[:1], ("general.name", STRING, b"\xff\xfe"), *WHOLE_KEYS[2:]]).data)))
    check_readers(write(bytes(build([("general.architecture", STRING, "two\nlines"), *WHOLE_KEYS[1:]]).data)))


def test_deeply_nested_arrays_are_refused(write):
    """An array of arrays of arrays ... a million deep must not exhaust the stack."""
    depth = 200_000
    nested = Builder()
    nested.data += b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    nested.string("fuzz.nested", "key")
    nested.data += struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", U8, 0)
    refused(write(bytes(nested.data)))


def test_truncated_anywhere(write):
    """Cut at every byte of the header and some of the data: refused, or (cut in the padding
    after the last tensor) still read."""
    whole = bytes(build(WHOLE_KEYS + STAGE_KEYS).data)
    padding = 96 - tensor_bytes(*TENSORS[-1][1:])  # after the last tensor's 68 bytes
    for end in range(len(whole)):
        results = check_readers(write(whole[:end]))
        if end < len(whole) - padding:
            assert all(isinstance(result, ModelFileError) for result in results.values()), end


def test_wrong_magic_empty_and_not_a_file(write, tmp_path):
    refused(write(b""), "not a GGUF file")
    refused(write(b"GGU"), "not a GGUF file")
    refused(write(b"GGUG" + bytes(build().data)[4:]), "not a GGUF file")
    refused(write(b"\x00" * 4096), "not a GGUF file")
    refused(tmp_path / "absent.gguf", "no such file")
    (tmp_path / "folder.gguf").mkdir()
    refused(tmp_path / "folder.gguf", "directory")


# Hypothesis: damage a valid file in one to four places.
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**33, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
FILES = [build(WHOLE_KEYS), build(WHOLE_KEYS + STAGE_KEYS), build(WHOLE_KEYS[:4], TENSORS[:1])]


@st.composite
def damaged_files(draw) -> bytes:
    file = draw(st.sampled_from(FILES))
    data = bytearray(file.data)
    for slot in draw(st.lists(st.sampled_from(sorted(file.slots)), max_size=2)):  # rewrite a number
        offset, fmt = file.slots[slot]
        width = struct.calcsize("<" + fmt)
        value = draw(st.sampled_from(INTERESTING) | st.integers(0, 2 ** (8 * width) - 1)) % 2 ** (8 * width)
        data[offset : offset + width] = value.to_bytes(width, "little")
    for _ in range(draw(st.integers(0, 2))):  # damage bytes
        if not data:
            break
        position = draw(st.sampled_from(range(len(data))))  # uniform: integers() favours the first bytes
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        if kind == "flip":
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[position] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[position : position + draw(st.integers(1, 16))]
    if draw(st.booleans()):
        del data[draw(st.sampled_from(range(len(data) + 1))) :]
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_path():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder) / "fuzzed.gguf"


@hypothesis.settings(max_examples=2000, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(data=damaged_files())
def test_damaged_files_end_in_model_file_error(fuzz_path, data):
    fuzz_path.write_bytes(data)
    with allocations() as peak:
        check_readers(fuzz_path)
    assert peak() < MEMORY_LIMIT, f"the readers allocated {peak()} bytes"
