"""A Llama-shaped GGUF model with random Q8_0 weights, made where it runs.

For timing and exactness checks on machines no model file can reach (the
device check carries no model: its source tree must stay under 64 MiB). The
weights are random, so its text is nonsense, but its passes cost what a
trained model of the same shape costs, and every exactness property (split,
lossless verification, batch invariance) is a property of the arithmetic, not
of what the weights mean.

Layout: what llama.cpp's ``llama`` architecture reads: ``token_embd``, per
block ``attn_norm``, ``attn_q/k/v/output``, ``ffn_norm``, ``ffn_gate/up/down``,
then ``output_norm`` and ``output``. Matrices are Q8_0 (blocks of 32 int8
weights and one float16 scale, 34 bytes); norms are float32 ones. A matrix's
scale makes its weights' standard deviation 1/sqrt(its input width), so
activations stay finite through every block. The vocabulary is a
SentencePiece-style one: control tokens, the 256 byte tokens (any text
tokenizes), then letter pairs and triples to fill the rows.

Tensors are written one at a time, so a model of several GiB needs only one
of its matrices in memory.
"""

from __future__ import annotations

import itertools
import os
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Q8_0_BLOCK = 32  # weights per block
Q8_0_BYTES = 34  # a float16 scale, then 32 int8
INT8_STD = float(np.std(np.arange(-127, 128)))  # of weights drawn uniformly from [-127, 127]
PATTERN_BLOCKS = 1 << 16  # random blocks tiled over every matrix, each rolled its own way


@dataclass(frozen=True)
class ModelShape:
    """blocks: transformer blocks; width: the residual stream; ffn: the feed-forward inner width;
    heads / kv_heads: query and key-value heads; vocab: rows of the embedding and output head."""

    blocks: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, input width, output width) of every Q8_0 matrix, in file order."""
        kv = self.kv_heads * self.head_dim
        per_block = [("attn_q", self.width, self.width), ("attn_k", self.width, kv), ("attn_v", self.width, kv),
                     ("attn_output", self.width, self.width), ("ffn_gate", self.width, self.ffn),
                     ("ffn_up", self.width, self.ffn), ("ffn_down", self.ffn, self.width)]
        blocks = [(f"blk.{block}.{name}.weight", fan_in, fan_out)
                  for block in range(self.blocks) for name, fan_in, fan_out in per_block]
        return [("token_embd.weight", self.width, self.vocab), *blocks, ("output.weight", self.width, self.vocab)]

    @property
    def file_bytes(self) -> int:
        """About the file's size: its matrices (norms and header are small)."""
        return sum(fan_in // Q8_0_BLOCK * Q8_0_BYTES * fan_out for _, fan_in, fan_out in self.matrices())


SHAPES = {
    # make test's CPU form: seconds to write and to run
    "tiny": ModelShape(blocks=4, width=256, ffn=768, heads=4, kv_heads=2, vocab=2048, context=2048),
    # Llama 3.2 1B's shape (1.3 GB at Q8_0)
    "1b": ModelShape(blocks=16, width=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256),
    # Llama 3.1 8B's shape (8.5 GB at Q8_0): memory-bound on a GPU, as a 405B stage is
    "8b": ModelShape(blocks=32, width=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
}


class ModelShapeError(ValueError):
    pass


def check_shape(shape: ModelShape) -> None:
    for name, fan_in, _ in shape.matrices():
        if fan_in % Q8_0_BLOCK:
            raise ModelShapeError(f"{name}: input width {fan_in} is not a multiple of {Q8_0_BLOCK} (Q8_0 blocks)")
    if shape.width % shape.heads or shape.heads % shape.kv_heads:
        raise ModelShapeError(f"width {shape.width}, {shape.heads} heads, {shape.kv_heads} KV heads do not divide")
    if shape.vocab < 259:
        raise ModelShapeError(f"vocab {shape.vocab}: needs at least 259 rows (3 control and 256 byte tokens)")


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) of a SentencePiece vocabulary of ``size`` tokens."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte (llama.cpp's token types)
    words = ("".join(letters) for length in (1, 2, 3)
             for letters in itertools.product(string.ascii_lowercase, repeat=length))
    fillers = (piece for word in words for piece in ("\u2581" + word, word))
    pieces += list(itertools.islice(fillers, size - len(pieces)))
    if len(pieces) < size:
        pieces += [f"<extra_{index}>" for index in range(size - len(pieces))]
    scores = [0.0] * 259 + [-float(index) for index in range(size - 259)]  # shorter pieces merge first
    return pieces, scores, types + [1] * (size - 259)


def _q8_0_matrix(pattern: np.ndarray, fan_in: int, fan_out: int, roll: int) -> np.ndarray:
    """uint8[fan_out, fan_in / 32 * 34]: ``pattern``'s blocks rolled by ``roll``, scaled for fan_in."""
    blocks = np.roll(pattern, roll, axis=0)
    blocks[:, :2] = np.frombuffer(np.float16(1 / np.sqrt(fan_in) / INT8_STD).tobytes(), np.uint8)
    row_bytes = fan_in // Q8_0_BLOCK * Q8_0_BYTES
    return np.resize(blocks.reshape(-1), fan_out * row_bytes).reshape(fan_out, row_bytes)


def write_random_model(path: str | os.PathLike[str], shape: ModelShape, seed: int = 0) -> Path:
    """Write the model to ``path`` (through ``path.partial``, renamed when complete)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    check_shape(shape)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, "llama")
    writer.add_name(f"random-llama-{shape.blocks}x{shape.width}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.blocks)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(7)  # LLAMA_FTYPE_MOSTLY_Q8_0
    pieces, scores, types = vocabulary(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)

    matrices = shape.matrices()
    norms = [f"blk.{block}.{name}.weight" for block in range(shape.blocks) for name in ("attn_norm", "ffn_norm")]
    for name, fan_in, fan_out in matrices:
        nbytes = fan_in // Q8_0_BLOCK * Q8_0_BYTES * fan_out
        writer.add_tensor_info(name, (fan_out, fan_in // Q8_0_BLOCK * Q8_0_BYTES), np.dtype(np.uint8), nbytes,
                               raw_dtype=GGMLQuantizationType.Q8_0)
    for name in norms + ["output_norm.weight"]:
        writer.add_tensor_info(name, (shape.width,), np.dtype(np.float32), shape.width * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pattern = rng.integers(-127, 128, (PATTERN_BLOCKS, Q8_0_BYTES), dtype=np.int8).view(np.uint8)
    for index, (name, fan_in, fan_out) in enumerate(matrices):
        writer.write_tensor_data(_q8_0_matrix(pattern, fan_in, fan_out, roll=7919 * index))
    for _ in norms + ["output_norm.weight"]:
        writer.write_tensor_data(np.ones(shape.width, np.float32))
    writer.close()
    os.replace(partial, path)
    return path
