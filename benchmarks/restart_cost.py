"""What a lost stage costs: the pause from its death to the chain carrying
passes again (reload the stage, rewire, replay every live sequence's cache),
by how much context the pipeline holds, beside one ordinary decode pass.

    python -m benchmarks.restart_cost [--contexts 64,512,1536] [--repetitions 3]

The default model (SmolLM2-135M, two stages) on a local Ray. For each context
length one sequence is prefilled to that length; then stage 1's process is
killed (SIGKILL) and the next one-token pass is timed: it comes back once the
stage is restarted and the context replayed (Pipeline.restarts has the
split); the context's own prefill is timed beside it. Medians and ranges
over the repetitions; one run, side by side.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import click
import numpy as np


def _prefill(pipeline, tokens: np.ndarray) -> None:
    for start in range(0, len(tokens), pipeline.n_batch):
        chunk = tokens[start:start + pipeline.n_batch]
        pipeline.forward(np.arange(start, start + len(chunk), dtype=np.int32), chunk, start)


def _one_pass_seconds(pipeline, tokens: np.ndarray) -> float:
    """One token after the context (then rolled back by the next pass's keep)."""
    position = len(tokens)
    started = time.perf_counter()
    pipeline.forward(np.array([position], np.int32), tokens[-1:], position)
    return time.perf_counter() - started


@click.command()
@click.option("--contexts", default="64,512,1536", show_default=True, help="Tokens held when the stage dies.")
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
def main(contexts: str, repetitions: int) -> None:
    from orchestrator.cluster.connect import ray_session
    from orchestrator.config import default_stage_paths
    from orchestrator.cluster.pipeline import Pipeline
    from stages.settings import StageSettings

    lengths = [int(length) for length in contexts.split(",")]
    rows = []
    with ray_session(None):
        with Pipeline(default_stage_paths(), StageSettings(n_ctx=max(lengths) + 16),
                      max_restarts=len(lengths) * repetitions) as pipeline:
            for length in lengths:
                tokens = (np.arange(length, dtype=np.int32) * 7919 % 40000 + 100).astype(np.int32)
                prefilled, normal, paused, replayed = [], [], [], []
                for _ in range(repetitions):
                    started = time.perf_counter()
                    _prefill(pipeline, tokens)
                    prefilled.append(time.perf_counter() - started)
                    normal.append(_one_pass_seconds(pipeline, tokens))
                    os.kill(pipeline.stages[1].process_id, signal.SIGKILL)
                    paused.append(_one_pass_seconds(pipeline, tokens))
                    replayed.append(pipeline.restarts[-1].replay_seconds)
                rows.append((length, prefilled, normal, paused, replayed))
    print("| context held | its prefill (s) | one pass (ms) | pass after a stage dies (s) | of which replay (s) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for length, prefilled, normal, paused, replayed in rows:
        print(f"| {length} | {_spread(prefilled, 1, 2)} | {_spread(normal, 1e3, 1)} | {_spread(paused, 1, 2)} "
              f"| {_spread(replayed, 1, 2)} |")
    print(f"\n{repetitions} repetitions; median (min-max).")


def _spread(values: list[float], scale: float, digits: int) -> str:
    scaled = [value * scale for value in values]
    return f"{statistics.median(scaled):.{digits}f} ({min(scaled):.{digits}f}-{max(scaled):.{digits}f})"


if __name__ == "__main__":
    main()
