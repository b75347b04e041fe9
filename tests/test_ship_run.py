"""`orchestrate run --model WHOLE.gguf`: the stages cut on the driver and
shipped into the node's stage cache (a local Ray: the one node is every
stage's), the tokens the whole model's; a second run ships nothing; a
transfer left half done is resumed, not started again. And the stage image
the transfer streams is byte for byte the file `orchestrate split` writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import PROMPTS, orchestrate

MAX_TOKENS = 16


def shipped_run(smollm2, cache: Path, *options: str) -> dict:
    result = orchestrate("run", "--model", smollm2, "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS),
                         "--json", *options, env={"SPECPIPE_STAGE_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    report["stderr"] = result.stderr
    return report


@pytest.mark.ray
def test_run_from_the_whole_model_ships_each_stage_once_and_resumes_a_partial(smollm2, splits, reference, tmp_path):
    cache = tmp_path / "stage-cache"
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens

    first = shipped_run(smollm2, cache, "--stages", "2")
    assert first["tokens"] == expected
    assert [stage["layers"] for stage in first["stages"]] == [[0, 15], [15, 30]]
    assert "split: of the splits that fit" in first["stderr"] and "stage 1: blocks [15, 30)" in first["stderr"]
    shipped = first["shipped"]
    assert [(item["stage"], item["resumed_from"], item["bytes_sent"]) for item in shipped] == \
        [(0, 0, shipped[0]["bytes"]), (1, 0, shipped[1]["bytes"])]
    for item, split_file in zip(shipped, splits[2]):
        assert Path(item["path"]).parent.parent == cache
        assert Path(item["path"]).read_bytes() == Path(split_file).read_bytes()
    assert not list(cache.rglob("*.partial"))

    again = shipped_run(smollm2, cache, "--stages", "2")
    assert again["tokens"] == expected
    assert [item["bytes_sent"] for item in again["shipped"]] == [0, 0]

    # what an interrupted transfer of stage 1 leaves: the first part of its file, as .partial
    stage_file = Path(shipped[1]["path"])
    kept = 20_000_001
    partial = stage_file.with_name(stage_file.name + ".partial")
    partial.write_bytes(stage_file.read_bytes()[:kept])
    stage_file.unlink()
    resumed = shipped_run(smollm2, cache, "--boundaries", "15")
    assert resumed["tokens"] == expected
    assert [(item["resumed_from"], item["bytes_sent"]) for item in resumed["shipped"]] == \
        [(shipped[0]["bytes"], 0), (kept, shipped[1]["bytes"] - kept)]
    assert stage_file.read_bytes() == Path(splits[2][1]).read_bytes() and not partial.exists()


@pytest.mark.ray
def test_other_boundaries_are_another_file_and_the_split_is_the_users(smollm2, splits, reference, tmp_path):
    report = shipped_run(smollm2, tmp_path, "--boundaries", "10,20")
    assert [stage["layers"] for stage in report["stages"]] == [[0, 10], [10, 20], [20, 30]]
    assert report["tokens"] == reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
    assert "split: of the splits" not in report["stderr"]
    for item, split_file in zip(report["shipped"], splits[3]):
        assert Path(item["path"]).read_bytes() == Path(split_file).read_bytes()


@pytest.mark.pure
@pytest.mark.parametrize("arguments, message", [
    (["--stages", "2"], "go with --model"),
    (["--model", "MODEL", "a.gguf"], "not both"),
    (["--model", "MODEL", "--boundaries", "15", "--profile", "10.0.0.1=p.json"], "only helps choose"),
    (["--model", "MODEL", "--stages", "3", "--boundaries", "15"], "needs 2 boundaries"),
    (["--model", "MODEL", "--profile", "p.json"], "is not ADDRESS=PROFILE.json"),
])
def test_bad_model_options_are_one_line(arguments, message, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    result = orchestrate("run", *[str(model) if argument == "MODEL" else argument for argument in arguments])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.model
def test_a_model_that_fits_no_node_is_refused_with_the_numbers(smollm2):
    """A context whose KV cache cannot fit this machine's memory, split or not."""
    result = orchestrate("run", "--model", smollm2, "--stages", "2", "--n-ctx", str(1 << 24), "--max-tokens", "1")
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "fits no split over 2 node(s)" in line
    assert "MiB in all" in line and "Traceback" not in result.stderr


@pytest.mark.model
def test_the_stage_image_is_the_split_file_and_the_vocabulary_image_reads_as_the_model(smollm2, splits, tmp_path):
    from stages.tokenizer import Tokenizer
    from stages.gguf_file import read_model
    from stages.split import plan_split, stage_file_image
    from stages.stage_image import vocabulary_image, write_atomically

    model = read_model(smollm2)
    plan = plan_split(model, 3, [10, 20])
    for index, split_file in enumerate(splits[3]):
        image = stage_file_image(plan, index)
        expected = Path(split_file).read_bytes()
        assert image.size == len(expected) and b"".join(image.chunks()) == expected
        assert b"".join(image.chunks(len(image.header) + 12345)) == expected[len(image.header) + 12345:]
    vocabulary = tmp_path / "vocabulary.gguf"
    write_atomically(vocabulary_image(model), vocabulary)
    assert os.path.getsize(vocabulary) < 4 * 1024**2
    assert Tokenizer(str(vocabulary)).vocabulary_digest() == Tokenizer(smollm2).vocabulary_digest()
    assert Tokenizer(str(vocabulary)).chat_prompt(PROMPTS[0]) == Tokenizer(smollm2).chat_prompt(PROMPTS[0])


@pytest.mark.ray
def test_serve_from_the_whole_model_ships_then_serves_its_tokens(smollm2, reference, tmp_path, monkeypatch):
    """`orchestrate serve --model`: the stages shipped before the replica
    starts (the split printed), then a greedy completion is the whole model's."""
    import httpx

    from benchmarks.serve_bench import start_specpipe_server, stop_server
    from conftest import free_port

    monkeypatch.setenv("SPECPIPE_STAGE_CACHE", str(tmp_path / "cache"))
    port, log_path = free_port(), tmp_path / "serve.log"
    process = start_specpipe_server(["--model", smollm2, "--stages", "2", "--max-sequences", "2", "--n-ctx", "256"],
                                    port, log_path)
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                 "temperature": 0})
        assert reply.status_code == 200, reply.text
        expected = reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
        assert reply.json()["choices"][0]["text"] == reference.llama.detokenize(expected).decode()
    finally:
        stop_server(process)
    log = log_path.read_text()
    assert "split: of the splits that fit" in log and "shipping stage 1" in log
    assert sorted(path.name for path in (tmp_path / "cache").rglob("*.gguf")) == ["stage-1-of-2.gguf",
                                                                                 "stage-2-of-2.gguf"]
