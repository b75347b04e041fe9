"""Stage files compute exactly what the whole model computes (real llama.cpp, no Ray)."""

import numpy as np
import pytest

from orchestrator.verify_split import compare_split
from stages.engine import StageEngine
from stages.settings import StageSettings
from stages.gguf_file import read_model, stage_info

from conftest import PROMPTS
from support.gguf_reading import assert_read_as_the_gguf_package_reads, write_shards


def chain_greedy(engines, prompt, max_tokens, is_end):
    """Plain greedy decoding through a chain of stage engines in this process."""
    def through(positions, tokens):
        hidden = None
        for engine in engines:
            hidden = engine.decode(positions, tokens=tokens) if engine.is_first else engine.decode(positions, hidden=hidden)
        return hidden[-1]

    for engine in engines:
        engine.remove(0)  # a new prompt: drop every cached position
    logits = through(np.arange(len(prompt), dtype=np.int32), np.array(prompt, np.int32))
    produced, position = [], len(prompt)
    while len(produced) < max_tokens:
        token = int(np.argmax(logits))
        if is_end(token):
            break
        produced.append(token)
        logits = through(np.array([position], np.int32), np.array([token], np.int32))
        position += 1
    return produced


@pytest.mark.parametrize("stage_count", [2, 3])
def test_split_logits_are_bit_identical(smollm2, splits, stage_count):
    report = compare_split(smollm2, splits[stage_count])
    assert report.max_difference == 0.0
    assert report.tokens_identical


@pytest.mark.parametrize("stage_count", [1, 2, 3])
def test_greedy_through_stages_equals_llama_on_the_whole_model(smollm2, splits, reference, stage_count):
    import llama_cpp

    paths = [smollm2] if stage_count == 1 else splits[stage_count]
    engines = [StageEngine(path, StageSettings(n_ctx=1024)) for path in paths]
    is_end = lambda token: llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token)  # noqa: E731
    try:
        for prompt in PROMPTS:
            tokens = reference.tokenize(prompt)
            expected = reference.greedy(tokens, 48).tokens
            assert len(expected) >= 8
            assert chain_greedy(engines, tokens, 48, is_end) == expected, prompt
    finally:
        for engine in engines:
            engine.close()


def test_stage_files_record_their_place(smollm2, splits):
    source = read_model(smollm2)
    infos = [stage_info(read_model(path)) for path in splits[3]]
    assert [(info.first_block, info.block_count) for info in infos] == [(0, 10), (10, 10), (20, 10)]
    assert {info.total_blocks for info in infos} == {30}
    assert {info.source_fingerprint for info in infos} == {source.fingerprint}
    assert [(info.stage_index, info.stage_count) for info in infos] == [(0, 3), (1, 3), (2, 3)]


def test_the_header_reads_as_the_gguf_package_reads_it(smollm2):
    """read_model's own scanner against the gguf package's reader on the real file (every value type
    on a small built file: tests/pure/test_gguf_fuzz.py)."""
    assert_read_as_the_gguf_package_reads(smollm2)
    assert len(read_model(smollm2).tensors) > 200


def test_quantized_tensors_are_copied_byte_for_byte(smollm2, splits):
    source = read_model(smollm2)
    stage = read_model(splits[2][1])
    first = stage_info(stage).first_block
    by_name = {tensor.name: tensor for tensor in source.tensors}
    checked = 0
    for tensor in stage.tensors:
        name = tensor.name
        if name.startswith("blk."):
            index, rest = name[4:].split(".", 1)
            name = f"blk.{int(index) + first}.{rest}"
        original = by_name[name]
        assert (tensor.ggml_type, tensor.shape) == (original.ggml_type, original.shape)
        with open(original.path, "rb") as a, open(tensor.path, "rb") as b:
            a.seek(original.offset)
            b.seek(tensor.offset)
            assert a.read(original.n_bytes) == b.read(tensor.n_bytes), name
        checked += 1
    assert checked == len(stage.tensors) > 100


def test_gemma3_split_inside_a_sliding_window_period_is_exact(gemma3, tmp_path):
    """Block 9 is not a multiple of Gemma 3's period of 6: renumbering alone
    gave logits off by up to 5.2 (design note); the slice's explicit per-layer
    sliding-window pattern makes it exact."""
    from stages.split import split_model

    outputs = [str(tmp_path / "g0.gguf"), str(tmp_path / "g1.gguf")]
    plan = split_model(gemma3, outputs, [9])
    assert plan.ranges == ((0, 9), (9, 18))
    report = compare_split(gemma3, outputs)
    assert report.max_difference == 0.0 and report.tokens_identical


def test_multi_file_model_splits_exactly(smollm2, tmp_path):
    from stages.split import split_model

    write_shards(smollm2, str(tmp_path / "smol.gguf"), tensors_per_shard=120)
    first_shard = tmp_path / "smol-00001-of-00003.gguf"
    assert first_shard.exists() and (tmp_path / "smol-00003-of-00003.gguf").exists()
    assert len(read_model(first_shard).tensors) == len(read_model(smollm2).tensors)
    outputs = [str(tmp_path / "s0.gguf"), str(tmp_path / "s1.gguf")]
    split_model(first_shard, outputs)
    report = compare_split(smollm2, outputs)
    assert report.max_difference == 0.0 and report.tokens_identical


def test_verify_split_fails_when_the_whole_model_computes_something_else(smollm2, splits, tmp_path):
    """The whole model's file with one norm's weights doubled (its header, hence
    its fingerprint, unchanged): the stages cut from the original no longer
    reproduce it, and verify-split says so and exits 1."""
    import shutil

    from conftest import orchestrate

    altered = tmp_path / "altered.gguf"
    shutil.copy(smollm2, altered)
    (norm,) = [tensor for tensor in read_model(altered).tensors if tensor.name == "blk.20.attn_norm.weight"]
    assert norm.ggml_type == 0 and norm.path == altered  # float32: doubling keeps it a valid model
    with open(altered, "r+b") as handle:
        handle.seek(norm.offset)
        weights = np.frombuffer(handle.read(norm.n_bytes), dtype="<f4") * 2
        handle.seek(norm.offset)
        handle.write(weights.astype("<f4").tobytes())
    result = orchestrate("verify-split", altered, *splits[2])
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == ["error: the stages do not reproduce the whole model"], result.stderr
    difference = float(result.stdout.split("largest logit difference ")[1].split(";")[0])
    assert difference > 0
