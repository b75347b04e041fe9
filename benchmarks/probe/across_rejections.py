"""``python -m benchmarks.probe across-rejections``: what async speculation
does across rejections, beside sync and the plain pipeline, side by side in
one run: chat with the bench's draft of realistic agreement (SmolLM2
requantized to Q4_0), greedy, under an emulated cost curve (then every
figure is emulated) or none, through 2 or more stages.

Figures per repetition (both chat prompts): tokens/s of the generation
phase, its ratio to the plain pipeline and to sync, the tokens a verified
pass committed (C), and each stage's compute over the wall time (the least
of the stages) with the share of it on discarded passes. ``async`` drafts
corrections while a pass runs (speculators.corrections), ``async-chain``
only the chain; ``async-branches`` is ``async`` with branch windows
(orchestrator.decoding.branches: up to a window a stage in flight, each
rooted at the committed text, kept across the rejections its rows cover),
where passes are flat and the draft fast; "corrected" is the share of
rejections a correction covered.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from benchmarks.probe.harness import Report, probe, table
from benchmarks.scenarios import SCENARIO_DIR, load_scenario, prompts_of
from benchmarks.side_by_side import Outcome, Samples, draft_steps, side_by_side
from orchestrator.cluster.connect import ray_session
from orchestrator.config import BENCH_CONTEXT, DRAFT_MAX, default_model_path
from stages.settings import StageSettings

MODES = ["plain", "sync", "async-chain", "async", "async-branches"]
FIGURES = ("tokens/s", "x plain", "x sync", "C", "least stage busy", "discarded share", "corrected")


@probe("across-rejections", repetitions=3)
@click.option("--stages", default=2, show_default=True, type=click.IntRange(2, 8), help="Stages the model is cut into.")
@click.option("--cost-curve", "curve", default=None, help="An emulated curve (SETUP.toml@MS or a curve file); "
              "none: this machine's own passes.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(8, 512))
@click.option("--tree-leaves", default=1, show_default=True, type=click.IntRange(1, 8),
              help="Above 1: the stages verify token trees of that many leaves (the draft's awaited trees, and "
              "branch windows' corrections as side branches).")
def across_rejections(repetitions: int, stages: int, curve: str | None, max_tokens: int, tree_leaves: int) -> Report:
    """Async speculation across rejections beside sync and the plain pipeline."""
    from benchmarks.drafts import realistic_draft
    from benchmarks.suite import start_kinds
    from orchestrator.cluster.drafters import speculator_factory
    from orchestrator.cluster.pipeline_settings import PipelineSettings
    from orchestrator.decoding.drafting import SpeculationSettings, tree_stage_settings
    from orchestrator.decoding.loop import generate
    from orchestrator.decoding.schedule import Schedule
    from orchestrator.planning.curves import load_cost_curve
    from speculators.sampling import SamplingSettings
    from stages.split import split_model
    from stages.tokenizer import Tokenizer

    model = str(default_model_path())
    with tempfile.TemporaryDirectory() as folder:
        paths = [str(Path(folder) / f"stage-{index}.gguf") for index in range(stages)]
        split_model(model, paths)
        draft = realistic_draft(model, Path(folder))
        tokenizer = Tokenizer(paths[0])
        prompts = prompts_of(tokenizer, load_scenario(SCENARIO_DIR.parent / "scenarios-draft" / "chat.toml"))
        settings = tree_stage_settings(StageSettings(n_ctx=BENCH_CONTEXT, threads=1,
                                                     cost_curve=load_cost_curve(curve) if curve else None), tree_leaves)
        with ray_session(None), PipelineSettings(paths, settings).start() as pipeline:
            make = speculator_factory(SpeculationSettings("model", draft, tree_leaves=tree_leaves), tokenizer, settings)
            drafter_set = start_kinds(pipeline, {"model": make})["model"]
            try:
                steps = draft_steps(pipeline)
                pipeline.pin_stages(overlapping=False)
                prices = drafter_set.measure_prices(pipeline, prompts[0], pipeline.pass_costs()[0])
                rates: dict[tuple[str, int], float] = {}

                def run(mode: str, repetition: int) -> Outcome:
                    schedule = {"plain": None, "sync": Schedule.SYNC}.get(mode, Schedule.ASYNC)
                    drafting = None if schedule is None else drafter_set.drafting(
                        schedule, DRAFT_MAX, step=steps[schedule is Schedule.ASYNC], corrections=mode != "async-chain",
                        branches=mode == "async-branches", tree_leaves=tree_leaves)
                    pipeline.pin_stages(overlapping=schedule is Schedule.ASYNC)
                    results = [generate(pipeline, prompt, max_tokens, SamplingSettings(), tokenizer.is_end,
                                        drafting=drafting) for prompt in prompts]
                    seconds = sum(result.decode_seconds for result in results)
                    rate = sum(len(result.tokens) - 1 for result in results) / seconds
                    rates[mode, repetition] = rate
                    busy = [sum(result.stage_seconds[stage] for result in results) /
                            sum(result.seconds for result in results) for stage in range(stages)]
                    discarded = sum(sum(result.discarded_seconds) for result in results)
                    verified = [result.speculation for result in results]
                    windows = sum(sum(stats.accepted_lengths.values()) for stats in verified)
                    committed = sum(sum(length * count for length, count in stats.accepted_lengths.items())
                                    for stats in verified)
                    rejected = sum(stats.rejected_passes for stats in verified)
                    return Outcome({"tokens/s": rate, "C": committed / windows if windows else 1.0,
                                    "corrected": sum(stats.corrected_windows for stats in verified) / max(1, rejected),
                                    "least stage busy": min(busy),
                                    "discarded share": discarded / sum(sum(result.stage_seconds) for result in results)},
                                   [result.tokens for result in results])

                samples: Samples = side_by_side(MODES, repetitions, run)
            finally:
                drafter_set.stop()
    for mode in MODES:  # ratios within each repetition, after all modes ran in it
        for repetition in range(repetitions):
            samples.add(mode, {"x plain": rates[mode, repetition] / rates["plain", repetition],
                               "x sync": rates[mode, repetition] / rates["sync", repetition]})
    lines = table(["figure", *MODES], [[name, *(samples.spread(mode, name) for mode in MODES)] for name in FIGURES])
    lines.append("")
    trees = f", token trees of {tree_leaves} leaves" if tree_leaves > 1 else ""
    where = f"under {curve}" if curve else "on this machine, no curve"
    lines.append(f"{stages} stages {where}{trees}; chat-draft's two prompts, {max_tokens} tokens each, greedy, "
                 "every mode's tokens identical; the draft's prices (awaited, while a pass runs) "
                 f"{prices.awaited:.3f}, {prices.relayed:.3f} of a one-token pass.")
    return Report(f"Async speculation across rejections ({'emulated' if curve else 'this machine'})", lines,
                  {"": samples})
