"""Modes of decoding run side by side on the bench's prompts, in one run.

The loop the focused benchmarks share (benchmarks.draft_policy,
benchmarks.cancellation): a warm-up of every mode, then for each repetition
and prompt every mode in turn, starting one mode later each time (so no mode
always runs first on a warm machine), every mode's tokens checked against
the first mode's; medians of tokens/s and their ranges, as ratios to the
first mode, and passes per token.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable


def draft_steps(pipeline) -> dict[bool, float]:
    """The draft policy's batch cost, measured as the bench measures it: for
    stages pinned as for passes that do not overlap (False) and that do (True)."""
    steps = {}
    for overlapping in (False, True):
        pipeline.pin_stages(overlapping)
        steps[overlapping] = pipeline.draft_step()
    return steps


def measure(scenarios, prompts_of: Callable, modes: list[str], run: Callable, repetitions: int):
    """run(mode, prompt tokens, max_tokens) -> Generation. Returns (tokens/s,
    passes per token), each {(scenario name, mode): [one per prompt and repetition]};
    SystemExit if two modes' tokens differ."""
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    passes: dict[tuple[str, str], list[float]] = defaultdict(list)
    for scenario in scenarios:
        prompts = prompts_of(scenario)
        for mode in modes:  # warm-up
            run(mode, prompts[0], 8)
        for repetition in range(repetitions):
            for index, prompt in enumerate(prompts):
                shift = (repetition + index) % len(modes)
                outputs = {}
                for mode in modes[shift:] + modes[:shift]:
                    result = run(mode, prompt, scenario.max_tokens)
                    outputs[mode] = result.tokens
                    rates[scenario.name, mode].append(result.tokens_per_second)
                    passes[scenario.name, mode].append(result.passes / max(1, len(result.tokens)))
                if any(tokens != outputs[modes[0]] for tokens in outputs.values()):
                    raise SystemExit(f"{scenario.name}: the modes produced different tokens")
    return rates, passes


def print_table(scenarios, modes: list[str], rates, passes, repetitions: int) -> None:
    print(f"| scenario | mode | tokens/s median (range) | x {modes[0]} | passes/token |  ({repetitions} repetitions)")
    print("| --- | --- | ---: | ---: | ---: |")
    for scenario in scenarios:
        first = statistics.median(rates[scenario.name, modes[0]])
        for mode in modes:
            values = rates[scenario.name, mode]
            print(f"| {scenario.name} | {mode} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) "
                  f"| {statistics.median(values) / first:.2f} | {statistics.median(passes[scenario.name, mode]):.2f} |")
    print(f"\nevery mode's tokens identical to the {modes[0]}'s")
