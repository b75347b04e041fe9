"""Writing a bench run's results: results.json, results.md (a table), chart.png, timeline.png."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import timeline
from orchestrator.output import write_whole


def _number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    lines = [f"# Benchmark results\n\n{results['command']}\n\n{results['machine']}; one thread per process, greedy.\n"]
    if results.get("cost_curve"):  # every figure below is emulated
        lines.append(f"**Emulated**: every stage pass lasts at least the time of the cost curve "
                     f"\"{results['cost_curve']['name']}\" for its width (x whole compares with the real, "
                     "unemulated whole model).\n")
    for scenario in results["scenarios"]:
        lines.append(
            f"## {scenario['scenario']}: {scenario['description']}\n\n"
            f"{scenario['stages']} stages, {scenario['prompts']} prompt(s) x {scenario['repetitions']} repetition(s), "
            f"up to {scenario['max_tokens']} tokens; per-hop transport {scenario['hop_microseconds']:.0f} us; "
            "peak RSS (MiB): " + ", ".join(f"{name} {_number(rss, 0)}" for name, rss in scenario["peak_rss_mb"].items())
            + "\n"
        )
        lines.append("| mode | tokens/s median [min-max] | first token ms | x pipeline | x whole | passes/token "
                     "| acceptance | tokens/verified pass | trees (side rows, accepted) | accepted lengths | stage busy "
                     "| drafter busy | identical |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in scenario["modes"]:
            rate = row["tokens_per_second"]
            identical = "yes" if row["identical"] else '<span style="color:red">**NO**</span>'
            busy = ", ".join(f"{value:.2f}" for value in row["stage_busy_fraction"]) if row["stage_busy_fraction"] else "-"
            if row.get("stage_discarded_share") and any(row["stage_discarded_share"]):
                busy += " (discarded " + ", ".join(f"{value:.0%}" for value in row["stage_discarded_share"]) + ")"
            lengths = " ".join(f"{length}:{count}" for length, count in row["accepted_length_histogram"].items()) or "-"
            acceptance = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
            trees = (f"{row['tree_passes']} ({row['tree_side_rows']}, {row['tree_side_accepted']})"
                     if row.get("tree_passes") else "-")
            lines.append(
                f"| {row['mode']} | {rate['median']:.1f} [{rate['min']:.1f}-{rate['max']:.1f}] "
                f"| {row['time_to_first_token_ms']:.0f} | {row['ratio_to_pipeline']:.2f} | {_number(row['ratio_to_whole'])} "
                f"| {_number(row['target_passes_per_token'])} | {acceptance} | {_number(row.get('committed_per_pass'))} "
                f"| {trees} | {lengths} | {busy} "
                f"| {_number(row['drafter_busy_fraction'], 3)} | {identical} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def chart(results: dict, path: Path) -> None:
    """Tokens/s per mode (median bar, min-max whiskers), one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = results["scenarios"]
    figure, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4.5), squeeze=False)
    for axis, scenario in zip(axes[0], scenarios):
        rows = scenario["modes"]
        medians = [row["tokens_per_second"]["median"] for row in rows]
        low = [row["tokens_per_second"]["median"] - row["tokens_per_second"]["min"] for row in rows]
        high = [row["tokens_per_second"]["max"] - row["tokens_per_second"]["median"] for row in rows]
        colours = ["tab:grey" if row["mode"].startswith("whole") else "tab:blue" if row["mode"] == "pipeline"
                   else "tab:green" for row in rows]
        colours = [colour if row["identical"] else "tab:red" for colour, row in zip(colours, rows)]
        axis.bar(range(len(rows)), medians, yerr=[low, high], capsize=4, color=colours)
        axis.set_xticks(range(len(rows)), [row["mode"] for row in rows], rotation=30, ha="right")
        axis.set_ylabel("tokens/s (median, min-max)")
        emulated = f", emulated: {results['cost_curve']['name']}" if results.get("cost_curve") else ""
        axis.set_title(f"{scenario['scenario']} ({scenario['stages']} stages{emulated})", fontsize=9 if emulated else None)
        axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_results(results: dict, folder: Path) -> list[Path]:
    """Write the files (timeline.png where a mode has a timeline); each appears complete or not at all."""
    outputs = {
        "results.json": lambda path: path.write_text(json.dumps(results, indent=2)),
        "results.md": lambda path: path.write_text(markdown(results)),
        "chart.png": lambda path: chart(results, path),
    }
    if any(row.get("timeline") for scenario in results["scenarios"] for row in scenario["modes"]):
        outputs["timeline.png"] = lambda path: timeline.draw(results, path)
    for name, write in outputs.items():
        write_whole(folder / name, write)
    return [folder / name for name in outputs]
