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
    common = ["run", "--model-split", smollm2, "--raw", "--prompt", "Hello", "--n-ctx", "40", "--max-tokens", "36"]
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


def test_a_prompt_goes_in_the_chat_template_where_the_model_has_one_unless_raw(smollm2, monkeypatch):
    """run's prompt (orchestrator.run.prompt_tokens): --chat, --raw, or by
    default the model's chat template when its file has one (as llama.cpp's CLI)."""
    from orchestrator.run import prompt_tokens
    from stages.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    question = "Why is the sky blue?"
    assert tokenizer.chat_template
    assert prompt_tokens(tokenizer, question, None) == prompt_tokens(tokenizer, question, True) \
        == tokenizer.chat_prompt(question)
    assert prompt_tokens(tokenizer, question, False) == tokenizer.tokenize(question) != tokenizer.chat_prompt(question)
    monkeypatch.setattr(tokenizer, "chat_template", "")  # a model without one: the text as it is
    assert prompt_tokens(tokenizer, question, None) == tokenizer.tokenize(question)


def test_a_drafter_that_failed_or_was_lost_is_named_in_the_summary_line_and_the_json():
    """A speculator failing every time drafts nothing; its last error is shown,
    as is why a drafter was lost (orchestrator.run.RunOutcome)."""
    from orchestrator.decoding.loop import Generation
    from orchestrator.run import RunOutcome, SpeculatorReport

    reports = [SpeculatorReport(0, "n0", 0.5, lost=""),
               SpeculatorReport(1, "n1", 0.0, lost="", error="RuntimeError: the draft's context is full"),
               SpeculatorReport(2, "n2", 0.1, lost="sent 9 draft tokens (at most 8)")]
    outcome = RunOutcome("", Generation([1, 2], tokens=[5]), [], reports, 0.0, [])
    assert outcome.summary_line().endswith(
        "; drafter 1 failed: RuntimeError: the draft's context is full; drafter 2 lost: sent 9 draft tokens (at most 8)]")
    assert [entry["error"] for entry in outcome.as_json()["speculators"]] == [
        "", "RuntimeError: the draft's context is full", ""]
