"""Prediction against measurement: ``orchestrate plan``'s simulation, fed with
``orchestrate profile`` output, next to ``orchestrate bench``'s medians.

For each scenario and mode of a bench results.json:

* pipeline: the plain schedule on the scenario's split (priced from the
  profile's per-block, head and fixed times, so a split other than the
  profiled one is a real prediction);
* spec-sync-KIND, spec-async-KIND: the speculative schedules at the bench's
  --draft-max 8, with the workload's draft statistics measured by the same
  bench run in its spec-sync-KIND mode (acceptance of the first and of later
  draft tokens, the drafter's availability and continuation), and the
  profile's time per draft token;
* every stage on this one machine, at most (cores / threads per stage) of
  them computing at once;
* whole: the whole model as one stage, with no hops and no coordinator of ours
  (llama-cpp-python's own loop);
* whole-lookup is not predicted: it is llama-cpp-python's own speculative
  loop, not this project's schedule.

Two predictions per speculative mode: from the rates above (what ``orchestrate
plan --acceptance ...`` takes), and from the workload's trace: the whole
model's output for each prompt, with prompt lookup replayed over it, so the
simulation drafts exactly what the real drafter drafted and ends where the
text ended (``simulation.DraftTrace``). Nothing here is fitted to the bench's
tokens/s.

    python -m benchmarks.calibrate --profile PROFILE.json --bench results.json [--out calibration.md]
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import click

from orchestrator.planning.costs import Software
from orchestrator.planning.simulation import DraftBehaviour, DraftTrace, Mode, predict
from orchestrator.planning.setup_file import read_profile, setup_from_profile

BENCH_DRAFT_MAX = 8
RUNS = 64
# bench's whole mode: llama-cpp-python in the benchmark's own process, no hops, no coordinator of ours
IN_PROCESS = Software(hop_seconds=0.0, coordinator_pass_seconds=0.0, coordinator_row_seconds=0.0,
                      local_bytes_per_second=math.inf)


def scenario_starts(scenario: dict, profile: dict) -> tuple[int, ...]:
    """The bench's split for a scenario: its boundaries, or the profiled default split."""
    from benchmarks.suite import SCENARIO_DIR, load_scenarios

    for declared in load_scenarios(SCENARIO_DIR):
        if declared.name == scenario["scenario"] and declared.boundaries:
            return (0, *declared.boundaries)
    if scenario["stages"] == len(profile["stages"]):
        return tuple(stage["first_block"] for stage in profile["stages"])
    raise click.ClickException(f"scenario {scenario['scenario']}: give its boundaries in its TOML to predict it")


def measured_behaviour(scenario: dict, kind: str) -> DraftBehaviour | None:
    """The workload's draft statistics for a speculator kind, from its sync mode
    (where every pass drafts afresh from the committed text)."""
    for row in scenario["modes"]:
        if row["mode"] == f"spec-sync-{kind}" and row.get("acceptance_later") is not None:
            return DraftBehaviour(row["acceptance_later"], row["draft_availability"], row["acceptance_first"],
                                  row["draft_continuation"])
    return None


def prompt_lookup_traces(scenario_name: str) -> list[DraftTrace]:
    """For each prompt of a scenario: the whole model's greedy output (what
    every mode produced), and prompt lookup replayed over it position by
    position: what it proposes for each token given the true text before it."""
    import llama_cpp

    from benchmarks.suite import SCENARIO_DIR, load_scenarios, whole_run
    from orchestrator.defaults import default_model_path
    from orchestrator.tokenizer import Tokenizer
    from speculators.prompt_lookup import PromptLookupSpeculator

    scenario = next(declared for declared in load_scenarios(SCENARIO_DIR) if declared.name == scenario_name)
    model = str(default_model_path()) if scenario.model == "default" else scenario.model
    tokenizer = Tokenizer(model)
    whole = llama_cpp.Llama(model, n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False)
    lookup = PromptLookupSpeculator()
    traces = []
    for text in scenario.prompts:
        prompt = tokenizer.chat_prompt(text) if scenario.chat else tokenizer.tokenize(text)
        output = whole_run(whole, prompt, scenario.max_tokens)[0]
        proposals: list[bool | None] = [None]  # token 0 comes from the prompt's pass
        for position in range(1, len(output)):
            proposal = lookup.extend(prompt + output[:position])
            proposals.append(None if proposal is None else proposal == output[position])
        traces.append(DraftTrace(tuple(proposals)))
    return traces


def calibrate(profile: dict, bench: dict) -> list[dict]:
    rows = []
    for scenario in bench["scenarios"]:
        base = setup_from_profile(profile, behaviour=None, max_tokens=scenario["max_tokens"])
        starts = scenario_starts(scenario, profile)
        machine = base.machines[0]
        split = replace(base, machines=[machine] * len(starts), links=[None] * len(starts), starts=starts,
                        draft_seconds=[0.0] * len(starts))
        whole = replace(base, machines=[machine], links=[None], starts=(0,), draft_seconds=[0.0],
                        software=IN_PROCESS)
        traces = None
        for row in scenario["modes"]:
            mode_name, behaviour = row["mode"], None
            if mode_name == "whole":
                setup, mode = whole, Mode("plain")
            elif mode_name == "pipeline":
                setup, mode = split, Mode("plain")
            elif mode_name.startswith("spec-"):
                _, schedule, kind = mode_name.split("-", 2)
                behaviour = measured_behaviour(scenario, kind)
                drafter_seconds = profile["drafter_seconds_per_token"].get(kind)
                if behaviour is None or drafter_seconds is None:
                    continue
                setup = replace(split, draft_seconds=[drafter_seconds] * len(starts))
                mode = Mode(schedule, BENCH_DRAFT_MAX)
                if kind == "ngram" and traces is None:
                    traces = prompt_lookup_traces(scenario["scenario"])
            else:
                continue
            costs = setup.costs(setup.starts)
            # As long as the measured generations were (they may end before max_tokens).
            length = max(2, round(row["mean_tokens"]))
            from_rates = predict(costs, mode, behaviour or DraftBehaviour(0.0), length, RUNS).tokens_per_second
            from_trace = None
            if behaviour is not None and kind == "ngram":
                from_trace = statistics.median(
                    predict(costs, mode, trace, scenario["max_tokens"], runs=1).tokens_per_second for trace in traces
                )
            measured = row["tokens_per_second"]["median"]
            rows.append({
                "scenario": scenario["scenario"], "mode": mode_name, "measured": measured,
                "measured_min": row["tokens_per_second"]["min"], "measured_max": row["tokens_per_second"]["max"],
                "from_rates": from_rates, "from_trace": from_trace, "behaviour": behaviour,
            })
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"Produced by `{command}`.",
        "",
        "| scenario | mode | measured tokens/s (min-max) | predicted from rates | error | predicted from trace | error "
        "| acceptance first / later | availability / continuation |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def error(predicted: float, measured: float) -> str:
        return f"{predicted / measured - 1:+.0%}"

    for row in rows:
        drafts, measured = row["behaviour"], row["measured"]
        behaviour = ("- | -" if drafts is None else
                     f"{drafts.first:.2f} / {drafts.acceptance:.2f} | {drafts.availability:.2f} / {drafts.next:.2f}")
        trace = "- | -" if row["from_trace"] is None else f"{row['from_trace']:.1f} | {error(row['from_trace'], measured)}"
        lines.append(
            f"| {row['scenario']} | {row['mode']} | {measured:.1f} ({row['measured_min']:.1f}-{row['measured_max']:.1f}) "
            f"| {row['from_rates']:.1f} | {error(row['from_rates'], measured)} | {trace} | {behaviour} |"
        )
    for column in ("from_rates", "from_trace"):
        # plain modes have no trace: their one prediction counts for both columns
        errors = [((row[column] or row["from_rates"]) / row["measured"] - 1, row) for row in rows]
        value, worst = max(errors, key=lambda item: abs(item[0]))
        lines.append(f"Largest error {column.replace('_', ' ')}: {value:+.0%} ({worst['scenario']}, {worst['mode']}).")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--profile", "profile_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--bench", "bench_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="results.json written by orchestrate bench.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the table here.")
def main(profile_path: str, bench_path: str, out_path: Path | None) -> None:
    import sys

    rows = calibrate(read_profile(profile_path), json.loads(Path(bench_path).read_text()))
    text = markdown(rows, "python -m benchmarks.calibrate " + " ".join(sys.argv[1:]))
    click.echo(text, nl=False)
    if out_path is not None:
        out_path.write_text(text)


if __name__ == "__main__":
    main()
