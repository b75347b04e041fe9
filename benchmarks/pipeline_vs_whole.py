"""Plain pipeline against the whole model in one process, side by side in one run.

Modes, each with one thread per process, on the same prompts, interleaved
repetition by repetition so that machine noise hits both alike:

* whole: llama-cpp-python's own ``Llama`` on the unsplit model (what a user
  already has), greedy, through ``Llama.generate``;
* pipeline: the same model split in two, each stage in its own Ray actor
  (local Ray), driven by the coordinator over the socket chain.

Reports generation-phase tokens/s (median and min-max over repetitions), their
ratio pipeline/whole per repetition (median), and the measured per-hop transport
time (pass wall time minus the stages' compute, divided by the hops). Checks
both modes produce identical tokens.

    python -m benchmarks.pipeline_vs_whole [--repetitions 5] [--max-tokens 64]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
]


@click.command()
@click.option("--repetitions", default=5, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(2))
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the figures here.")
def main(repetitions: int, max_tokens: int, json_out: Path | None) -> None:
    import llama_cpp

    from benchmarks.suite import whole_run
    from orchestrator.cluster import ray_session
    from orchestrator.defaults import default_model_path, default_stage_paths
    from orchestrator.generate import generate
    from orchestrator.pipeline import Pipeline
    from orchestrator.sampling import SamplingSettings
    from orchestrator.tokenizer import Tokenizer
    from stages.engine import StageSettings

    model = str(default_model_path())
    stages = default_stage_paths()
    settings = StageSettings(n_ctx=1024, threads=1)
    tokenizer = Tokenizer(stages[0])
    prompts = [tokenizer.chat_prompt(text) for text in PROMPTS]
    llama = llama_cpp.Llama(model, n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False)

    whole_rates: list[float] = []
    pipeline_rates: list[float] = []
    ratios: list[float] = []
    identical = True
    with ray_session(None, num_cpus=2), Pipeline(stages, settings) as pipeline:
        # warm-up: one short run of each mode
        whole_run(llama, prompts[0], 8)
        generate(pipeline, prompts[0], 8, SamplingSettings(), tokenizer.is_end)
        transport_before, passes_before = pipeline.transport_seconds, pipeline.passes
        for repetition in range(repetitions):
            for prompt in prompts:
                order = ("whole", "pipeline") if repetition % 2 == 0 else ("pipeline", "whole")
                rates = {}
                tokens = {}
                for mode in order:
                    if mode == "whole":
                        tokens[mode], rates[mode], _, _ = whole_run(llama, prompt, max_tokens)
                    else:
                        result = generate(pipeline, prompt, max_tokens, SamplingSettings(), tokenizer.is_end)
                        tokens[mode], rates[mode] = result.tokens, result.tokens_per_second
                identical &= tokens["whole"] == tokens["pipeline"]
                whole_rates.append(rates["whole"])
                pipeline_rates.append(rates["pipeline"])
                ratios.append(rates["pipeline"] / rates["whole"])
        hops = (pipeline.passes - passes_before) * (len(stages) + 1)
        hop_seconds = (pipeline.transport_seconds - transport_before) / hops

    figures = {
        "threads_per_process": 1,
        "stages": len(stages),
        "runs_per_mode": len(ratios),
        "max_tokens": max_tokens,
        "whole_tokens_per_second": {"median": statistics.median(whole_rates), "min": min(whole_rates), "max": max(whole_rates)},
        "pipeline_tokens_per_second": {"median": statistics.median(pipeline_rates), "min": min(pipeline_rates), "max": max(pipeline_rates)},
        "ratio_pipeline_to_whole": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "hop_microseconds": hop_seconds * 1e6,
        "outputs_identical": identical,
    }
    click.echo(
        f"whole model (Llama, 1 thread):   {figures['whole_tokens_per_second']['median']:.1f} tokens/s "
        f"[{min(whole_rates):.1f}-{max(whole_rates):.1f}]\n"
        f"pipeline (2 stages, 1 thread each): {figures['pipeline_tokens_per_second']['median']:.1f} tokens/s "
        f"[{min(pipeline_rates):.1f}-{max(pipeline_rates):.1f}]\n"
        f"ratio pipeline/whole: median {figures['ratio_pipeline_to_whole']['median']:.3f} "
        f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} paired runs\n"
        f"per-hop transport: {hop_seconds * 1e6:.0f} us (pass wall time minus stage compute, per hop)\n"
        f"outputs identical: {identical}"
    )
    if json_out is not None:
        json_out.write_text(json.dumps(figures, indent=2))
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
