"""A set of stage files checked from their headers alone (stages.gguf_file.validate_stage_set), and a
missing file's one line: each gives one clear line, never a traceback."""

from pathlib import Path

import pytest

from conftest import orchestrate
from stages.gguf_file import ModelFileError, StageFileInfo, same_slice, validate_stage_set


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_file(tmp_path):
    assert_one_line_error(orchestrate("split", tmp_path / "nope.gguf", tmp_path / "a.gguf"), "no such file")


def info(index: int, count: int, first: int, blocks: int, total: int = 30, name: str = "") -> StageFileInfo:
    """A stage file's header as split writes it: stage index of count, blocks [first, first + blocks) of total."""
    return StageFileInfo(Path(name or f"stage-{index}.gguf"), index, count, first, blocks, total, "fingerprint", "m")


def test_the_same_slice_wherever_its_file_lies_and_no_other():
    """A stage shipped again to another node's cache is the same slice at another path (a lost node's
    stage restarted on a spare: tests/ray/test_node_loss.py); another slice, or no file, is not."""
    import dataclasses

    here = info(0, 2, 0, 15)
    assert same_slice(here, dataclasses.replace(here, path=Path("/elsewhere/stage-0.gguf")))
    assert not same_slice(here, info(0, 2, 0, 14))
    assert not same_slice(here, dataclasses.replace(here, source_fingerprint="another"))
    assert not same_slice(here, None) and not same_slice(None, here)
    assert same_slice(None, None)  # a whole model run as one stage (--model-split whole.gguf), restarted


def test_a_complete_contiguous_set_is_accepted():
    validate_stage_set([info(0, 2, 0, 12), info(1, 2, 12, 18)], [Path("stage-0.gguf"), Path("stage-1.gguf")])


def test_the_same_stage_twice_is_refused():
    stages = [info(0, 2, 0, 12, name="a.gguf"), info(0, 2, 0, 12, name="b.gguf")]
    with pytest.raises(ModelFileError, match=r"^b.gguf and a.gguf are both stage 1$"):
        validate_stage_set(stages, [Path("a.gguf"), Path("b.gguf")])


def test_stages_whose_blocks_are_not_contiguous_are_refused():
    """Stage 2 starts at block 14 where stage 1 ended at 12 (headers of two different cuts)."""
    stages = [info(0, 2, 0, 12), info(1, 2, 14, 16)]
    with pytest.raises(ModelFileError, match=r"^stage-1.gguf: starts at block 14, expected 12 \(not contiguous\)$"):
        validate_stage_set(stages, [Path("stage-0.gguf"), Path("stage-1.gguf")])


def test_stages_that_do_not_cover_every_block_are_refused():
    stages = [info(0, 2, 0, 12), info(1, 2, 12, 10)]  # the model has 30 blocks: 22..29 are in no stage
    with pytest.raises(ModelFileError, match=r"^stages stage-0.gguf, stage-1.gguf cover blocks 0-22 of 30: incomplete$"):
        validate_stage_set(stages, [Path("stage-0.gguf"), Path("stage-1.gguf")])
