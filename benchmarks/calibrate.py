"""Prediction against measurement: ``orchestrate plan``'s simulation, fed with
``orchestrate profile`` output, beside ``orchestrate bench``'s medians, for
every scenario and mode (orchestrator.planning.against_bench says how each
mode is predicted), as a markdown table.

    python -m benchmarks.calibrate --profile PROFILE.json --bench results.json [--out calibration.md]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from orchestrator.output import write_whole
from orchestrator.planning.against_bench import ModePrediction, predict_scenario
from orchestrator.planning.loaders import read_profile


def markdown(rows: list[ModePrediction], command: str) -> str:
    lines = [
        f"Produced by `{command}`.",
        "",
        "| scenario | mode | measured tokens/s (min-max) | predicted from rates | error | predicted from trace | error "
        "| acceptance first / later | availability / continuation |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    for row in rows:
        drafts = row.behaviour
        behaviour = ("- | -" if drafts is None else
                     f"{drafts.first:.2f} / {drafts.acceptance:.2f} | {drafts.availability:.2f} / {drafts.continuation:.2f}")
        trace = "- | -" if row.from_trace is None else f"{row.from_trace:.1f} | {row.error(row.from_trace):+.0%}"
        lines.append(
            f"| {row.scenario} | {row.mode} | {row.measured:.1f} ({row.measured_min:.1f}-{row.measured_max:.1f}) "
            f"| {row.from_rates:.1f} | {row.error(row.from_rates):+.0%} | {trace} | {behaviour} |"
        )
    lines.append("")
    for label, predicted in (("from rates", lambda row: row.from_rates), ("from trace", lambda row: row.best)):
        # plain modes have no trace: their one prediction counts for both columns
        worst = max(rows, key=lambda row: abs(row.error(predicted(row))))
        lines.append(f"Largest error {label}: {worst.error(predicted(worst)):+.0%} ({worst.scenario}, {worst.mode}).")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--profile", "profile_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--bench", "bench_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="results.json written by orchestrate bench.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the table here.")
def main(profile_path: str, bench_path: str, out_path: Path | None) -> None:
    profile = read_profile(profile_path)
    rows = [row for scenario in json.loads(Path(bench_path).read_text())["scenarios"]
            for row in predict_scenario(profile, scenario)]
    text = markdown(rows, "python -m benchmarks.calibrate " + " ".join(sys.argv[1:]))
    click.echo(text, nl=False)
    if out_path is not None:
        write_whole(out_path, lambda path: path.write_text(text))


if __name__ == "__main__":
    main()
