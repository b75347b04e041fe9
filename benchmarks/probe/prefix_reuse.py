"""``python -m benchmarks.probe prefix-reuse``: what the service saves by
prefilling a prompt's prefix once (orchestrator.decoding.prefix_cache), the
default model in 2 stages on a local Ray, the cache on and off side by side:

* a chat's second turn over a long first turn (its prompt and reply): the
  second turn's time to its first token;
* 8 requests sharing a long system prompt, submitted at once: the time
  until every one has its first token (the total prefill);
* n = 4 choices against n = 1 of the same request, wall time, under an
  emulated cost curve (``--cost-curve``, default the 405B setup at 40 ms:
  there a pass of 4 rows costs about what one does).

Every mode's tokens must agree with the cache off (the cache changes no token).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import click
import numpy as np

from benchmarks.probe.harness import Report, probe, table
from benchmarks.side_by_side import Outcome, side_by_side
from orchestrator.cluster.connect import ray_session
from orchestrator.config import default_stage_paths
from orchestrator.decoding.service import Progress, Service, ServiceRequest, ServiceSettings
from orchestrator.planning.curves import load_cost_curve
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

EMULATED = "benchmarks/setups/llama-405b-two-machines.toml@40"


def _text(length: int, seed: int) -> list[int]:
    """Token ids of a prompt (deterministic, no repeats within a repetition's prompts)."""
    return (np.random.default_rng(seed).integers(100, 40000, length)).tolist()


class _Timed:
    """Submits requests to a service; for each, when its first token and its end came."""

    def __init__(self, service):
        self.service = service
        self.first: dict[int, float] = {}
        self.tokens: dict[int, list[int]] = {}
        self._ends = threading.Semaphore(0)

    def run(self, requests) -> float:
        """Submit every request at once; the seconds until all have ended."""
        started = time.perf_counter()
        for index, request in enumerate(requests):
            def sink(progress: Progress, index=index) -> None:
                if progress.tokens and index not in self.first:
                    self.first[index] = time.perf_counter() - started
                self.tokens.setdefault(index, []).extend(progress.tokens)
                if progress.finished is not None:
                    self._ends.release()
            self.service.submit(request, sink)
        for _ in range(sum(request.choices for request in requests)):
            assert self._ends.acquire(timeout=600), "a request did not end"
        return time.perf_counter() - started


def _service(pipeline, cache: bool, **settings):
    stage = pipeline.settings
    return Service(pipeline, lambda token: False, ServiceSettings(
        max_sequences=stage.sequences, queue_limit=16, context=stage.n_ctx,
        prefix_sequences=stage.prefix_sequences if cache else 0,
        prefix_tokens=stage.prefix_sequences * stage.n_ctx if cache else 0, **settings))


def _chat_turn(pipeline, cache: bool, repetition: int, first_turn: int) -> Outcome:

    service = _service(pipeline, cache)
    try:
        first = ServiceRequest(_text(first_turn, repetition), 16, SamplingSettings())
        timed = _Timed(service)
        timed.run([first])
        second = ServiceRequest(first.prompt_tokens + timed.tokens[0] + _text(30, 10_000 + repetition), 16,
                                SamplingSettings())
        timed = _Timed(service)
        timed.run([second])
        return Outcome({"first_token_seconds": timed.first[0]}, timed.tokens[0])
    finally:
        service.close(drain_seconds=5)


def _shared_system_prompt(pipeline, cache: bool, repetition: int, system: int) -> Outcome:

    shared = _text(system, 20_000 + repetition)
    requests = [ServiceRequest(shared + _text(20, 30_000 + 8 * repetition + index), 4, SamplingSettings())
                for index in range(8)]
    service = _service(pipeline, cache)
    try:
        timed = _Timed(service)
        timed.run(requests)
        return Outcome({"prefill_seconds": max(timed.first.values())}, [timed.tokens[index] for index in range(8)])
    finally:
        service.close(drain_seconds=5)


def _choices(pipeline, choices: int, repetition: int, step: float) -> Outcome:

    request = ServiceRequest(_text(200, 40_000 + repetition), 32, SamplingSettings(temperature=1.0, seed=repetition),
                             choices=choices)
    service = _service(pipeline, cache=False, batch_step=step)
    try:
        seconds = _Timed(service).run([request])
        return Outcome({"seconds": seconds})
    finally:
        service.close(drain_seconds=5)


@probe("prefix-reuse", repetitions=3)
@click.option("--first-turn", default=1500, show_default=True, type=click.IntRange(16, 1800),
              help="Tokens of the chat's first turn.")
@click.option("--system-prompt", default=1000, show_default=True, type=click.IntRange(16, 1800),
              help="Tokens of the system prompt 8 requests share.")
@click.option("--cost-curve", "curve_spec", default=EMULATED, show_default=True,
              help="The emulated curve n = 4 against n = 1 runs under.")
def prefix_reuse(repetitions: int, first_turn: int, system_prompt: int, curve_spec: str) -> Report:
    """A prefix prefilled once: a chat's second turn, 8 requests sharing a
    system prompt (cache on and off), and n = 4 against n = 1 under an emulated curve."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings

    settings = StageSettings(n_ctx=2048, sequences=8, prefix_sequences=4)
    samples, lines = {}, []
    with ray_session(None):
        with PipelineSettings(default_stage_paths(), settings).start(overlapping=True) as pipeline:
            for label, figure, run in (
                    ("chat", "first_token_seconds", lambda mode, rep: _chat_turn(pipeline, mode == "cache-on", rep,
                                                                                 first_turn)),
                    ("system", "prefill_seconds", lambda mode, rep: _shared_system_prompt(
                        pipeline, mode == "cache-on", rep, system_prompt))):
                samples[label] = side_by_side(["cache-off", "cache-on"], repetitions, run)
                off, on = (samples[label].median(mode, figure) for mode in ("cache-off", "cache-on"))
                lines += [*table(["mode", f"{figure} (ms)", "x cache off"],
                                 [[mode, samples[label].spread(mode, figure, 1e3, 0),
                                   f"{samples[label].median(mode, figure) / off:.2f}"]
                                  for mode in ("cache-off", "cache-on")]), ""]
                samples[label + "_ratio"] = on / off
        curve = load_cost_curve(curve_spec)
        with PipelineSettings(default_stage_paths(), replace(settings, cost_curve=curve)).start(overlapping=True) as emulated:
            step = emulated.draft_step(sequence=0)
            samples["choices"] = side_by_side(["n=1", "n=4"], repetitions,
                                              lambda mode, rep: _choices(emulated, int(mode[2:]), rep, step))
            base = samples["choices"].median("n=1", "seconds")
            lines += table(["mode", "wall seconds", "x n=1"],
                           [[mode, samples["choices"].spread(mode, "seconds", 1, 2),
                             f"{samples['choices'].median(mode, 'seconds') / base:.2f}"] for mode in ("n=1", "n=4")])
            lines += ["", f"n = 4 under the emulated curve {curve.name} (measured step {step:.2f})."]
    return Report(f"Prefixes prefilled once: SmolLM2-135M in 2 stages on a local Ray; a chat's second turn over a "
                  f"{first_turn}-token first turn (time to first token), 8 requests sharing a {system_prompt}-token "
                  "system prompt (until every first token), cache off and on; ratios of medians",
                  lines, {key: value for key, value in samples.items() if not key.endswith("_ratio")},
                  {key: value for key, value in samples.items() if key.endswith("_ratio")})
