"""The bench suite (benchmarks.suite) without a real run: scenario files loaded or refused, the summary of
runs, and `orchestrate bench`'s table and exit status on canned runs whose output differs."""

import json

import pytest

from benchmarks.scenarios import ScenarioError, load_scenario, load_scenarios
from conftest import orchestrate

# the modes of a quick bench, as in tests/ray/test_bench.py
MODES = ["whole", "whole-lookup", "pipeline", "spec-sync-ngram", "spec-async-ngram", "spec-sync-ngram-tree",
         "spec-async-ngram-tree", "spec-sync-ngram-tree-all"]


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


def test_shipped_scenarios_load_and_quick_keeps_a_small_subset():
    every = load_scenarios()
    quick = load_scenarios(quick=True)
    assert {scenario.name for scenario in every} >= {"chat", "rewrite", "three-stages"}
    assert {scenario.name for scenario in quick} == {"chat", "rewrite"}
    assert all(scenario.repetitions == 1 and len(scenario.prompts) == 1 for scenario in quick)


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
    assert pipeline["rejections_corrected"] is None


def test_the_summary_gives_the_share_of_rejections_a_correction_covered():
    from benchmarks.suite import Run, summarise
    from orchestrator.decoding.stats import SpeculationStats

    scenario = load_scenarios(quick=True)[0]
    runs = [Run("whole", 0, 0, [1, 2, 3], 4.0, 0.01, 1.0),
            Run("pipeline", 0, 0, [1, 2, 3], 2.0, 0.01, 1.0, passes=3, stage_seconds=[0.25, 0.5])]
    runs += [Run(mode, 0, 0, [1, 2, 3], 3.0, 0.01, 1.0, passes=2, stage_seconds=[0.25, 0.5],
                 speculation=SpeculationStats(rejected_passes=rejected, corrected_windows=corrected))
             for mode, rejected, corrected in (("spec-async-model", 4, 1), ("spec-sync-model", 0, 0))]
    rows = summarise(scenario, ["whole", "pipeline", "spec-async-model", "spec-sync-model"], runs, 2, 0.001, {})["modes"]
    assert [row["rejections_corrected"] for row in rows] == [None, None, 0.25, None]  # none rejected: no share


def test_bench_prints_no_and_exits_1_when_a_modes_output_differs(tmp_path, monkeypatch):
    """`orchestrate bench` in this process, its runs replaced by canned ones
    where the pipeline's last token differs: the real summary, table and exit gate."""
    import contextlib

    from click.testing import CliRunner

    from benchmarks import suite
    from orchestrator import cli
    from orchestrator.cluster import connect as cluster

    def canned_scenario(scenario, workdir, progress=None, cost_curve=None):
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
