"""`orchestrate bench --quick`: the three files, every mode, identical outputs, sane figures."""

import json

import pytest

from benchmarks.suite import ScenarioError, load_scenario, load_scenarios
from conftest import orchestrate

MODES = ["whole", "whole-lookup", "pipeline", "spec-sync-ngram", "spec-async-ngram", "spec-sync-ngram-tree",
         "spec-async-ngram-tree", "spec-sync-ngram-tree-all"]


def _with_peers(modes: list[str]) -> list[str]:
    """The modes a bench runs here: llama.cpp's own tools join where `make peers` built them."""
    from benchmarks.peers import built

    return modes + (["cpp-whole", "cpp-rpc-split", "cpp-lookup"] if built() else [])


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
    from benchmarks.peers import built

    servers = ["specpipe-2-stages-no-http", "specpipe-2-stages", "specpipe-whole", "llama-cpp-server"]
    servers += ["cpp-llama-server"] * built()  # llama.cpp's own server, where make peers built it
    assert results["servers"] == servers
    assert [(row["server"], row["concurrency"]) for row in results["rows"]] == [
        (server, level) for server in servers for level in (1, 2)]
    for row in results["rows"]:
        if row["server"] == "cpp-llama-server":  # a peer: its errors and exactness are reported, not required
            assert row["errors"] == 0 or row["error_examples"], row  # a failed request says why
        else:
            assert row["errors"] == 0 and row["matches_solo"] and row["matches_llama_cpp_server"], row
        rate = row["tokens_per_second"]
        assert rate["min"] > 0 and rate["min"] <= rate["median"] <= rate["max"]
        assert row["ttft_p50"]["median"] > 0 and row["itl_p50"]["median"] > 0
    table = (out / "serve.md").read_text()
    assert table.count("| specpipe-2-stages |") == 2 and "× llama-cpp-server" in table
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(path.name for path in out.iterdir()) == ["serve.json", "serve.md", "serve.png"]


def fake_runs(modes: list[str], differing: str | None) -> list:
    """One run per mode on one prompt: every mode the whole model's tokens, except ``differing``."""
    from benchmarks.suite import Run

    whole = [11, 12, 13, 14]
    runs = []
    for index, mode in enumerate(modes):
        tokens = whole[:-1] + [99] if mode == differing else list(whole)
        pipelined = mode not in ("whole", "whole-lookup")
        runs.append(Run(mode, 0, 0, tokens, 10.0 + index, 0.05, 0.5, passes=4 if pipelined else 0,
                        stage_seconds=[0.1, 0.2] if pipelined else []))
    return runs


@pytest.mark.pure
def test_summary_of_several_runs_takes_median_min_and_max_and_flags_a_differing_one():
    from benchmarks.suite import Run, summarise

    scenario = load_scenarios(quick=True)[0]
    runs = [Run("whole", 0, repetition, [1, 2, 3], rate, 0.01, 1.0) for repetition, rate in enumerate([4.0, 9.0, 5.0])]
    runs += [Run("pipeline", 0, repetition, tokens, rate, 0.01, 1.0, passes=2, stage_seconds=[0.25, 0.5])
             for repetition, (tokens, rate) in enumerate([([1, 2, 3], 2.0), ([1, 2, 4], 8.0), ([1, 2, 3], 3.0)])]
    whole, pipeline = summarise(scenario, ["whole", "pipeline"], runs, 2, 0.001, {})["modes"]
    assert whole["tokens_per_second"] == {"median": 5.0, "min": 4.0, "max": 9.0}
    assert pipeline["tokens_per_second"] == {"median": 3.0, "min": 2.0, "max": 8.0}
    assert pipeline["identical"] is False  # repetition 1 differs from the whole model's repetition 1
    assert pipeline["ratio_to_whole"] == pytest.approx(0.6)  # median of 2/4, 8/9, 3/5
    assert pipeline["stage_busy_fraction"] == [0.25, 0.5]


@pytest.mark.pure
def test_bench_prints_no_and_exits_1_when_a_modes_output_differs(tmp_path, monkeypatch):
    """`orchestrate bench` in this process, its runs replaced by canned ones
    where the pipeline's last token differs: the real summary, table and exit gate."""
    import contextlib

    from click.testing import CliRunner

    from benchmarks import suite
    from orchestrator import cli
    from orchestrator.cluster import connect as cluster

    def canned_scenario(scenario, workdir, progress=None):
        summary = suite.summarise(scenario, MODES, fake_runs(MODES, "pipeline"), 2, 0.001, {"stage-0": 100.0})
        return {**summary, "stage_starts": [0, 15], "draft_max": 8, "draft_traces": {}}

    monkeypatch.setattr(suite, "run_scenario", canned_scenario)
    monkeypatch.setattr(cluster, "ray_session", lambda address, **options: contextlib.nullcontext(None))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.main, ["bench", "--quick", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == "error: output differs from the whole model in chat/pipeline, rewrite/pipeline"
    table = (out / "results.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ") and " | " in line}
    assert rows["pipeline"].endswith('| <span style="color:red">**NO**</span> |')
    assert table.count("**NO**") == 2 and table.count("| yes |") == 2 * (len(MODES) - 1)
    results = json.loads((out / "results.json").read_text())
    assert [[row["mode"] for row in scenario["modes"] if not row["identical"]] for scenario in results["scenarios"]] \
        == [["pipeline"], ["pipeline"]]
