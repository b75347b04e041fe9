"""Bench scenarios predicted in-process from a profile (orchestrator.planning.against_bench).

`orchestrate plan --profile P --bench results.json` sets each measured mode
beside its predictions. Here the committed profile and bench results
(benchmarks/results/) and small hand-made scenarios are predicted, and each
prediction is compared with one built independently: the stage costs put
together here from the profile's numbers (costs.StageCosts, not
setup_from_profile), the simulation run with the mode, draft rates, length
and drafter costs the module's docstring states.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest

from orchestrator.planning.against_bench import (IN_PROCESS, PLAN_CHECK_RUNS, ModePrediction, measured_behaviour,
                                                 predict_scenario)
from orchestrator.planning.costs import BatchCurve, MeasuredMachine, ModelShape, Software, StageCosts
from orchestrator.planning.inputs import PlanError
from orchestrator.planning.simulation import DraftBehaviour, DraftTrace, Mode, predict
from speculators.draft_length import DRAFTER_CALL_COST, DraftPrices

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def profile() -> dict:
    return json.loads((RESULTS / "profile.json").read_text())


def scenarios() -> dict[str, dict]:
    return {scenario["scenario"]: scenario for scenario in json.loads((RESULTS / "results.json").read_text())["scenarios"]}


def machine_of(profile: dict) -> MeasuredMachine:
    sizes = tuple(profile["batch_sizes"])
    return MeasuredMachine(profile["machine"]["host"], profile["machine"]["memory_bytes"],
                           BatchCurve(sizes, tuple(profile["block_seconds"])),
                           BatchCurve(sizes, tuple(profile["head_seconds"])),
                           BatchCurve(sizes, tuple(profile["fixed_seconds"])))


def costs_of(profile: dict, starts: tuple[int, ...], draft_seconds: float = 0.0, whole: bool = False) -> StageCosts:
    """The profiled machine running ``starts``, at most cores / threads stages at once."""
    shape = profile["model_shape"]
    model = ModelShape(**{**shape, "block_bytes": tuple(shape["block_bytes"])})
    software = Software(0.0, 0.0, 0.0, math.inf) if whole else Software(
        profile["hop_seconds"], profile["coordinator_pass_seconds"], profile["coordinator_row_seconds"],
        profile["socket_bytes_per_second"], profile["drafter_call_seconds"])
    parallel = max(1, profile["machine"]["cpus"] // profile["machine"]["threads_per_stage"])
    return StageCosts(model, [machine_of(profile)] * len(starts), starts, [None] * len(starts), software,
                      (draft_seconds,) * len(starts), hosts=(0,) * len(starts), host_parallel_stages=parallel)


def rates_of(row: dict) -> DraftBehaviour:
    return DraftBehaviour(row["acceptance_later"], row["draft_availability"], row["acceptance_first"],
                          row["draft_continuation"])


def expected(profile: dict, scenario: dict, runs: int) -> list[tuple[str, float, float | None]]:
    """(mode, from rates, from trace) for each predicted mode, worked out here."""
    starts = tuple(scenario["stage_starts"])
    sync_rows = {row["mode"].split("-", 2)[2]: row for row in scenario["modes"]
                 if row["mode"].startswith("spec-sync-") and row.get("acceptance_later") is not None}
    out = []
    for row in scenario["modes"]:
        length = max(2, round(row["mean_tokens"]))
        name = row["mode"]
        if name in ("whole", "pipeline"):
            costs = costs_of(profile, (0,), whole=True) if name == "whole" else costs_of(profile, starts)
            out.append((name, predict(costs, Mode("plain"), DraftBehaviour(0.0), length, runs).tokens_per_second, None))
        elif name.startswith("spec-"):
            _, schedule, kind = name.split("-", 2)
            tree = ""
            for variant in ("-tree-all", "-tree"):  # prompt lookup's trees: every side row, or the rule's
                if kind.endswith(variant):
                    kind, tree = kind[: -len(variant)], variant
                    break
            seconds = profile["drafter_seconds_per_token"].get(kind)
            if kind not in sync_rows or seconds is None:
                continue
            costs = costs_of(profile, starts, seconds)
            mode = Mode(schedule, scenario["draft_max"], call_cost=0.0 if kind == "ngram" else DRAFTER_CALL_COST,
                        step=scenario.get("draft_step", {}).get(schedule), tree_leaves=4 if tree else 1,
                        side_row_step=0.0 if tree == "-tree-all" else None)
            traces = [DraftTrace.from_text(text) for text in scenario.get("draft_traces", {}).get(kind, [])]
            from_trace = statistics.median(predict(costs, mode, trace, scenario["max_tokens"], runs=1).tokens_per_second
                                           for trace in traces) if traces else None
            out.append((name, predict(costs, mode, rates_of(sync_rows[kind]), length, runs).tokens_per_second,
                        from_trace))
    return out


def row(mode: str, median: float, *, mean_tokens: float = 24.0, rates: tuple | None = None) -> dict:
    later, availability, first, continuation = rates or (None, None, None, None)
    return {"mode": mode, "mean_tokens": mean_tokens, "tokens_per_second": {"median": median, "min": median - 1,
                                                                            "max": median + 2},
            "acceptance_later": later, "draft_availability": availability, "acceptance_first": first,
            "draft_continuation": continuation}


# --- ModePrediction -----------------------------------------------------------------------------------------

def prediction(from_trace: float | None) -> ModePrediction:
    return ModePrediction("s", "m", measured=50.0, measured_min=40.0, measured_max=60.0, from_rates=45.0,
                          from_trace=from_trace, behaviour=None)


def test_a_predictions_error_is_relative_to_the_measured_median():
    assert prediction(None).error(60.0) == pytest.approx(0.2)
    assert prediction(None).error(40.0) == pytest.approx(-0.2)
    assert prediction(None).error(50.0) == 0.0


def test_the_best_prediction_is_the_traces_where_there_is_one_even_zero():
    assert prediction(55.0).best == 55.0
    assert prediction(0.0).best == 0.0
    assert prediction(None).best == 45.0


# --- measured_behaviour -------------------------------------------------------------------------------------

def test_measured_behaviour_reads_the_four_rates_from_the_kinds_sync_row():
    scenario = {"modes": [
        row("pipeline", 10.0),
        row("spec-async-ngram", 9.0, rates=(0.9, 0.8, 0.7, 0.6)),  # async rows are not the workload's rates
        row("spec-sync-draft", 9.0, rates=(0.95, 1.0, 0.85, 0.75)),
        row("spec-sync-ngram", 9.0, rates=(0.5, 0.25, 0.125, 0.375)),
    ]}
    assert measured_behaviour(scenario, "ngram") == DraftBehaviour(acceptance=0.5, availability=0.25,
                                                                   first_acceptance=0.125, continuation=0.375)
    assert measured_behaviour(scenario, "draft") == DraftBehaviour(0.95, 1.0, 0.85, 0.75)


def test_measured_behaviour_skips_sync_rows_without_rates_and_is_none_when_there_are_none():
    without = {"mode": "spec-sync-ngram", "mean_tokens": 1.0, "tokens_per_second": {}}
    scenario = {"modes": [row("spec-sync-ngram", 9.0), without, row("spec-sync-ngram", 8.0, rates=(0.5, 0.5, 0.5, 0.5))]}
    assert measured_behaviour(scenario, "ngram") == DraftBehaviour(0.5, 0.5, 0.5, 0.5)
    assert measured_behaviour({"modes": [row("spec-sync-ngram", 9.0), without]}, "ngram") is None
    assert measured_behaviour(scenario, "draft") is None
    assert measured_behaviour({"modes": []}, "ngram") is None


def test_measured_behaviour_of_the_committed_chat_scenario():
    sync = next(row for row in scenarios()["chat"]["modes"] if row["mode"] == "spec-sync-ngram")
    assert measured_behaviour(scenarios()["chat"], "ngram") == rates_of(sync)


# --- predict_scenario on the committed results --------------------------------------------------------------

@pytest.mark.parametrize("name", ["chat", "rewrite", "three-stages"])
def test_each_committed_scenario_is_predicted_as_worked_out_independently(name):
    scenario = scenarios()[name]
    predicted = predict_scenario(profile(), scenario, runs=3)
    assert [(one.mode, one.from_rates, one.from_trace) for one in predicted] == expected(profile(), scenario, 3)
    # whole-lookup is llama-cpp-python's own loop, the cpp- modes llama.cpp's tools: not predicted
    assert [one.mode for one in predicted] == ["whole", "pipeline", "spec-sync-ngram", "spec-async-ngram",
                                               "spec-sync-ngram-tree", "spec-async-ngram-tree",
                                               "spec-sync-ngram-tree-all"]
    rows = {row["mode"]: row for row in scenario["modes"]}
    sync = rates_of(rows["spec-sync-ngram"])
    for one in predicted:
        assert one.scenario == name
        measured = rows[one.mode]["tokens_per_second"]
        assert (one.measured, one.measured_min, one.measured_max) == (measured["median"], measured["min"],
                                                                      measured["max"])
        assert one.behaviour == (sync if one.mode.startswith("spec-") else None)
        assert (one.from_trace is not None) == one.mode.startswith("spec-")


def test_predict_scenario_runs_64_simulations_by_default():
    assert PLAN_CHECK_RUNS == 64
    scenario = {**scenarios()["chat"]}
    scenario["modes"] = [row for row in scenario["modes"] if row["mode"] == "spec-sync-ngram"]
    [default] = predict_scenario(profile(), scenario)
    [(_, from_rates, _)] = expected(profile(), scenario, 64)
    assert default.from_rates == from_rates
    assert from_rates != expected(profile(), scenario, 63)[0][1]  # the run count shows in the median


def test_the_whole_model_runs_in_process_with_no_hops_or_coordinator_costs():
    assert IN_PROCESS == Software(hop_seconds=0.0, coordinator_pass_seconds=0.0, coordinator_row_seconds=0.0,
                                  local_bytes_per_second=math.inf, draft_call_seconds=0.0)
    scenario = {**scenarios()["chat"], "modes": [row("whole", 70.0, mean_tokens=32.0)]}
    [whole] = predict_scenario(profile(), scenario, runs=2)
    in_process = predict(costs_of(profile(), (0,), whole=True), Mode("plain"), DraftBehaviour(0.0), 32, 2)
    with_hops = predict(costs_of(profile(), (0,)), Mode("plain"), DraftBehaviour(0.0), 32, 2)
    assert whole.from_rates == in_process.tokens_per_second > with_hops.tokens_per_second


# --- predict_scenario on hand-made scenarios ----------------------------------------------------------------

def test_a_draft_model_kind_with_a_hyphen_is_priced_with_its_timing_and_the_actor_call_cost():
    measured = profile()
    measured["drafter_seconds_per_token"]["small-draft"] = 0.004
    scenario = {"scenario": "made", "max_tokens": 40, "stage_starts": [0, 10, 20], "draft_max": 4,
                "draft_traces": {"small-draft": ["..RRRw.RRRRRRRR", "RRRRRRRRRRRRRRRRRRRR"]},
                "modes": [row("spec-sync-small-draft", 20.0, mean_tokens=33.4, rates=(0.9, 1.0, 0.8, 1.0)),
                          row("spec-async-small-draft", 22.0, mean_tokens=30.6, rates=(0.1, 0.1, 0.1, 0.1))]}
    predicted = predict_scenario(measured, scenario, runs=3)
    assert [(one.mode, one.from_rates, one.from_trace) for one in predicted] == expected(measured, scenario, 3)
    assert [one.behaviour for one in predicted] == [DraftBehaviour(0.9, 1.0, 0.8, 1.0)] * 2  # both from the sync row
    # the actor's call cost and the draft's wait change the draft policy's choices: pricing neither predicts otherwise
    costs = costs_of(measured, (0, 10, 20), 0.004)
    free_calls = predict(costs, Mode("sync", 4, call_cost=0.0, draft_prices=DraftPrices()), DraftBehaviour(0.9, 1.0, 0.8, 1.0),
                         33, 3)
    assert predicted[0].from_rates != free_calls.tokens_per_second


@pytest.mark.parametrize("traces", [None, {}, {"draft": ["RRRR"]}])
def test_prompt_lookup_is_asked_in_the_coordinator_at_no_call_cost(traces):
    scenario = {**scenarios()["chat"], "draft_traces": traces}
    if traces is None:
        del scenario["draft_traces"]
    scenario["modes"] = [row for row in scenario["modes"] if row["mode"] == "spec-sync-ngram"]
    [sync] = predict_scenario(profile(), scenario, runs=3)
    costs = costs_of(profile(), (0, 15), profile()["drafter_seconds_per_token"]["ngram"])
    behaviour = rates_of(scenario["modes"][0])
    step = scenario["draft_step"]["sync"]  # the batch cost the bench measured
    assert sync.from_rates == predict(costs, Mode("sync", 8, call_cost=0.0, step=step), behaviour, 64,
                                      3).tokens_per_second
    assert sync.from_rates != predict(costs, Mode("sync", 8, step=step), behaviour, 64, 3).tokens_per_second
    assert sync.from_trace is None  # no traces of prompt lookup


def test_a_generation_shorter_than_two_tokens_is_simulated_as_two():
    scenario = {"scenario": "short", "max_tokens": 16, "stage_starts": [0, 15], "draft_max": 2,
                "modes": [row("pipeline", 5.0, mean_tokens=1.2), row("pipeline", 6.0, mean_tokens=10.5),
                          row("pipeline", 7.0, mean_tokens=11.5)]}
    predicted = predict_scenario(profile(), scenario, runs=2)
    assert [(one.mode, one.from_rates, one.from_trace) for one in predicted] == expected(profile(), scenario, 2)
    costs = costs_of(profile(), (0, 15))
    two = predict(costs, Mode("plain"), DraftBehaviour(0.0), 2, 2).tokens_per_second
    assert predicted[0].from_rates == two
    assert predicted[0].from_rates != predict(costs, Mode("plain"), DraftBehaviour(0.0), 3, 2).tokens_per_second
    # round half to even: 10.5 is 10 tokens, 11.5 is 12
    assert predicted[1].from_rates == predict(costs, Mode("plain"), DraftBehaviour(0.0), 10, 2).tokens_per_second
    assert predicted[2].from_rates == predict(costs, Mode("plain"), DraftBehaviour(0.0), 12, 2).tokens_per_second


def test_speculative_modes_without_rates_or_drafter_timing_are_left_out():
    scenario = {"scenario": "gaps", "max_tokens": 16, "stage_starts": [0, 15], "draft_max": 2,
                "modes": [row("spec-sync-ngram", 5.0), row("spec-async-ngram", 5.0),  # no rates measured
                          row("spec-sync-draft", 5.0, rates=(0.5, 1.0, 0.5, 1.0)),  # no draft timing profiled
                          row("spec-async-draft", 5.0),
                          row("whole-lookup", 5.0), row("something-else", 5.0),
                          row("pipeline", 9.0, mean_tokens=8.0)]}
    assert [one.mode for one in predict_scenario(profile(), scenario, runs=2)] == ["pipeline"]


def test_a_scenario_with_no_predictable_modes_gives_no_predictions():
    scenario = {"scenario": "none", "max_tokens": 16, "stage_starts": [0, 15], "draft_max": 2,
                "modes": [row("whole-lookup", 5.0)]}
    assert predict_scenario(profile(), scenario, runs=2) == []


def test_the_split_is_the_benchs_not_the_profiles():
    scenario = {"scenario": "split", "max_tokens": 16, "stage_starts": [0, 5, 12, 25], "draft_max": 2,
                "modes": [row("pipeline", 9.0, mean_tokens=16.0)]}
    [pipeline] = predict_scenario(profile(), scenario, runs=2)
    assert pipeline.from_rates == predict(costs_of(profile(), (0, 5, 12, 25)), Mode("plain"), DraftBehaviour(0.0), 16,
                                          2).tokens_per_second
    assert pipeline.from_rates != predict(costs_of(profile(), (0, 15)), Mode("plain"), DraftBehaviour(0.0), 16,
                                          2).tokens_per_second


def test_predict_scenario_changes_neither_the_profile_nor_the_scenario():
    measured, scenario = profile(), scenarios()["chat"]
    before = copy.deepcopy((measured, scenario))
    predict_scenario(measured, scenario, runs=1)
    assert (measured, scenario) == before


# --- predict_scenario: errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["stage_starts", "draft_max"])
def test_results_from_an_older_bench_get_one_line_naming_the_scenario(missing):
    scenario = {**scenarios()["chat"]}
    del scenario[missing]
    with pytest.raises(PlanError) as caught:
        predict_scenario(profile(), scenario, runs=1)
    assert str(caught.value) == "scenario chat: results from an older bench; run orchestrate bench again"


def test_an_unnamed_older_scenario_says_none():
    with pytest.raises(PlanError) as caught:
        predict_scenario(profile(), {"modes": []}, runs=1)
    assert str(caught.value) == "scenario None: results from an older bench; run orchestrate bench again"


def test_a_bad_draft_trace_gets_one_line_naming_the_scenario_and_the_symbol():
    scenario = {**scenarios()["chat"], "draft_traces": {"ngram": ["RR..", "R.x?"]}}
    with pytest.raises(PlanError) as caught:
        predict_scenario(profile(), scenario, runs=1)
    assert str(caught.value) == "scenario chat: a draft trace holds only R, w and . (found '?')"


def test_a_malformed_profile_gets_the_planners_one_line():
    measured = profile()
    del measured["model_shape"]
    with pytest.raises(PlanError) as caught:
        predict_scenario(measured, scenarios()["chat"], runs=1)
    assert str(caught.value) == "a malformed profile (KeyError: 'model_shape'); run `orchestrate profile` again"


def test_the_draft_policy_is_priced_at_the_batch_cost_the_bench_measured():
    scenario = {**scenarios()["chat"]}
    scenario["modes"] = [row for row in scenario["modes"] if row["mode"] == "spec-sync-ngram"]
    costs = costs_of(profile(), (0, 15), profile()["drafter_seconds_per_token"]["ngram"])
    behaviour = rates_of(scenario["modes"][0])
    for step in (0.05, 1.5):
        [sync] = predict_scenario(profile(), {**scenario, "draft_step": {"sync": step, "async": 0.0}}, runs=3)
        assert sync.from_rates == predict(costs, Mode("sync", 8, call_cost=0.0, step=step), behaviour, 64,
                                          3).tokens_per_second
    [older] = predict_scenario(profile(), {key: value for key, value in scenario.items() if key != "draft_step"},
                               runs=3)
    assert older.from_rates == predict(costs, Mode("sync", 8, call_cost=0.0), behaviour, 64, 3).tokens_per_second


def test_bench_mode_names_are_read_with_their_tree_variant():
    from orchestrator.planning.against_bench import parse_mode

    assert parse_mode("spec-sync-ngram") == ("sync", "ngram", "")
    assert parse_mode("spec-async-ngram-tree") == ("async", "ngram", "tree")
    assert parse_mode("spec-sync-ngram-tree-all") == ("sync", "ngram", "tree-all")
    assert parse_mode("spec-sync-small-draft") == ("sync", "small-draft", "")


def test_tree_modes_are_predicted_from_the_traces_forks():
    """A -tree mode is simulated with trees (a trace's forks), -tree-all with side rows priced at 0."""
    measured = profile()
    proposals = ".RRRwRRRRwRRRRRRRRRRRRRRRRRRRRRRRR"
    traces = [proposals + "|" + "".join("a" if symbol == "w" else "0" for symbol in proposals)]
    scenario = {"scenario": "made", "max_tokens": 40, "stage_starts": [0, 15], "draft_max": 6,
                "draft_step": {"sync": 0.4, "async": 0.4}, "draft_traces": {"ngram": traces},
                "modes": [row("spec-sync-ngram", 20.0, mean_tokens=33.0, rates=(0.9, 1.0, 0.8, 1.0)),
                          row("spec-sync-ngram-tree-all", 22.0, mean_tokens=33.0, rates=(0.9, 1.0, 0.8, 1.0))]}
    chain, tree = predict_scenario(measured, scenario, runs=1)
    costs = costs_of(measured, (0, 15), measured["drafter_seconds_per_token"]["ngram"])
    trace = DraftTrace.from_text(traces[0])
    assert tree.from_trace == predict(costs, Mode("sync", 6, call_cost=0.0, step=0.4, tree_leaves=4, side_row_step=0.0),
                                      trace, 40, runs=1).tokens_per_second
    assert tree.from_trace != predict(costs, Mode("sync", 6, call_cost=0.0, step=0.4), trace, 40,
                                      runs=1).tokens_per_second
    assert chain.from_trace == predict(costs, Mode("sync", 6, call_cost=0.0, step=0.4), trace, 40,
                                       runs=1).tokens_per_second
