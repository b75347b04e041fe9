"""`orchestrate bench --quick`: the three files, every mode, identical outputs, sane figures (the suite on
canned runs: tests/pure/test_bench_suite.py)."""

import json

import pytest

from conftest import orchestrate

MODES = ["whole", "whole-lookup", "pipeline", "spec-sync-ngram", "spec-async-ngram", "spec-sync-ngram-tree",
         "spec-async-ngram-tree", "spec-sync-ngram-tree-all"]


def _with_peers(modes: list[str]) -> list[str]:
    """The modes a bench runs here: llama.cpp's own tools join where `make peers` built them."""
    from benchmarks.peers import built

    return modes + (["cpp-whole", "cpp-rpc-split", "cpp-lookup"] if built() else [])


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory, orchestrate_on_cluster):
    out = tmp_path_factory.mktemp("bench") / "bench"
    result = orchestrate_on_cluster("bench", "--quick", "--out", out)
    assert result.returncode == 0, result.stderr
    return out


def test_quick_bench_writes_results_table_and_chart(quick_bench):
    out = quick_bench
    results = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    chart = (out / "chart.png").read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and len(chart) > 10_000
    timeline = (out / "timeline.png").read_bytes()  # where the time went, machine by machine
    assert timeline[:8] == b"\x89PNG\r\n\x1a\n" and len(timeline) > 10_000
    assert [scenario["scenario"] for scenario in results["scenarios"]] == ["chat", "rewrite"]
    for scenario in results["scenarios"]:
        assert [row["mode"] for row in scenario["modes"]] == _with_peers(MODES)
        assert scenario["hop_microseconds"] > 0  # measured (how fast is a benchmark's business, not a test's)
        assert all(rss and rss > 10 for rss in scenario["peak_rss_mb"].values())
        for row in scenario["modes"]:
            # the whole row is the reference the others are compared with (its own "identical" cannot fail)
            assert row["mode"] == "whole" or row["identical"] is True, row["mode"]
            rate = row["tokens_per_second"]
            assert row["runs"] == 1 and rate["min"] == rate["median"] == rate["max"] > 0  # one run each (--quick)
            assert row["time_to_first_token_ms"] > 0 and row["ratio_to_pipeline"] > 0 and row["ratio_to_whole"] > 0
            if row["mode"].startswith("spec-") or row["mode"] == "pipeline":
                assert 0 < row["target_passes_per_token"] <= 1.05
                assert len(row["stage_busy_fraction"]) == 2 and all(fraction > 0 for fraction in row["stage_busy_fraction"])
                assert len(row["stage_discarded_share"]) == 2 and all(0 <= share < 1 for share in row["stage_discarded_share"])
                passes = row["timeline"]["passes"]  # every pass of the first run, on both stages, in time
                assert {stage for stage, _, _, _ in passes} == {0, 1}
                assert all(0 <= begun <= row["timeline"]["seconds"] and seconds > 0 for _, begun, seconds, _ in passes)
            if row["mode"].startswith("spec-"):
                assert row["drafter_busy_fraction"] >= 0
                if scenario["scenario"] == "rewrite":  # the input-grounded prompts: drafts are taken, mostly right
                    assert 0.5 < row["acceptance_rate"] <= 1
                else:  # chat: the draft policy may choose to draft nothing (then there is no rate)
                    assert row["acceptance_rate"] is None or 0 <= row["acceptance_rate"] <= 1
        assert f"## {scenario['scenario']}" in table
        assert scenario["stage_starts"] == [0, 15]
        (trace,) = scenario["draft_traces"]["ngram"]  # one quick prompt
        proposals, forks = trace.split("|")  # what prompt lookup proposes, and its other candidates
        assert set(proposals) <= set("Rw.") and proposals[0] == "." and len(forks) == len(proposals)
        assert len(proposals) == round(next(row for row in scenario["modes"] if row["mode"] == "whole")["mean_tokens"])
    assert table.count("| yes |") == 2 * len(_with_peers(MODES))
    assert not list(out.glob("*.partial*"))


def test_plan_predicts_every_mode_of_the_bench_beside_its_measurement(quick_bench, profile_path):
    result = orchestrate("plan", "--profile", profile_path, "--bench", quick_bench / "results.json", "--json")
    assert result.returncode == 0, result.stderr
    predictions = json.loads(result.stdout)
    assert [(row["scenario"], row["mode"]) for row in predictions] == [
        (scenario, mode) for scenario in ("chat", "rewrite") for mode in MODES if mode != "whole-lookup"
    ]
    for row in predictions:
        assert row["measured"] > 0 and row["from_rates"] > 0
        assert (row["from_trace"] is not None) == row["mode"].startswith("spec-")
        assert (row["behaviour"] is not None) == row["mode"].startswith("spec-")
