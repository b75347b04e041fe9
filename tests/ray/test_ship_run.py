"""`orchestrate run --model WHOLE.gguf`: the stages cut on the driver and
shipped into the node's stage cache (a local Ray: the one node is every
stage's), the tokens the whole model's; a second run ships nothing of a
stage already there and resumes a transfer left half done, not started
again (the stage image it streams: tests/model/test_ship_run_stage_image.py)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import PROMPTS, orchestrate

MAX_TOKENS = 16


def shipped_run(smollm2, cache: Path, *options: str) -> dict:
    result = orchestrate("run", "--model", smollm2, "--raw", "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS),
                         "--json", *options, env={"SPECPIPE_STAGE_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    report["stderr"] = result.stderr
    return report


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

    # then a run after stage 1's transfer was interrupted: what it leaves is the first part of its file,
    # as .partial. Stage 0 is shipped nothing (its file is there), stage 1 resumed where it stopped.
    stage_file = Path(shipped[1]["path"])
    kept = 20_000_001
    partial = stage_file.with_name(stage_file.name + ".partial")
    partial.write_bytes(stage_file.read_bytes()[:kept])
    stage_file.unlink()
    resumed = shipped_run(smollm2, cache, "--boundaries", "15")  # the same split, asked for by its boundary
    assert resumed["tokens"] == expected
    assert [(item["resumed_from"], item["bytes_sent"]) for item in resumed["shipped"]] == \
        [(shipped[0]["bytes"], 0), (kept, shipped[1]["bytes"] - kept)]
    assert stage_file.read_bytes() == Path(splits[2][1]).read_bytes() and not partial.exists()


def test_other_boundaries_are_another_file_and_the_split_is_the_users(smollm2, splits, reference, tmp_path):
    report = shipped_run(smollm2, tmp_path, "--boundaries", "10,20")
    assert [stage["layers"] for stage in report["stages"]] == [[0, 10], [10, 20], [20, 30]]
    assert report["tokens"] == reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
    assert "split: of the splits" not in report["stderr"]
    for item, split_file in zip(report["shipped"], splits[3]):
        assert Path(item["path"]).read_bytes() == Path(split_file).read_bytes()


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
