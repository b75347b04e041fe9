"""What a lost stage costs: the pause from its death to the chain carrying
passes again (reload the stage, rewire, replay every live sequence's cache),
by how much context the pipeline holds, beside one ordinary decode pass.

    python -m benchmarks.probe restart-cost [--contexts 64,512,1536] [--repetitions 3]

The default model (SmolLM2-135M, two stages) on a local Ray. For each context
length one sequence is prefilled to that length; then stage 1's process is
killed (SIGKILL) and the next one-token pass is timed: it comes back once the
stage is restarted and the context replayed (Pipeline.restarts has the
split); the context's own prefill is timed beside it. The context lengths
take turns repetition by repetition (benchmarks.side_by_side); medians and
ranges over the repetitions.
"""

from __future__ import annotations

import os
import signal
import time

import click
import numpy as np

from benchmarks.probe.harness import Report, probe, table
from benchmarks.side_by_side import Outcome, side_by_side
from orchestrator.cluster.connect import ray_session
from orchestrator.config import default_stage_paths
from stages.settings import StageSettings


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


def _lengths(context, parameter, value: str) -> list[int]:
    try:
        lengths = [int(length) for length in value.split(",")]
    except ValueError:
        raise click.BadParameter("comma-separated token counts, such as 64,512,1536") from None
    if not lengths or min(lengths) < 1:
        raise click.BadParameter("every context length must be at least 1")
    return lengths


@probe("restart-cost", repetitions=3)
@click.option("--contexts", "lengths", default="64,512,1536", show_default=True, callback=_lengths,
              help="Tokens held when the stage dies (comma-separated).")
def restart_cost(repetitions: int, lengths: list[int]) -> Report:
    """The pause a killed stage costs (restart, rewire, replay), by the context
    held, beside that context's prefill and an ordinary pass (the default
    model, two stages, Ray)."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings

    with ray_session(None):
        with PipelineSettings(default_stage_paths(), StageSettings(n_ctx=max(lengths) + 16),
                              max_restarts=len(lengths) * repetitions).start() as pipeline:
            def run(mode: str, repetition: int) -> Outcome:
                tokens = (np.arange(int(mode), dtype=np.int32) * 7919 % 40000 + 100).astype(np.int32)
                started = time.perf_counter()
                _prefill(pipeline, tokens)
                prefilled = time.perf_counter() - started
                normal = _one_pass_seconds(pipeline, tokens)
                os.kill(pipeline.stages[1].process_id, signal.SIGKILL)
                paused = _one_pass_seconds(pipeline, tokens)
                return Outcome({"prefill": prefilled, "pass": normal, "after death": paused,
                                "replay": pipeline.restarts[-1].replay_seconds})

            samples = side_by_side([str(length) for length in lengths], repetitions, run)
    rows = [[mode, samples.spread(mode, "prefill"), samples.spread(mode, "pass", 1e3, 1),
             samples.spread(mode, "after death"), samples.spread(mode, "replay")] for mode in samples.modes]
    lines = table(["context held", "its prefill (s)", "one pass (ms)", "pass after a stage dies (s)",
                   "of which replay (s)"], rows)
    return Report("What a lost stage costs: the default model in 2 stages on a local Ray, stage 1 killed (SIGKILL) "
                  "after each prefill", lines, {"": samples})
