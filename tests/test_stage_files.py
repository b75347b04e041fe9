"""Bad inputs: each gives one clear line and a non-zero exit, never a traceback."""

import os
import shutil
from pathlib import Path

import pytest

from conftest import orchestrate
from stages.gguf_file import ModelFileError, StageFileInfo, read_model, stage_info, validate_stage_set


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


@pytest.mark.model
def test_non_gguf_file(bad_files, tmp_path):
    result = orchestrate("split", bad_files["text"], tmp_path / "a.gguf", tmp_path / "b.gguf")
    assert_one_line_error(result, "not a GGUF file", "notes.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.model
def test_truncated_file(bad_files, tmp_path):
    result = orchestrate("split", bad_files["truncated"], tmp_path / "a.gguf", tmp_path / "b.gguf")
    assert_one_line_error(result, "truncated", "truncated.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.pure
def test_missing_file(tmp_path):
    assert_one_line_error(orchestrate("split", tmp_path / "nope.gguf", tmp_path / "a.gguf"), "no such file")


@pytest.mark.model
def test_bad_boundary(smollm2, tmp_path):
    result = orchestrate("split", smollm2, tmp_path / "a.gguf", tmp_path / "b.gguf", "--boundaries", "30")
    assert_one_line_error(result, "boundary 30", "empty")
    result = orchestrate("split", smollm2, tmp_path / "a.gguf", tmp_path / "b.gguf", "--boundaries", "10,20")
    assert_one_line_error(result, "need 1 boundaries")
    assert not list(tmp_path.iterdir())


@pytest.mark.model
def test_split_only_a_stage_that_does_not_exist(smollm2, tmp_path):
    result = orchestrate("split", smollm2, tmp_path / "a.gguf", tmp_path / "b.gguf", "--only", "2")
    assert_one_line_error(result, "no stage 2", "stages 0..1")
    assert not list(tmp_path.iterdir())


@pytest.mark.model
def test_wrong_order_missing_stage_and_mixed_splits(smollm2, splits):
    three, two = splits[3], splits[2]
    assert_one_line_error(orchestrate("verify-split", smollm2, three[1], three[0], three[2]), "out of order")
    assert_one_line_error(orchestrate("verify-split", smollm2, three[0], three[2]), "stage 2 of 3 missing")
    assert_one_line_error(orchestrate("verify-split", smollm2, three[0], two[1]), "3-stage split", "2-stage split")


@pytest.mark.model
def test_stages_of_different_models(smollm2, splits, gemma3, tmp_path):
    from stages.split import split_model

    gemma_stages = [tmp_path / "g0.gguf", tmp_path / "g1.gguf"]
    split_model(gemma3, gemma_stages, [12])
    result = orchestrate("run", "--model-split", splits[2][0], gemma_stages[1], "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(result, "different models")


@pytest.mark.model
def test_unsplit_file_among_stages(smollm2, splits):
    with pytest.raises(ModelFileError, match="not a specpipe stage file"):
        validate_stage_set([stage_info(read_model(splits[2][0])), None], [splits[2][0], smollm2])


@pytest.mark.model
def test_first_shard_required(tmp_path, smollm2):
    shard = tmp_path / "model-00002-of-00002.gguf"
    shutil.copy(smollm2, shard)
    with pytest.raises(ModelFileError, match="give the first shard"):
        read_model(shard)


def info(index: int, count: int, first: int, blocks: int, total: int = 30, name: str = "") -> StageFileInfo:
    """A stage file's header as split writes it: stage index of count, blocks [first, first + blocks) of total."""
    return StageFileInfo(Path(name or f"stage-{index}.gguf"), index, count, first, blocks, total, "fingerprint", "m")


@pytest.mark.pure
def test_a_complete_contiguous_set_is_accepted():
    validate_stage_set([info(0, 2, 0, 12), info(1, 2, 12, 18)], [Path("stage-0.gguf"), Path("stage-1.gguf")])


@pytest.mark.pure
def test_the_same_stage_twice_is_refused():
    stages = [info(0, 2, 0, 12, name="a.gguf"), info(0, 2, 0, 12, name="b.gguf")]
    with pytest.raises(ModelFileError, match=r"^b.gguf and a.gguf are both stage 1$"):
        validate_stage_set(stages, [Path("a.gguf"), Path("b.gguf")])


@pytest.mark.pure
def test_stages_whose_blocks_are_not_contiguous_are_refused():
    """Stage 2 starts at block 14 where stage 1 ended at 12 (headers of two different cuts)."""
    stages = [info(0, 2, 0, 12), info(1, 2, 14, 16)]
    with pytest.raises(ModelFileError, match=r"^stage-1.gguf: starts at block 14, expected 12 \(not contiguous\)$"):
        validate_stage_set(stages, [Path("stage-0.gguf"), Path("stage-1.gguf")])


@pytest.mark.pure
def test_stages_that_do_not_cover_every_block_are_refused():
    stages = [info(0, 2, 0, 12), info(1, 2, 12, 10)]  # the model has 30 blocks: 22..29 are in no stage
    with pytest.raises(ModelFileError, match=r"^stages stage-0.gguf, stage-1.gguf cover blocks 0-22 of 30: incomplete$"):
        validate_stage_set(stages, [Path("stage-0.gguf"), Path("stage-1.gguf")])
