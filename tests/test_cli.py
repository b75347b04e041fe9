"""`orchestrate` end to end, as a user runs it (each run starts its own local Ray)."""

import json
import struct
from pathlib import Path

import pytest

from conftest import PROMPTS, orchestrate


@pytest.mark.ray
def test_split_then_run_json_equals_llama(smollm2, reference, tmp_path):
    outputs = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    result = orchestrate("split", smollm2, *outputs, "--boundaries", "12")
    assert result.returncode == 0, result.stderr
    assert "blocks [0, 12)" in result.stdout and "blocks [12, 30)" in result.stdout
    assert not list(tmp_path.glob("*.partial*"))

    verified = orchestrate("verify-split", smollm2, *outputs)
    assert verified.returncode == 0 and "largest logit difference 0" in verified.stdout

    result = orchestrate("run", "--model-split", *outputs, "--prompt", PROMPTS[0], "--max-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), 24).tokens
    assert report["tokens"] == expected
    assert report["text"] == reference.llama.detokenize(expected).decode()
    assert report["prompt_tokens"] == len(reference.tokenize(PROMPTS[0]))
    assert report["tokens_per_second"] > 0 and report["seconds"] > 0
    assert [stage["layers"] for stage in report["stages"]] == [[0, 12], [12, 30]]
    assert all(stage["busy_seconds"] > 0 and stage["node"] for stage in report["stages"])
    # a plain run starts nothing ahead, so nothing is cancelled
    assert [(stage["passes_dropped"], stage["passes_stopped"]) for stage in report["stages"]] == [(0, 0), (0, 0)]


@pytest.mark.model
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


@pytest.mark.ray
def test_temperature_and_seed_change_the_text_and_the_same_seed_reproduces_it(smollm2, reference):
    """The whole model as one stage. At temperature 1.5 sixteen tokens drawn
    with seed 5 are the same twice, differ from seed 6's and from greedy
    decoding's: --temperature and --seed both reach the sampler (greedy with
    them ignored would give the same text every time)."""
    common = ["--model-split", smollm2, "--prompt", PROMPTS[2], "--max-tokens", "16", "--json"]
    runs = [orchestrate("run", *common, "--temperature", "1.5", "--seed", seed) for seed in ("5", "5", "6")]
    assert all(result.returncode == 0 for result in runs), [result.stderr for result in runs]
    first, again, other_seed = (json.loads(result.stdout)["tokens"] for result in runs)
    greedy = reference.greedy(reference.tokenize(PROMPTS[2]), 16).tokens
    assert first == again
    assert first != other_seed
    assert first != greedy and other_seed != greedy
    assert [stage["layers"] for stage in json.loads(runs[0].stdout)["stages"]] == [[0, 30]]


@pytest.mark.ray
def test_run_with_token_trees_gives_the_whole_models_tokens(reference):
    prompt = "the cat sat on the mat. the cat ate the fish. the cat sat on the mat. the cat ate the"
    result = orchestrate("run", "--prompt", prompt, "--max-tokens", "24", "--speculator", "ngram",
                         "--tree-leaves", "4", "--schedule", "sync", "--json")
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["tokens"] == reference.greedy(reference.tokenize(prompt), 24).tokens
    # how many trees pay is the rule's choice at this machine's measured batch cost; the run reports them
    assert {"tree_passes", "tree_side_rows", "tree_side_accepted", "refed_tokens"} <= output.keys()
    assert output["committed_tokens_per_pass"] >= 1.0


@pytest.mark.ray
def test_default_run_streams_a_chat_answer_and_a_summary():
    result = orchestrate("run", "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) >= 10
    summary = result.stderr.strip().splitlines()[-1]
    assert "32 tokens" in summary and "tokens/s" in summary and "2 stages" in summary


@pytest.mark.pure
@pytest.mark.parametrize("arguments, message", [
    (["--prompt", "a", "--prompt-file", __file__], "Error: give --prompt or --prompt-file, not both"),
    (["--max-tokens", "0"], "Error: Invalid value for '--max-tokens': 0 is not in the range x>=1."),
    (["--tree-leaves", "4"], "Error: --tree-leaves needs --speculator ngram (prompt lookup drafts the trees)"),
])
def test_a_usage_error_is_one_error_line_after_clicks_usage_hint(arguments, message):
    """Click's usage errors: exit status 2, the usage and help hint, then one
    line that names the problem (and nothing else that says error)."""
    result = orchestrate("run", *arguments)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert [line for line in lines if "error" in line.lower()] == [message], result.stderr
    assert lines[0].startswith("Usage: ") and lines[-1] == message and len(lines) == 3, result.stderr


@pytest.mark.ray
def test_run_with_speculation_reports_its_figures(splits):
    common = ["run", "--model-split", *splits[2], "--prompt", "Repeat exactly: one two three four five six seven eight.",
              "--chat", "--max-tokens", "24", "--json"]
    plain = orchestrate(*common)
    speculative = orchestrate(*common, "--speculator", "ngram", "--schedule", "async", "--draft-max", "6")
    assert plain.returncode == 0 and speculative.returncode == 0, speculative.stderr
    plain, speculative = json.loads(plain.stdout), json.loads(speculative.stdout)
    assert speculative["tokens"] == plain["tokens"]
    assert speculative["target_passes"] < plain["target_passes"]
    assert speculative["accepted_tokens"] > 0 and 0 < speculative["acceptance_rate"] <= 1
    histogram = speculative["accepted_length_histogram"]
    verified = sum(int(length) * count for length, count in histogram.items())
    # every generated token after the first was verified by a pass (the last pass may also
    # verify the end token and tokens past it)
    assert len(speculative["tokens"]) - 1 <= verified <= len(speculative["tokens"]) - 1 + 7
    # every pass the target ran was verified or (started ahead on a failed speculation) discarded
    verified_passes = sum(speculative["target_input_length_histogram"].values())
    assert verified_passes + speculative["target_passes_discarded"] == speculative["target_passes"]
    assert speculative["draft_tokens_wasted"] >= 0
    assert [entry["index"] for entry in speculative["speculators"]] == [0, 1]
    assert all(entry["lost"] == "" for entry in speculative["speculators"])


@pytest.mark.model
def test_draft_with_another_vocabulary_is_refused(splits, gemma3):
    result = orchestrate("run", "--model-split", *splits[2], "--prompt", "hi", "--speculator", "model", "--draft", gemma3)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert "vocabulary differs" in result.stderr
    missing = orchestrate("run", "--model-split", *splits[2], "--prompt", "hi", "--speculator", "model")
    assert missing.returncode != 0 and "--draft" in missing.stderr


@pytest.mark.pure
@pytest.mark.parametrize("arguments, message", [
    (["run", "--prompt", "  "], "the prompt is empty"),
    (["run", "--prompt-file", "NOT_UTF8"], "is not UTF-8 text (byte 2)"),
    (["run", "--prompt", "hi", "--place", "0=10.0.0.1,0=10.0.0.2"], "--place names stage 0 twice"),
    (["run", "--prompt", "hi", "--draft", "small.gguf"], "--draft is only used with --speculator model"),
    (["run", "--prompt", "hi", "--n-ctx", str(2**32 + 16)], "--n-ctx"),
    (["run", "--prompt", "hi", "--threads", str(2**31)], "--threads"),
    (["serve", "--draft", "small.gguf"], "--draft is only used with --speculator model"),
    (["serve", "--speculator", "model"], "--speculator model needs --draft"),
    (["serve", "--n-ctx", str(2**20), "--max-sequences", "64"], "exceeds 16777216 KV cells per stage"),
])
def test_bad_options_are_refused_in_one_line_before_anything_starts(arguments, message, tmp_path):
    """ctypes would silently truncate a context of 2**32 + 16 to 16: such numbers are refused."""
    not_utf8 = tmp_path / "prompt.txt"
    not_utf8.write_bytes(b"hi\xff\xfe")
    result = orchestrate(*[str(not_utf8) if argument == "NOT_UTF8" else argument for argument in arguments])
    assert result.returncode == 2 or result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


GGUF_START = b"GGUF" + struct.pack("<IQ", 3, 0)  # magic, version 3, no tensors


def gguf_key(name: bytes, value_type: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", value_type) + value


CRAFTED_HEADERS = {
    "key length 2**62": GGUF_START + struct.pack("<QQ", 1, 2**62),
    "array count 2**60": GGUF_START + struct.pack("<Q", 1) + gguf_key(b"a", 9, struct.pack("<IQ", 0, 2**60)),
    "alignment 0": GGUF_START + struct.pack("<Q", 1) + gguf_key(b"general.alignment", 4, struct.pack("<I", 0)),
    "a key on two lines of unknown type": GGUF_START + struct.pack("<Q", 1) + gguf_key(b"a\nb", 99, b"\0" * 8),
}


COMMANDS_READING_A_FILE = {  # CRAFTED is replaced by the file, A and B by files in the test's folder
    "run": ["run", "--model-split", "CRAFTED", "--prompt", "hi"],
    "verify-split": ["verify-split", "whole.gguf", "CRAFTED"],
    "split": ["split", "CRAFTED", "A", "B"],
}


@pytest.mark.pure
@pytest.mark.parametrize("command", sorted(COMMANDS_READING_A_FILE))
@pytest.mark.parametrize("header", sorted(CRAFTED_HEADERS))
def test_a_crafted_gguf_header_gives_one_line_not_a_traceback(command, header, tmp_path):
    """Each command checks the file's header before Ray or llama.cpp starts, or anything is written."""
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(CRAFTED_HEADERS[header])
    put = {"CRAFTED": crafted, "A": tmp_path / "a.gguf", "B": tmp_path / "b.gguf"}
    result = orchestrate(*[put.get(argument, argument) for argument in COMMANDS_READING_A_FILE[command]])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {crafted}: "), result.stderr
    assert result.stdout == "" and sorted(tmp_path.iterdir()) == [crafted]


@pytest.mark.model
def test_the_context_check_counts_drafts_only_when_speculating(smollm2):
    common = ["run", "--model-split", smollm2, "--prompt", "Hello", "--n-ctx", "40", "--max-tokens", "36"]
    speculating = orchestrate(*common, "--speculator", "ngram")
    assert speculating.returncode == 1 and "+ --draft-max 8 exceed the context of 40 tokens" in speculating.stderr
    too_long = orchestrate(*common[:-1], "40")
    assert too_long.returncode == 1 and "exceed the context of 40 tokens" in too_long.stderr
    assert "--draft-max" not in too_long.stderr
