"""Predict every mode of an ``orchestrate bench`` scenario from a profile, to
set beside what the bench measured (``orchestrate plan --profile P --bench
results.json``; ``benchmarks.calibrate`` tabulates it).

For a scenario of a bench results.json:

* pipeline: the plain schedule on the scenario's split (priced from the
  profile's per-block, head and fixed times, so a split other than the
  profiled one is a real prediction), every stage on the profiled machine, at
  most (cores / threads per stage) of them computing at once;
* spec-sync-KIND, spec-async-KIND: the speculative schedules at the bench's
  --draft-max, with the profile's time per draft token, predicted twice:
  from the workload's four rates as the bench measured them in its
  spec-sync-KIND mode (where every pass drafts afresh), and, where the bench
  wrote one, from the workload's trace (the whole model's output with the
  drafter replayed over it: ``simulation.DraftTrace``);
  the draft policy prices a wider pass at the batch cost the bench measured
  for that schedule (``draft_step``; from the profile's costs for results
  that lack it); the -tree modes with prompt lookup's token trees, from the
  trace's forks (a trace without them predicts a chain), -tree-all with side
  rows priced at 0, as the bench ran it;
* whole: the whole model as one stage, with no hops and no coordinator of
  ours (llama-cpp-python's own loop, in the bench's process);
* whole-lookup is not predicted: it is llama-cpp-python's own speculative
  loop, not this project's schedule.

Nothing here is fitted to the measured tokens/s. Pure Python.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from orchestrator.config import BENCH_TREE_LEAVES, PLAN_CHECK_RUNS
from orchestrator.planning.costs import Software
from orchestrator.planning.curves import under_curve
from orchestrator.planning.inputs import PlanError
from orchestrator.planning.loaders import setup_from_profile
from orchestrator.planning.simulation import DraftBehaviour, DraftTrace, Mode, predict
from speculators.draft_length import DraftPrices, ask_cost
from stages.cost_curve import CostCurve

IN_PROCESS = Software(hop_seconds=0.0, coordinator_pass_seconds=0.0, coordinator_row_seconds=0.0,
                      local_bytes_per_second=math.inf)


@dataclass(frozen=True)
class ModePrediction:
    """One bench mode: measured median tokens/s (and its range) beside the
    predictions from rates and, for speculation with a trace, from the trace."""

    scenario: str
    mode: str
    measured: float
    measured_min: float
    measured_max: float
    from_rates: float
    from_trace: float | None
    behaviour: DraftBehaviour | None

    def error(self, predicted: float) -> float:
        """A prediction's relative error against the measured median."""
        return predicted / self.measured - 1

    @property
    def best(self) -> float:
        """The most informed prediction: from the trace where there is one."""
        return self.from_trace if self.from_trace is not None else self.from_rates


def parse_mode(mode: str) -> tuple[str, str, str]:
    """A speculative bench mode's (benchmarks.suite) schedule, speculator kind and tree variant ("", "tree", "tree-all");
    a "-top" ending (a draft model's top choices where a sampled scenario's modes draft coupled) is dropped."""
    _, schedule, kind = mode.removesuffix("-top").split("-", 2)
    for tree in ("tree-all", "tree"):
        if kind.endswith(f"-{tree}"):
            return schedule, kind[: -len(tree) - 1], tree
    return schedule, kind, ""


def measured_prices(scenario: dict, kind: str) -> DraftPrices | None:
    """What the bench's run priced a draft token of ``kind`` at (its
    draft_prices); None for results from before it measured them."""
    prices = scenario.get("draft_prices", {}).get(kind)
    return None if prices is None else DraftPrices(prices["awaited"], prices["relayed"])


def measured_behaviour(scenario: dict, kind: str) -> DraftBehaviour | None:
    """The workload's draft statistics for a speculator kind, from its sync mode."""
    for row in scenario["modes"]:
        if row["mode"] == f"spec-sync-{kind}" and row.get("acceptance_later") is not None:
            return DraftBehaviour(row["acceptance_later"], row["draft_availability"], row["acceptance_first"],
                                  row["draft_continuation"])
    return None


def predict_scenario(profile: dict, scenario: dict, runs: int = PLAN_CHECK_RUNS, curve: CostCurve | None = None
                     ) -> list[ModePrediction]:
    """curve: the cost curve the bench held its stages to (--cost-curve), which
    then prices the pipelined modes' stages (and a draft model's step); the
    profile still gives the software's costs, prompt lookup's and the whole model's."""
    if "stage_starts" not in scenario or "draft_max" not in scenario:
        raise PlanError(f"scenario {scenario.get('scenario')}: results from an older bench; run orchestrate bench again")
    starts = tuple(scenario["stage_starts"])
    base = setup_from_profile(profile, behaviour=None, max_tokens=scenario["max_tokens"])
    machine = base.machines[0]
    split = replace(base, machines=[machine] * len(starts), links=[None] * len(starts), starts=starts,
                    draft_seconds=[0.0] * len(starts))
    if curve is not None:
        split = under_curve(split, curve)
    whole = replace(base, machines=[machine], links=[None], starts=(0,), draft_seconds=[0.0], software=IN_PROCESS)
    predictions = []
    for row in scenario["modes"]:
        mode_name, behaviour, traces = row["mode"], None, []
        if mode_name == "whole":
            setup, mode = whole, Mode("plain")
        elif mode_name == "pipeline":
            setup, mode = split, Mode("plain")
        elif mode_name.startswith("spec-"):
            schedule, kind, tree = parse_mode(mode_name)
            if kind == "model" and tree or mode_name.endswith("-top"):
                continue  # the simulation grows no draft-model trees; the top-choice modes' acceptance is not traced
            behaviour = measured_behaviour(scenario, kind)
            drafter_seconds = profile["drafter_seconds_per_token"].get(kind)
            if curve is not None and kind == "model" and drafter_seconds is not None:
                drafter_seconds = max(drafter_seconds, curve.draft_seconds)  # the step is held to the curve's
            if behaviour is None or drafter_seconds is None:
                continue
            setup = replace(split, draft_seconds=[drafter_seconds] * len(starts))
            # the batch cost the run's draft policy measured (older results: from the costs)
            step = scenario.get("draft_step", {}).get(schedule)
            mode = Mode(schedule, scenario["draft_max"], call_cost=ask_cost(kind), step=step,
                        tree_leaves=BENCH_TREE_LEAVES if tree else 1, side_row_step=0.0 if tree == "tree-all" else None,
                        draft_prices=measured_prices(scenario, kind))  # as the run priced drafting
            try:
                traces = [DraftTrace.from_text(text) for text in scenario.get("draft_traces", {}).get(kind, [])]
            except ValueError as error:
                raise PlanError(f"scenario {scenario['scenario']}: {error}") from None
        else:
            continue
        costs = setup.costs(setup.starts)
        # As long as the measured generations were (they may end before max_tokens).
        length = max(2, round(row["mean_tokens"]))
        from_rates = predict(costs, mode, behaviour or DraftBehaviour(0.0), length, runs).tokens_per_second
        from_trace = statistics.median(
            predict(costs, mode, trace, scenario["max_tokens"], runs=1).tokens_per_second for trace in traces
        ) if traces else None
        tokens_per_second = row["tokens_per_second"]
        predictions.append(ModePrediction(
            scenario["scenario"], mode_name, tokens_per_second["median"], tokens_per_second["min"],
            tokens_per_second["max"], from_rates, from_trace, behaviour,
        ))
    return predictions
