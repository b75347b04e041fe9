"""The draft policy against the rule it replaced, side by side in one run.

speculators.draft_length.DraftPolicy chooses each window's drafts (none
included) from the acceptance by position and the cost of a wider pass. Until
2026-12-01 the rule was fixed: start at draft_max, double after a fully
accepted window, accepted + 1 after a rejection, never below one. Both run
here on the bench's chat and rewrite prompts (the default model split in
two, one thread per stage, greedy, prompt lookup asked in this process as a
run asks it), with the plain pipeline beside them, modes in turn within each
repetition; medians of tokens/s over prompts and repetitions, as ratios to
the plain pipeline, and the passes per token (deterministic: the same text
gives the same passes, for a given measured draft step).

    python -m benchmarks.draft_policy [--repetitions 3] [--schedules sync,async]
"""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import click

from benchmarks.side_by_side import draft_steps, measure, print_table
from benchmarks.suite import DRAFT_MAX, SCENARIO_DIR, load_scenario, prompts_of


class DoublingRule:
    """The rule the policy replaced (same interface as DraftPolicy)."""

    def __init__(self, maximum: int, **_costs):
        self.maximum = maximum
        self.current = maximum

    def observe_ask(self, proposed: bool) -> None:
        pass

    def observe_window(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.maximum, max(self.current, drafted) * 2)
        else:
            self.current = max(1, min(self.maximum, accepted + 1))

    def limit(self) -> int:
        return self.current


@click.command()
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--schedules", default="sync,async", show_default=True)
def main(repetitions: int, schedules: str) -> None:
    from orchestrator.cluster.connect import ray_session
    from orchestrator.config import BENCH_CONTEXT, default_stage_paths
    from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
    from orchestrator.decoding.loop import generate
    from orchestrator.cluster.pipeline import Pipeline
    from orchestrator.decoding.schedule import Schedule
    from orchestrator.run import make_drafting
    from stages.tokenizer import Tokenizer
    from speculators.prompt_lookup import PromptLookupSpeculator
    from speculators.sampling import SamplingSettings
    from stages.settings import StageSettings

    paths = default_stage_paths()
    tokenizer = Tokenizer(paths[0])
    scenarios = [load_scenario(SCENARIO_DIR / f"{name}.toml") for name in ("chat", "rewrite")]
    modes = ["pipeline"] + [f"{schedule}-{rule}" for schedule in schedules.split(",") for rule in ("policy", "doubling")]
    with ray_session(None), Pipeline(paths, StageSettings(n_ctx=BENCH_CONTEXT), notify_boundaries=True) as pipeline:
        drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=DRAFT_MAX))
        steps = draft_steps(pipeline)
        print(f"measured draft step: sync {steps[False]:.2f}, async {steps[True]:.2f} one-token passes per extra token")
        try:
            def run(mode: str, prompt: list[int], max_tokens: int):
                drafting = None
                if mode != "pipeline":
                    schedule, rule = mode.split("-")
                pipeline.pin_stages(overlapping=mode.startswith("async"))
                if mode != "pipeline":
                    drafting = make_drafting("ngram", drafters, Schedule(schedule), DRAFT_MAX, PromptLookupSpeculator,
                                             steps[schedule == "async"])
                rule_class = DoublingRule if mode.endswith("doubling") else None
                with mock.patch("orchestrator.decoding.schedule.DraftPolicy", rule_class) if rule_class else nullcontext():
                    return generate(pipeline, prompt, max_tokens, SamplingSettings(), tokenizer.is_end, drafting=drafting)

            rates, passes = measure(scenarios, lambda scenario: prompts_of(tokenizer, scenario), modes, run,
                                    repetitions)
        finally:
            stop_drafters(drafters)
    print_table(scenarios, modes, rates, passes, repetitions)

if __name__ == "__main__":
    main()
