"""Plain pipeline against synchronous and asynchronous speculation, side by side.

Same 2-stage split (one thread per stage), same prompts, same run, local Ray.
Two workloads: open-ended chat, and an input-grounded rewrite of a given
passage. For each speculator kind, modes run in a rotating order within each
repetition so noise falls on all alike; ratios are taken per repetition and
reported as medians. Every speculative output is checked identical to the
plain pipeline's (greedy).

    python -m benchmarks.speculation [--repetitions 5] [--max-tokens 96] [--speculators ngram,model]

``model`` drafts with SmolLM2 itself (the only model of its vocabulary on
PyPI): every draft token costs as much as a target token on this CPU, so it
checks the machinery rather than promising speed.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections import Counter
from pathlib import Path

import click

PASSAGE = (
    "The lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
    "climbed the narrow stairs, lit the great lamp and watched the ships pass safely through the dark water. "
    "When the storms came in winter, the waves rose higher than the rocks, but the light never went out. "
    "Sailors in the harbour town said that as long as the lamp was burning, no ship would be lost on the reef."
)
WORKLOADS = {
    "chat": ["Tell me about the moon.", "What makes a good friend?"],
    "rewrite": [
        "Rewrite the following passage, correcting nothing and keeping every sentence:\n\n" + PASSAGE,
        "Copy this passage word for word:\n\n" + PASSAGE,
    ],
}
MODES = ("plain", "sync", "async")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


@click.command()
@click.option("--repetitions", default=5, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=96, show_default=True, type=click.IntRange(2))
@click.option("--draft-max", default=8, show_default=True, type=click.IntRange(1))
@click.option("--speculators", default="ngram", show_default=True, help="Comma-separated: ngram, model.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the figures here.")
def main(repetitions: int, max_tokens: int, draft_max: int, speculators: str, json_out: Path | None) -> None:
    from orchestrator.cluster import ray_session
    from orchestrator.defaults import default_model_path, default_stage_paths
    from orchestrator.drafters import DrafterSettings, start_drafters, stop_drafters
    from orchestrator.generate import Speculation, generate
    from orchestrator.pipeline import Pipeline
    from orchestrator.sampling import SamplingSettings
    from orchestrator.tokenizer import Tokenizer
    from speculators.model import ModelSpeculator
    from speculators.prompt_lookup import PromptLookupSpeculator
    from stages.engine import StageSettings

    kinds = [kind.strip() for kind in speculators.split(",") if kind.strip()]
    factories = {"ngram": PromptLookupSpeculator, "model": functools.partial(ModelSpeculator, str(default_model_path()), n_ctx=2048)}
    unknown = [kind for kind in kinds if kind not in factories]
    if unknown:
        raise click.BadParameter(f"unknown speculator {unknown[0]!r}")
    stages = default_stage_paths()
    settings = StageSettings(n_ctx=2048, threads=1)
    tokenizer = Tokenizer(stages[0])
    prompts = {workload: [tokenizer.chat_prompt(text) for text in texts] for workload, texts in WORKLOADS.items()}
    rows = []
    all_identical = True
    with ray_session(None, num_cpus=2), Pipeline(stages, settings, notify_boundaries=True) as pipeline:
        generate(pipeline, prompts["chat"][0], 8, SamplingSettings(), tokenizer.is_end)  # warm-up
        for kind in kinds:
            drafters = start_drafters(pipeline, factories[kind], DrafterSettings(max_tokens=draft_max))
            try:
                for workload, workload_prompts in prompts.items():
                    runs: dict[str, list] = {mode: [] for mode in MODES}
                    for repetition in range(repetitions):
                        for prompt in workload_prompts:
                            order = MODES[repetition % 3 :] + MODES[: repetition % 3]
                            outputs = {}
                            for mode in order:
                                speculation = None if mode == "plain" else Speculation(drafters, mode, draft_max)
                                busy_before = [client.busy_seconds for client in drafters]
                                result = generate(pipeline, prompt, max_tokens, SamplingSettings(), tokenizer.is_end,
                                                  speculation=speculation)
                                drafting = sum(client.busy_seconds for client in drafters) - sum(busy_before)
                                runs[mode].append((result, drafting))
                                outputs[mode] = result.tokens
                            identical = outputs["sync"] == outputs["plain"] == outputs["async"]
                            all_identical &= identical
                    rows.append(_summarise(kind, workload, runs, len(stages)))
            finally:
                stop_drafters(drafters)
    for row in rows:
        click.echo(
            f"{row['speculator']:5s} {row['workload']:7s} "
            + "  ".join(
                f"{mode}: {row[mode]['tokens_per_second']:6.1f} tok/s (x{row[mode]['ratio_to_plain']:.2f}, "
                f"{row[mode]['passes_per_token']:.2f} passes/token, accept {row[mode]['acceptance_rate']:.0%})"
                for mode in MODES
            )
        )
    click.echo(f"all outputs identical to the plain pipeline: {all_identical}")
    if json_out is not None:
        json_out.write_text(json.dumps({"rows": rows, "outputs_identical": all_identical}, indent=2))
    if not all_identical:
        raise SystemExit(1)


def _summarise(kind: str, workload: str, runs: dict[str, list], stage_count: int) -> dict:
    row: dict = {"speculator": kind, "workload": workload}
    plain_rates = [result.tokens_per_second for result, _ in runs["plain"]]
    for mode, mode_runs in runs.items():
        rates = [result.tokens_per_second for result, _ in mode_runs]
        ratios = [rate / plain for rate, plain in zip(rates, plain_rates)]
        drafted = sum(result.speculation.drafted_tokens for result, _ in mode_runs)
        accepted = sum(result.speculation.accepted_tokens for result, _ in mode_runs)
        passes = sum(result.passes for result, _ in mode_runs)
        tokens = sum(len(result.tokens) for result, _ in mode_runs)
        seconds = sum(result.seconds for result, _ in mode_runs)
        lengths: Counter = Counter()
        for result, _ in mode_runs:
            lengths.update(result.speculation.input_lengths)
        row[mode] = {
            "tokens_per_second": _median(rates),
            "tokens_per_second_min": min(rates),
            "tokens_per_second_max": max(rates),
            "ratio_to_plain": _median(ratios),
            "passes_per_token": passes / tokens if tokens else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "stage_utilisation": [
                sum(result.stage_seconds[index] for result, _ in mode_runs) / seconds for index in range(stage_count)
            ],
            "drafter_busy_fraction": sum(drafting for _, drafting in mode_runs) / seconds / stage_count,
            "target_input_length_histogram": {str(length): count for length, count in sorted(lengths.items())},
        }
    return row


if __name__ == "__main__":
    main()
