"""`orchestrate bench --quick`: the three files, every mode, identical outputs, sane figures."""

import json

import pytest

from benchmarks.suite import ScenarioError, load_scenario, load_scenarios
from conftest import orchestrate

MODES = ["whole", "whole-lookup", "pipeline", "spec-sync-ngram", "spec-async-ngram"]


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench"
    result = orchestrate("bench", "--quick", "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.ray
def test_quick_bench_writes_results_table_and_chart(quick_bench):
    out = quick_bench
    results = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    chart = (out / "chart.png").read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and len(chart) > 10_000
    assert [scenario["scenario"] for scenario in results["scenarios"]] == ["chat", "rewrite"]
    for scenario in results["scenarios"]:
        assert [row["mode"] for row in scenario["modes"]] == MODES
        assert 0 < scenario["hop_microseconds"] < 100_000
        assert all(rss and rss > 10 for rss in scenario["peak_rss_mb"].values())
        for row in scenario["modes"]:
            assert row["identical"] is True, row["mode"]
            rate = row["tokens_per_second"]
            assert 0 < rate["min"] <= rate["median"] <= rate["max"]
            assert row["time_to_first_token_ms"] > 0 and row["ratio_to_pipeline"] > 0 and row["ratio_to_whole"] > 0
            if row["mode"].startswith("spec-") or row["mode"] == "pipeline":
                assert 0 < row["target_passes_per_token"] <= 1.05
                assert all(0 < fraction < 1 for fraction in row["stage_busy_fraction"])
            if row["mode"].startswith("spec-"):
                assert 0 <= row["acceptance_rate"] <= 1 and 0 <= row["drafter_busy_fraction"] < 1
        assert f"## {scenario['scenario']}" in table
        assert scenario["stage_starts"] == [0, 15]
        (trace,) = scenario["draft_traces"]["ngram"]  # one quick prompt
        assert set(trace) <= set("Rw.") and trace[0] == "."
        assert len(trace) == round(next(row for row in scenario["modes"] if row["mode"] == "whole")["mean_tokens"])
    assert table.count("| yes |") == 2 * len(MODES)
    assert not list(out.glob("*.partial*"))


@pytest.mark.pure
def test_bad_scenarios_are_refused(tmp_path):
    (tmp_path / "a.toml").write_text('name = "a"\nprompts = ["hi"]\nspeculators = ["oracle"]\n')
    with pytest.raises(ScenarioError, match="unknown speculator 'oracle'"):
        load_scenario(tmp_path / "a.toml")
    (tmp_path / "a.toml").write_text('name = "a"\nprompt = ["hi"]\n')
    with pytest.raises(ScenarioError, match="unknown key 'prompt'"):
        load_scenario(tmp_path / "a.toml")
    (tmp_path / "a.toml").write_text('name = "a"\nprompts = [\n')
    result = orchestrate("bench", "--quick", "--out", tmp_path / "out", "--scenarios", tmp_path)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.pure
def test_shipped_scenarios_load_and_quick_keeps_a_small_subset():
    every = load_scenarios()
    quick = load_scenarios(quick=True)
    assert {scenario.name for scenario in every} >= {"chat", "rewrite", "three-stages"}
    assert {scenario.name for scenario in quick} == {"chat", "rewrite"}
    assert all(scenario.repetitions == 1 and len(scenario.prompts) == 1 for scenario in quick)


@pytest.mark.ray
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


@pytest.mark.ray
def test_quick_serve_bench_compares_the_servers_under_load(tmp_path):
    """`orchestrate bench --serve --quick`: every server at concurrency 1 and 2,
    outputs equal to each server's solo run and to llama-cpp-python's server."""
    out = tmp_path / "serve-bench"
    result = orchestrate("bench", "--serve", "--quick", "--out", out, timeout=900)
    assert result.returncode == 0, result.stderr
    results = json.loads((out / "serve.json").read_text())
    servers = ["specpipe-2-stages-no-http", "specpipe-2-stages", "specpipe-whole", "llama-cpp-server"]
    assert results["servers"] == servers
    assert [(row["server"], row["concurrency"]) for row in results["rows"]] == [
        (server, level) for server in servers for level in (1, 2)]
    for row in results["rows"]:
        assert row["errors"] == 0 and row["matches_solo"] and row["matches_llama_cpp_server"], row
        rate = row["tokens_per_second"]
        assert 0 < rate["min"] <= rate["median"] <= rate["max"]
        assert row["ttft_p50"]["median"] > 0 and row["itl_p50"]["median"] > 0
    table = (out / "serve.md").read_text()
    assert table.count("| specpipe-2-stages |") == 2 and "× llama-cpp-server" in table
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(path.name for path in out.iterdir()) == ["serve.json", "serve.md", "serve.png"]
