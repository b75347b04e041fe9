"""Where a plain pipeline's per-token time goes, side by side in one run.

Greedy decoding of the same tokens, one token per pass, in three ways:

    whole        the unsplit model in one stage engine, in this process
    in process   the stage engines one after another in this process (no Ray, no sockets)
    pipeline     the stage actors and the socket chain (orchestrator.cluster.pipeline),
                 twice: with the stage processes pinned as a run pins them
                 (orchestrator.cluster.stage_cpus: both on one core, one pass at a
                 time) and unpinned (the kernel picks their cores)

Last, what a synchronous window pays before its pass to ask the drafter
beside stage 0 (prompt lookup, an actor: speculate, then collect with wait),
timed between one-token passes of the pinned pipeline, right after that
mode's passes, as a share of the pass: the draft policy's call cost
(speculators.draft_length).

For the pipeline each pass is cut into the stages' own compute (as each
stage times its decode), the transport of all hops (wall time of the pass
minus that compute), and the coordinator's own work between a result and
the next pass (argmax, bookkeeping). The modes take turns repetition by
repetition (benchmarks.side_by_side), so a slow spell of this VM falls on
all of them; medians per pass, and the range of the repetitions' medians.

    python -m benchmarks.probe where-time-goes [--tokens 64] [--repetitions 3]

The default model (SmolLM2-135M split in two), one thread per stage.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import click
import numpy as np

from benchmarks.probe.harness import Report, probe, table
from benchmarks.side_by_side import Outcome, side_by_side
from orchestrator.cluster.connect import ray_session
from orchestrator.cluster.drafter_set import start_drafter_set
from orchestrator.cluster.drafters import DrafterSettings
from orchestrator.config import default_model_path, default_stage_paths
from speculators.prompt_lookup import PromptLookupSpeculator
from stages.settings import StageSettings

PROMPT = "Explain in three sentences why the sky is blue."
MODES = ["whole", "in process", "pipeline, unpinned", "pipeline, pinned"]


def _prefill(decode_chunk, prompt: np.ndarray) -> int:
    return int(np.argmax(decode_chunk(np.arange(len(prompt), dtype=np.int32), prompt)[-1]))


def _time_whole(engine, prompt: np.ndarray, count: int, figures) -> list[int]:
    engine.remove(0)
    token = _prefill(lambda positions, tokens: engine.decode(positions, tokens=tokens), prompt)
    produced = [token]
    for index in range(count - 1):
        started = time.perf_counter()
        logits = engine.decode(np.array([len(prompt) + index], np.int32), tokens=np.array([token], np.int32))
        figures["whole: pass"].append(time.perf_counter() - started)
        token = int(np.argmax(logits[-1]))
        produced.append(token)
    return produced


def _time_in_process(engines, prompt: np.ndarray, count: int, figures) -> list[int]:
    for engine in engines:
        engine.remove(0)

    def through(positions, tokens, timing: bool = False):
        hidden = None
        for index, engine in enumerate(engines):
            started = time.perf_counter()
            hidden = (engine.decode(positions, tokens=tokens) if engine.is_first
                      else engine.decode(positions, hidden=hidden))
            if timing:
                figures[f"in process: stage {index}"].append(time.perf_counter() - started)
        return hidden

    token = _prefill(through, prompt)
    produced = [token]
    for index in range(count - 1):
        started = time.perf_counter()
        logits = through(np.array([len(prompt) + index], np.int32), np.array([token], np.int32), timing=True)
        figures["in process: pass"].append(time.perf_counter() - started)
        token = int(np.argmax(logits[-1]))
        produced.append(token)
    return produced


def _time_pipeline(pipeline, prompt: np.ndarray, count: int, figures, label: str) -> list[int]:
    reply = pipeline.forward(np.arange(len(prompt), dtype=np.int32), prompt, 0)
    token = int(np.argmax(reply.logits[-1]))
    produced = [token]
    received = time.perf_counter()
    for index in range(count - 1):
        position = len(prompt) + index
        sent = time.perf_counter()
        figures[f"{label}: coordinator"].append(sent - received)
        reply = pipeline.forward(np.array([position], np.int32), np.array([token], np.int32), position)
        received = time.perf_counter()
        wall = received - sent
        figures[f"{label}: pass"].append(wall)
        for stage_index, seconds in enumerate(reply.stage_seconds):
            figures[f"{label}: stage {stage_index} compute"].append(seconds)
        figures[f"{label}: transport, all hops"].append(wall - sum(reply.stage_seconds))
        token = int(np.argmax(reply.logits[-1]))
        produced.append(token)
    return produced


def _time_asks(pipeline, prompt: np.ndarray, count: int) -> list[float]:

    drafter_set = start_drafter_set(pipeline, "ngram", PromptLookupSpeculator, DrafterSettings(draft_max=8))
    drafters = drafter_set.drafters
    try:
        asks = []
        for index in range(count):
            position = len(prompt) + index
            pipeline.forward(np.array([position], np.int32), np.array([prompt[-1]], np.int32), position)
            started = time.perf_counter()
            drafters[0].speculate(prompt.tolist(), 1)
            drafters[0].collect(wait=True)
            asks.append(time.perf_counter() - started)
        return asks
    finally:
        drafter_set.stop()


@probe("where-time-goes", repetitions=3)
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(2), help="Tokens per mode and repetition.")
def where_time_goes(repetitions: int, tokens: int) -> Report:
    """A plain pipeline's per-token time cut into stage compute, hops and the
    coordinator, beside the whole model and the stages in one process; pinned
    and unpinned; and a drafter actor's ask (the default model, Ray)."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings
    from stages.engine import StageEngine
    from stages.tokenizer import Tokenizer

    paths, settings = default_stage_paths(), StageSettings(n_ctx=512)
    prompt = np.asarray(Tokenizer(paths[0]).chat_prompt(PROMPT), np.int32)
    whole = StageEngine(str(default_model_path()), settings)
    engines = [StageEngine(path, settings) for path in paths]
    with ray_session(None), PipelineSettings(paths, settings).start() as pipeline:
        def run(mode: str, repetition: int) -> Outcome:
            figures: dict[str, list[float]] = defaultdict(list)
            if mode == "whole":
                produced = _time_whole(whole, prompt, tokens, figures)
            elif mode == "in process":
                produced = _time_in_process(engines, prompt, tokens, figures)
            elif mode == "pipeline, unpinned":
                pipeline.set_stage_cpus([None] * len(paths))
                produced = _time_pipeline(pipeline, prompt, tokens, figures, mode)
            else:
                pipeline.pin_stages(overlapping=False)
                produced = _time_pipeline(pipeline, prompt, tokens, figures, mode)
                figures["pipeline, pinned: drafter ask"] = _time_asks(pipeline, prompt, tokens)
            return Outcome({name: statistics.median(values) for name, values in figures.items()}, produced)

        samples = side_by_side(MODES, repetitions, run)
    rows = [[name, samples.spread(mode, name, 1e3)] for mode in MODES for name in samples.figures(mode)]
    whole_pass = samples.median("whole", "whole: pass")
    pinned_pass = samples.median("pipeline, pinned", "pipeline, pinned: pass")
    ask = samples.median("pipeline, pinned", "pipeline, pinned: drafter ask") / pinned_pass
    ratios = "; ".join(f"{mode} / whole: {whole_pass / samples.median(mode, f'{mode}: pass'):.3f}"
                       for mode in MODES[1:])
    lines = [*table([f"per pass ({tokens - 1} one-token passes a repetition)", "ms, median (range)"], rows), "",
             f"a drafter ask costs {ask:.3f} of a pinned pipeline pass", "",
             f"tokens/s {ratios}; every mode's tokens identical"]
    return Report(f"Where a plain pipeline's per-token time goes: the default model in {len(paths)} stages, one "
                  "thread each, greedy, one token a pass", lines, {"": samples})
