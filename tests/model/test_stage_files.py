"""Bad inputs: each gives one clear line and a non-zero exit, never a traceback (a stage set checked from
its headers alone: tests/pure/test_stage_set.py)."""

import os
import shutil

import pytest

from conftest import orchestrate
from stages.gguf_file import ModelFileError, read_model, stage_info, validate_stage_set


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, smollm2):
    folder = tmp_path_factory.mktemp("bad")
    text = folder / "notes.gguf"
    text.write_text("this is not a model\n")
    truncated = folder / "truncated.gguf"
    with open(smollm2, "rb") as source, open(truncated, "wb") as out:
        out.write(source.read(os.path.getsize(smollm2) // 2))
    return {"text": text, "truncated": truncated}


def test_non_gguf_file(bad_files, tmp_path):
    result = orchestrate("split", bad_files["text"], tmp_path / "a.gguf", tmp_path / "b.gguf")
    assert_one_line_error(result, "not a GGUF file", "notes.gguf")
    assert not list(tmp_path.iterdir())


def test_truncated_file(bad_files, tmp_path):
    result = orchestrate("split", bad_files["truncated"], tmp_path / "a.gguf", tmp_path / "b.gguf")
    assert_one_line_error(result, "truncated", "truncated.gguf")
    assert not list(tmp_path.iterdir())


def test_bad_boundary(smollm2, tmp_path):
    result = orchestrate("split", smollm2, tmp_path / "a.gguf", tmp_path / "b.gguf", "--boundaries", "30")
    assert_one_line_error(result, "boundary 30", "empty")
    result = orchestrate("split", smollm2, tmp_path / "a.gguf", tmp_path / "b.gguf", "--boundaries", "10,20")
    assert_one_line_error(result, "need 1 boundaries")
    assert not list(tmp_path.iterdir())


def test_split_only_a_stage_that_does_not_exist(smollm2, tmp_path):
    result = orchestrate("split", smollm2, tmp_path / "a.gguf", tmp_path / "b.gguf", "--only", "2")
    assert_one_line_error(result, "no stage 2", "stages 0..1")
    assert not list(tmp_path.iterdir())


def test_wrong_order_missing_stage_and_mixed_splits(smollm2, splits):
    three, two = splits[3], splits[2]
    assert_one_line_error(orchestrate("verify-split", smollm2, three[1], three[0], three[2]), "out of order")
    assert_one_line_error(orchestrate("verify-split", smollm2, three[0], three[2]), "stage 2 of 3 missing")
    assert_one_line_error(orchestrate("verify-split", smollm2, three[0], two[1]), "3-stage split", "2-stage split")


def test_stages_of_different_models(smollm2, splits, gemma3, tmp_path):
    from stages.split import split_model

    gemma_stages = [tmp_path / "g0.gguf", tmp_path / "g1.gguf"]
    split_model(gemma3, gemma_stages, [12])
    result = orchestrate("run", "--model-split", splits[2][0], gemma_stages[1], "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(result, "different models")


def test_unsplit_file_among_stages(smollm2, splits):
    with pytest.raises(ModelFileError, match="not a specpipe stage file"):
        validate_stage_set([stage_info(read_model(splits[2][0])), None], [splits[2][0], smollm2])


def test_first_shard_required(tmp_path, smollm2):
    shard = tmp_path / "model-00002-of-00002.gguf"
    shutil.copy(smollm2, shard)
    with pytest.raises(ModelFileError, match="give the first shard"):
        read_model(shard)
