"""Cancelling invalidated passes, against running them in full, side by side.

A pass started ahead (async) on a speculation that a rejection then
invalidates is cancelled (orchestrator.workers.stage_server): dropped by stages it
has not reached, stopped mid-graph where it runs. Here the same async runs
also go without it (Pipeline.cancel a no-op: every such pass runs on every
stage, as before 2026-12-01), beside sync and the plain pipeline, on the
bench's rewrite prompts through two stages and through three (one thread per
stage, greedy, prompt lookup asked in this process as a run asks it). Modes
in turn within each repetition; medians of tokens/s over prompts and
repetitions, as ratios to the plain pipeline; the passes per token, and the
passes the stages dropped or stopped.

    python -m benchmarks.cancellation [--repetitions 3]
"""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import click

from benchmarks.side_by_side import draft_steps, measure, print_table
from benchmarks.suite import DRAFT_MAX, SCENARIO_DIR, _stage_paths, load_scenario, prompts_of

MODES = ["pipeline", "sync", "async", "async-uncancelled"]


@click.command()
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
def main(repetitions: int) -> None:
    from orchestrator.cluster.connect import ray_session
    from orchestrator.config import BENCH_CONTEXT
    from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
    from orchestrator.decoding.loop import generate
    from orchestrator.cluster.pipeline import Pipeline
    from orchestrator.decoding.schedule import Schedule
    from orchestrator.run import make_drafting
    from stages.tokenizer import Tokenizer
    from speculators.prompt_lookup import PromptLookupSpeculator
    from speculators.sampling import SamplingSettings
    from stages.settings import StageSettings

    scenarios = [load_scenario(SCENARIO_DIR / f"{name}.toml") for name in ("rewrite", "three-stages")]
    with ray_session(None), tempfile.TemporaryDirectory() as workdir:
        for scenario in scenarios:
            _, paths = _stage_paths(scenario, Path(workdir))
            tokenizer = Tokenizer(paths[0])
            with Pipeline(paths, StageSettings(n_ctx=BENCH_CONTEXT, threads=1), notify_boundaries=True) as pipeline:
                drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=DRAFT_MAX))
                steps = draft_steps(pipeline)
                try:
                    def run(mode: str, prompt: list[int], max_tokens: int):
                        pipeline.pin_stages(overlapping=mode.startswith("async"))
                        drafting = None if mode == "pipeline" else make_drafting(
                            "ngram", drafters, Schedule(mode.split("-")[0]), DRAFT_MAX, PromptLookupSpeculator,
                            steps[mode.startswith("async")])
                        uncancelled = mock.patch.object(pipeline, "cancel", lambda target_pass: None)
                        with uncancelled if mode.endswith("uncancelled") else nullcontext():
                            return generate(pipeline, prompt, max_tokens, SamplingSettings(), tokenizer.is_end,
                                            drafting=drafting)

                    before = [(report.dropped_passes, report.stopped_passes) for report in pipeline.reports()]
                    rates, passes = measure([scenario], lambda scenario: prompts_of(tokenizer, scenario), MODES, run,
                                            repetitions)
                    after = [(report.dropped_passes, report.stopped_passes) for report in pipeline.reports()]
                finally:
                    stop_drafters(drafters)
            print(f"\n{scenario.name}: {len(paths)} stages; measured draft step sync {steps[False]:.2f}, "
                  f"async {steps[True]:.2f}")
            print_table([scenario], MODES, rates, passes, repetitions)
            print("cancelled passes per stage (dropped unstarted, stopped mid-graph): " + ", ".join(
                f"stage {index} {dropped - was_dropped}/{stopped - was_stopped}"
                for index, ((was_dropped, was_stopped), (dropped, stopped)) in enumerate(zip(before, after))))


if __name__ == "__main__":
    main()
