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
timed between one-token passes of the pinned pipeline, as a share of the
pass: the draft policy's call cost (speculators.draft_length).

For the pipeline each pass is cut into the stages' own compute (as each
stage times its decode), the transport of all hops (wall time of the pass
minus that compute), and the coordinator's own work between a result and
the next pass (argmax, bookkeeping). The modes take turns repetition by
repetition, so a slow spell of this VM falls on all of them; medians per
pass, and the range of the repetitions' medians.

    python -m benchmarks.where_time_goes [--tokens 64] [--repetitions 3]

The default model (SmolLM2-135M split in two), one thread per stage.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import click
import numpy as np

PROMPT = "Explain in three sentences why the sky is blue."


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
    from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
    from speculators.prompt_lookup import PromptLookupSpeculator

    drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=8))
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
        stop_drafters(drafters)


@click.command()
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(2))
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
def main(tokens: int, repetitions: int) -> None:
    from orchestrator.cluster.connect import ray_session
    from orchestrator.config import default_model_path, default_stage_paths
    from orchestrator.cluster.pipeline import Pipeline
    from stages.tokenizer import Tokenizer
    from stages.engine import StageEngine
    from stages.settings import StageSettings

    paths, settings = default_stage_paths(), StageSettings(n_ctx=512)
    prompt = np.asarray(Tokenizer(paths[0]).chat_prompt(PROMPT), np.int32)
    whole = StageEngine(str(default_model_path()), settings)
    engines = [StageEngine(path, settings) for path in paths]
    medians: dict[str, list[float]] = defaultdict(list)
    with ray_session(None), Pipeline(paths, settings) as pipeline:
        for _ in range(repetitions):
            figures: dict[str, list[float]] = defaultdict(list)
            outputs = [_time_whole(whole, prompt, tokens, figures), _time_in_process(engines, prompt, tokens, figures)]
            pipeline.set_stage_cpus([None] * len(paths))
            outputs.append(_time_pipeline(pipeline, prompt, tokens, figures, "pipeline, unpinned"))
            pipeline.pin_stages(overlapping=False)
            outputs.append(_time_pipeline(pipeline, prompt, tokens, figures, "pipeline, pinned"))
            if any(output != outputs[0] for output in outputs):
                raise SystemExit("the modes produced different tokens")
            figures["pipeline, pinned: drafter ask"] = _time_asks(pipeline, prompt, tokens)
            for name, values in figures.items():
                medians[name].append(statistics.median(values))
    print(f"| per pass ({tokens - 1} one-token passes x {repetitions} repetitions) | ms, median (range) |")
    print("| --- | ---: |")
    for name, values in medians.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}) |")
    whole_pass = statistics.median(medians["whole: pass"])
    ask = statistics.median(medians["pipeline, pinned: drafter ask"]) / statistics.median(medians["pipeline, pinned: pass"])
    print(f"\na drafter ask costs {ask:.3f} of a pinned pipeline pass")
    ratios = "; ".join(f"{mode} / whole: {whole_pass / statistics.median(medians[f'{mode}: pass']):.3f}"
                       for mode in ("in process", "pipeline, unpinned", "pipeline, pinned"))
    print(f"\ntokens/s {ratios}; every mode's tokens identical")


if __name__ == "__main__":
    main()
