"""`orchestrate` on the real model file, as a user runs it, before any Ray: a split of one stage alone, and
the checks that refuse a run (a draft model of another vocabulary, a context too small for the drafts)."""

from pathlib import Path

import pytest

from conftest import orchestrate


def test_split_only_one_stage_matches_the_full_split(smollm2, splits, tmp_path):
    """Each machine cuts its own slice: `--only 1` writes stage 1 alone, byte for byte
    what a full split writes, and not stage 0 (whose folder need not exist here)."""
    elsewhere = tmp_path / "on-another-machine" / "stage-0.gguf"
    mine = tmp_path / "stage-1.gguf"
    result = orchestrate("split", smollm2, elsewhere, mine, "--only", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [f"{mine}: blocks [15, 30)"]
    assert mine.read_bytes() == Path(splits[2][1]).read_bytes()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["stage-1.gguf"]


def test_draft_with_another_vocabulary_is_refused(splits, gemma3):
    result = orchestrate("run", "--model-split", *splits[2], "--prompt", "hi", "--speculator", "model", "--draft", gemma3)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert "vocabulary differs" in result.stderr
    missing = orchestrate("run", "--model-split", *splits[2], "--prompt", "hi", "--speculator", "model")
    assert missing.returncode != 0 and "--draft" in missing.stderr


def test_the_context_check_counts_drafts_only_when_speculating(smollm2):
    common = ["run", "--model-split", smollm2, "--prompt", "Hello", "--n-ctx", "40", "--max-tokens", "36"]
    speculating = orchestrate(*common, "--speculator", "ngram")
    assert speculating.returncode == 1 and "+ --draft-max 8 exceed the context of 40 tokens" in speculating.stderr
    too_long = orchestrate(*common[:-1], "40")
    assert too_long.returncode == 1 and "exceed the context of 40 tokens" in too_long.stderr
    assert "--draft-max" not in too_long.stderr


def test_a_draft_on_a_gpu_this_build_lacks_is_refused_in_one_line(splits, smollm2):
    """--draft-device gpu on the CPU build: one line before anything runs (a local run's drafters use this build)."""
    from stages.backend import detect

    if detect().offloads:
        pytest.skip("a GPU build has a GPU for the draft")
    result = orchestrate("run", "--model-split", *splits[2], "--prompt", "hi", "--speculator", "model", "--draft",
                         smollm2, "--draft-device", "gpu")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "error: --draft-device gpu: this llama.cpp build (cpu) has no GPU"], result.stderr



def test_a_draft_model_is_counted_with_its_kv_cache_where_it_drafts(realistic_draft):
    """The memory check of --model counts the draft on every machine: its file
    and its KV cache (SmolLM2: 30 blocks x 3 KV heads x 64 x f16 keys and
    values = 23,040 bytes a position) for its context times its requests."""
    from orchestrator.cluster.model_files import draft_memory_bytes

    size = Path(realistic_draft).stat().st_size
    assert draft_memory_bytes(realistic_draft, 0) == size
    assert draft_memory_bytes(realistic_draft, 4 * 1024) == size + 4 * 1024 * 23_040
    assert draft_memory_bytes(None, 4 * 1024) == 0


def test_a_drafter_refuses_to_start_where_its_draft_does_not_fit():
    """Each drafter checks, where it runs, that its draft (file and KV cache)
    fits the memory available there, in one line that names it and the machine."""
    import psutil

    from orchestrator.cluster.model_files import check_memory_available
    from stages.engine import StageError

    available = psutil.virtual_memory().available
    check_memory_available(available // 2, "drafter 0's draft model", "10.0.0.2")
    with pytest.raises(StageError, match=r"^drafter 0's draft model needs \d+ MiB, but 10.0.0.2 has \d+ MiB "
                                         r"available \(at most 90% of it is used\)$"):
        check_memory_available(available, "drafter 0's draft model", "10.0.0.2")
