"""``python -m benchmarks.probe prefill``: the time to the first token of a
long prompt, through the stages with its chunks pipelined (stage 0 on chunk
2 while stage 1 is on chunk 1; orchestrator.decoding.schedule.prompt_chunk)
against the same stages fed one n_batch chunk at a time, and the whole model
with one thread (llama-cpp-python's ``Llama``, the reference). The stages are
pinned a core each (their passes overlap); every mode's first token must agree."""

from __future__ import annotations

import time

import click
import numpy as np

from benchmarks.probe.harness import Report, probe, table
from benchmarks.reference import WholeModel
from benchmarks.side_by_side import Outcome, side_by_side
from orchestrator.cluster.connect import ray_session
from orchestrator.config import default_model_path, default_stage_paths
from orchestrator.decoding.loop import generate
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

MODES = ("whole", "stages-pipelined", "stages-one-chunk-at-a-time")


class _OneChunkAtATime:
    """A target as the loop saw every target before prompts pipelined: one
    stage, so a prompt goes in n_batch chunks, one in flight."""

    stage_count = 1

    def __init__(self, target):
        self.target = target
        self.n_batch = target.n_batch

    def __getattr__(self, name):
        return getattr(self.target, name)


@probe("prefill", repetitions=3)
@click.option("--prompt-tokens", default=1500, show_default=True, type=click.IntRange(2, 4000))
def prefill(repetitions: int, prompt_tokens: int) -> Report:
    """Time to the first token of a long prompt (the default model in 2 stages
    on a local Ray, and whole with one thread)."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings

    context = prompt_tokens + 64
    prompt = (np.arange(prompt_tokens) * 7919 % 40000 + 100).astype(int).tolist()
    whole = WholeModel(str(default_model_path()), n_ctx=context)
    with ray_session(None), PipelineSettings(default_stage_paths(), StageSettings(n_ctx=context)).start(overlapping=True) as stages:
        targets = {"stages-pipelined": stages, "stages-one-chunk-at-a-time": _OneChunkAtATime(stages)}

        def run(mode: str, repetition: int) -> Outcome:
            if mode == "whole":
                reply = whole.greedy(prompt, 1)
                return Outcome({"first_token_seconds": reply.first_token_seconds}, reply.tokens)
            started = time.perf_counter()
            generation = generate(targets[mode], prompt, 1, SamplingSettings(), lambda token: False)
            return Outcome({"first_token_seconds": time.perf_counter() - started}, generation.tokens)

        samples = side_by_side(list(MODES), repetitions, run, warm_up=lambda mode: run(mode, 0))
    base = samples.median("whole", "first_token_seconds")
    rows = [[mode, samples.spread(mode, "first_token_seconds", 1e3, 0),
             f"{samples.median(mode, 'first_token_seconds') / base:.2f}"] for mode in MODES]
    lines = table(["mode", "time to first token (ms)", "x whole"], rows)
    return Report(f"Time to the first token of a {prompt_tokens}-token prompt: SmolLM2-135M whole (1 thread) and in "
                  "2 stages on a local Ray (a core each); x whole is a ratio of medians", lines, {"": samples})
