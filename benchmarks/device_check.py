"""The device check: what a lent GPU machine is for, measured in one short run.

``python -m benchmarks.device_check --out DIR`` (``make device-check`` on the
device machine, docs/backends.md "The device check") writes DIR/device-check.json
and DIR/device-check.md:

* backend: the devices this llama.cpp build computes on, and layers offloaded;
* cost curve: t(n), the whole model's pass of n = 1..64 tokens after a
  context, medians, and t(n)/t(1) (the curve every speculation decision prices);
* whole against split: greedy decoding through the whole model and through
  its 2 stages, tokens/s side by side (stages one after the other in this
  process: the split's cost, not a pipeline's overlap);
* prompt lookup on the rewrite scenario's prompts: plain, sync and async,
  through the 2 stages;
* exactness: one run with async prompt lookup and token trees through the
  stages, recorded and replayed through the whole model (split-exact, bit for
  bit), its windows walked (lossless), its chains fed one token at a time
  (batch-invariant, promised on the CPU build only); and agreement: how many
  speculative runs gave one-token decoding's exact tokens, and where the others parted;
* service: the request loop of ``orchestrate serve`` at 1, 4 and 8
  concurrent requests over the stages (no HTTP, no Ray Serve).

It runs without Ray, FastAPI or a model file (the device machine has none of
them, nor a network): the model is a random-weight Llama-shaped one made here
(benchmarks.random_model), of the shape ``--shape`` names. The CPU form runs in
``make test`` (tests/model/test_device_check.py) with ``--shape tiny --quick``.

Exit status 1 when a promised property fails: split-exact or lossless on any
backend, batch-invariant on the CPU build.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.random_model import SHAPES, ModelShape, write_random_model
from orchestrator.decoding.drafting import Drafting, tree_stage_settings
from orchestrator.decoding.loop import generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.service import Service, ServiceRequest, ServiceSettings
from orchestrator.decoding.targets import InstantDrafter
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.backend import StageCompute, detect
from stages.settings import StageSettings
from stages.split import split_model

REWRITE_SCENARIO = Path(__file__).parent / "scenarios" / "rewrite.toml"
PASS_SIZES = tuple(range(1, 65))
CONCURRENCY = (1, 4, 8)
DRAFT_MAX = 8
TREE_LEAVES = 4  # the exactness run's token trees


@dataclass(frozen=True)
class CheckSettings:
    """tokens: generated per run; repetitions: of each timed thing (medians over them);
    context: positions before each timed pass; n_gpu_layers: as ``--n-gpu-layers``."""

    shape: ModelShape
    work: Path
    tokens: int = 64
    repetitions: int = 5
    context: int = 256
    n_gpu_layers: int = -1

    def stage_settings(self, **more):
        return StageSettings(n_ctx=2048, n_gpu_layers=self.n_gpu_layers, **more)


def progress(text: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def make_model(settings: CheckSettings) -> tuple[str, list[str]]:
    """The random model and its 2 stage files under settings.work (kept: a rerun reuses them)."""
    settings.work.mkdir(parents=True, exist_ok=True)
    name = f"random-{settings.shape.blocks}x{settings.shape.width}"
    whole = settings.work / f"{name}.gguf"
    stages = [settings.work / f"{name}-stage{index}.gguf" for index in range(2)]
    if not whole.exists():
        progress(f"writing {whole.name} ({settings.shape.file_bytes / 1e9:.2f} GB of random Q8_0 weights)")
        write_random_model(whole, settings.shape)
    if not all(stage.exists() for stage in stages):
        progress("splitting it in 2 stages")
        split_model(whole, stages)
    return str(whole), [str(stage) for stage in stages]


def backend_section(whole_path: str, settings: CheckSettings) -> dict:
    backend = detect()
    compute = StageCompute.of(backend, settings.n_gpu_layers, settings.shape.blocks)
    free, total = backend.offload_memory()
    return {**compute.record(), "device_memory_free": free, "device_memory_total": total}


def cost_curve(whole_path: str, settings: CheckSettings) -> dict:
    """t(n): median seconds of a pass of n tokens (every row's logits) after settings.context positions."""
    from stages.engine import StageEngine

    engine = StageEngine(whole_path, settings.stage_settings(n_batch=max(PASS_SIZES)))
    try:
        rng = np.random.default_rng(0)
        context = rng.integers(3, settings.shape.vocab, settings.context).astype(np.int32)
        engine.decode(np.arange(settings.context, dtype=np.int32), tokens=context)
        seconds = []
        for size in PASS_SIZES:
            positions = np.arange(settings.context, settings.context + size, dtype=np.int32)
            tokens = rng.integers(3, settings.shape.vocab, size).astype(np.int32)
            rows = np.arange(size, dtype=np.int32)
            times = []
            for _ in range(settings.repetitions + 1):  # the first warms this size
                engine.remove(settings.context)
                started = time.perf_counter()
                engine.decode(positions, tokens=tokens, logit_rows=rows)
                times.append(time.perf_counter() - started)
            seconds.append(statistics.median(times[1:]))
    finally:
        engine.close()
    return {"sizes": list(PASS_SIZES), "seconds": seconds, "ratio": [value / seconds[0] for value in seconds]}


def rewrite_prompts(tokenizer) -> list[list[int]]:
    """The rewrite scenario's prompts as plain text (a random model has no chat template)."""
    prompts = tomllib.loads(REWRITE_SCENARIO.read_text())["prompts"]
    return [tokenizer.tokenize(prompt) for prompt in prompts]


def timed_generation(chain, prompt: list[int], settings: CheckSettings, drafting_for=None):
    """(tokens, tokens/s, acceptance) of one greedy generation; drafting_for() makes its drafting."""

    drafting = drafting_for() if drafting_for else None
    result = generate(chain, prompt, settings.tokens, SamplingSettings(), lambda token: False, drafting=drafting)
    chain.release(0)
    return result.tokens, result.tokens_per_second, result.speculation.acceptance_rate


def lookup_drafting(schedule, stage_count: int):

    def drafting():
        speculator = PromptLookupSpeculator()
        return Drafting([InstantDrafter(speculator, DRAFT_MAX) for _ in range(stage_count)], schedule, DRAFT_MAX,
                        first=InstantDrafter(speculator, DRAFT_MAX), call_cost=0.0)
    return drafting


def compare_modes(chains: dict, prompts: list[list[int]], settings: CheckSettings) -> dict:
    """Each mode (chain, drafting) on every prompt, repeated; the modes interleaved within each repetition."""
    rates: dict[str, list[float]] = {mode: [] for mode in chains}
    outputs: dict[str, list[list[int]]] = {mode: [] for mode in chains}
    acceptance: dict[str, list[float]] = {mode: [] for mode in chains}
    for repetition in range(settings.repetitions):
        for prompt in prompts:
            for mode, (chain, drafting_for) in chains.items():
                tokens, rate, accepted = timed_generation(chain, prompt, settings, drafting_for)
                rates[mode].append(rate)
                acceptance[mode].append(accepted)
                if repetition == 0:
                    outputs[mode].append(tokens)
    return {mode: {"tokens_per_second": spread(rates[mode]), "acceptance": statistics.median(acceptance[mode]),
                   "outputs": outputs[mode]} for mode in chains}


def generation_sections(whole_path: str, stage_paths: list[str], settings: CheckSettings) -> dict:
    """Whole against split, and prompt lookup plain / sync / async, with the agreement of every output."""
    from orchestrator.exactness import agreement
    from orchestrator.in_process import InProcessPipeline
    from stages.tokenizer import Tokenizer

    prompts = rewrite_prompts(Tokenizer(whole_path))
    whole, split = InProcessPipeline([whole_path], settings.stage_settings()), InProcessPipeline(stage_paths, settings.stage_settings())
    try:
        progress("whole model against its 2 stages, plain greedy decoding")
        whole_split = compare_modes({"whole": (whole, None), "split": (split, None)}, prompts, settings)
        progress("prompt lookup on the rewrite prompts: plain, sync, async")
        lookup = compare_modes({"plain": (split, None), "sync": (split, lookup_drafting(Schedule.SYNC, 2)),
                                "async": (split, lookup_drafting(Schedule.ASYNC, 2))}, prompts, settings)
    finally:
        whole.close()
        split.close()
    reference = whole_split["whole"]["outputs"]  # one token per pass: one-token decoding of the whole model
    runs = [(tokens, expected) for mode in ("split",) for tokens, expected in zip(whole_split[mode]["outputs"], reference)]
    runs += [(tokens, expected) for mode in ("plain", "sync", "async") for tokens, expected in zip(lookup[mode]["outputs"], reference)]
    found = agreement(runs)
    for section in (whole_split, lookup):
        for mode in section.values():
            del mode["outputs"]
    return {"whole_against_split": whole_split, "prompt_lookup": lookup,
            "agreement": {"runs": found.runs, "identical": found.identical, "fraction": found.fraction,
                          "first_divergence": list(found.first_divergence)}}


def exactness_section(whole_path: str, stage_paths: list[str], settings: CheckSettings) -> dict:
    """One recorded run (async prompt lookup, trees of up to 4 leaves) and the three properties on it."""
    from orchestrator.exactness import (RecordingChain, first_batch_difference, first_lossless_violation,
                                        first_split_difference, record_run, replay)
    from stages.engine import StageEngine
    from stages.tokenizer import Tokenizer

    stage_settings = tree_stage_settings(settings.stage_settings(), TREE_LEAVES)
    prompt = rewrite_prompts(Tokenizer(whole_path))[0]
    chain = RecordingChain(stage_paths, stage_settings)
    try:
        drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in stage_paths], Schedule.ASYNC, 6,
                            call_cost=0.0, step=0.0, tree_leaves=TREE_LEAVES)
        run = record_run(chain, prompt, settings.tokens, SamplingSettings(), drafting)
    finally:
        chain.close()
    whole = StageEngine(whole_path, stage_settings)
    try:
        split_difference = first_split_difference(run.events, replay(whole, run.events))
        batch_difference, rows = first_batch_difference(whole, run.events)
    finally:
        whole.close()
    lossless = first_lossless_violation(run)
    return {"passes": len(run.passes), "tree_passes": sum(event.parents is not None for event in run.passes),
            "split_exact": split_difference is None, "split_difference": split_difference,
            "lossless": lossless is None, "lossless_violation": lossless,
            "batch_invariant": batch_difference is None, "batch_difference": batch_difference, "rows_compared": rows}


def serve_section(stage_paths: list[str], settings: CheckSettings) -> dict:
    """orchestrate serve's request loop over the stages: c requests at once, for c in CONCURRENCY."""
    from orchestrator.in_process import InProcessPipeline

    rng = np.random.default_rng(2)
    chain = InProcessPipeline(stage_paths, settings.stage_settings(sequences=max(CONCURRENCY)))
    results = {}
    try:
        for concurrency in CONCURRENCY:
            service = Service(chain, lambda token: False, ServiceSettings(max_sequences=max(CONCURRENCY), queue_limit=0,
                                                                          context=2048))
            prompts = [rng.integers(3, settings.shape.vocab, 32).tolist() for _ in range(concurrency)]
            seconds = _serve_all(service, [ServiceRequest(prompt, settings.tokens, SamplingSettings()) for prompt in prompts])
            service.close(drain_seconds=5.0)
            results[str(concurrency)] = {"seconds": seconds, "tokens_per_second": concurrency * settings.tokens / seconds}
    finally:
        chain.close()
    return results


def _serve_all(service, requests) -> float:
    ended = threading.Semaphore(0)
    failures = []

    def sink(progress_) -> None:
        if progress_.finished is not None:
            if progress_.finished != "length":
                failures.append(progress_.error or progress_.finished)
            ended.release()

    started = time.perf_counter()
    for request in requests:
        service.submit(request, sink)
    for _ in requests:
        if not ended.acquire(timeout=600):
            raise TimeoutError("a request of the service check did not end within 600 s")
    if failures:
        raise RuntimeError(f"service check: {failures[0]}")
    return time.perf_counter() - started


def failures(result: dict) -> list[str]:
    """The promised properties that failed (batch invariance is promised on the CPU build only)."""
    exactness = result["exactness"]
    failed = [] if exactness["split_exact"] else [f"split-exact: {exactness['split_difference']}"]
    failed += [] if exactness["lossless"] else [f"lossless: {exactness['lossless_violation']}"]
    if result["backend"]["backend"] == "cpu":
        failed += [] if exactness["batch_invariant"] else [f"batch-invariant: {exactness['batch_difference']}"]
        if result["agreement"]["fraction"] < 1.0:
            failed += [f"agreement {result['agreement']['fraction']:.2f} on the CPU build, where it is promised"]
    return failed


def run_check(settings: CheckSettings, keep=lambda result: None) -> dict:
    """Every section in turn; keep(result) after each, so a run cut short by the
    device machine's time limit still leaves the sections it finished."""
    started = time.perf_counter()
    whole_path, stage_paths = make_model(settings)
    result = {"date": time.strftime("%Y-%m-%d"), "shape": settings.shape.__dict__,
              "model_bytes": Path(whole_path).stat().st_size, "tokens": settings.tokens,
              "repetitions": settings.repetitions, "context": settings.context}
    result["backend"] = backend_section(whole_path, settings)
    progress(f"backend {result['backend']['backend']}: {', '.join(result['backend']['devices'])}")
    progress("cost curve t(n), n = 1..64")
    result["cost_curve"] = cost_curve(whole_path, settings)
    keep(result)
    result.update(generation_sections(whole_path, stage_paths, settings))
    keep(result)
    progress("exactness: a recorded run with trees, replayed through the whole model")
    result["exactness"] = exactness_section(whole_path, stage_paths, settings)
    keep(result)
    progress("service at 1, 4 and 8 requests at once")
    result["service"] = serve_section(stage_paths, settings)
    result["seconds"] = time.perf_counter() - started
    result["failures"] = failures(result)
    return result


def report(result: dict) -> str:
    """The result as markdown tables (docs/backends.md takes them as they are)."""
    backend, curve = result["backend"], result["cost_curve"]
    lines = [f"# Device check, {result['date']}", "",
             f"Backend `{backend['backend']}` ({'; '.join(backend['devices'])}), "
             f"{backend['offloaded_layers']}/{backend['offloadable_layers']} layers offloaded; random-weight model "
             f"{result['shape']['blocks']} blocks x {result['shape']['width']} ({result['model_bytes'] / 1e9:.2f} GB, Q8_0); "
             f"{result['tokens']} tokens per run, {result['repetitions']} repetitions, medians [min-max].", "",
             "## Cost curve t(n)", "", "| n | t(n) ms | t(n)/t(1) |", "| --- | --- | --- |"]
    lines += [f"| {size} | {seconds * 1e3:.2f} | {ratio:.2f} |"
              for size, seconds, ratio in zip(curve["sizes"], curve["seconds"], curve["ratio"])
              if size in (1, 2, 4, 8, 16, 24, 32, 48, 64)]
    for title, key in (("Whole model against its 2 stages (greedy, plain)", "whole_against_split"),
                       ("Prompt lookup on the rewrite prompts (2 stages)", "prompt_lookup")):
        lines += ["", f"## {title}", "", "| mode | tokens/s | acceptance |", "| --- | --- | --- |"]
        for mode, figures in result[key].items():
            rate = figures["tokens_per_second"]
            lines.append(f"| {mode} | {rate['median']:.1f} [{rate['min']:.1f}-{rate['max']:.1f}] | {figures['acceptance']:.2f} |")
    exactness, agreement = result["exactness"], result["agreement"]
    lines += ["", "## Exactness", "",
              f"* split-exact: {exactness['split_exact']} over {exactness['passes']} passes "
              f"({exactness['tree_passes']} trees){'' if exactness['split_exact'] else ': ' + exactness['split_difference']}",
              f"* lossless: {exactness['lossless']}",
              f"* batch-invariant: {exactness['batch_invariant']} ({exactness['rows_compared']} rows compared)"
              f"{'' if exactness['batch_invariant'] else ': ' + exactness['batch_difference']}",
              f"* agreement with one-token decoding: {agreement['identical']}/{agreement['runs']} runs identical; "
              f"first divergent positions: {[value for value in agreement['first_divergence'] if value is not None]}",
              "", "## Service (orchestrate serve's loop, no HTTP)", "",
              "| requests at once | seconds | tokens/s (all requests) |", "| --- | --- | --- |"]
    lines += [f"| {concurrency} | {figures['seconds']:.2f} | {figures['tokens_per_second']:.1f} |"
              for concurrency, figures in result["service"].items()]
    lines += ["", f"Failures: {'; '.join(result['failures']) or 'none'}. Took {result['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for device-check.json and device-check.md")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="the random model's shape (default 8b)")
    parser.add_argument("--work", type=Path, help="where the model is written (default: OUT/model)")
    parser.add_argument("--quick", action="store_true", help="2 repetitions, a short context (the CPU form)")
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="layers offloaded (default -1: all)")
    options = parser.parse_args(argv)
    settings = CheckSettings(SHAPES[options.shape], options.work or options.out / "model",
                             tokens=64, repetitions=2 if options.quick else 5,
                             context=64 if options.quick else 256, n_gpu_layers=options.n_gpu_layers)
    options.out.mkdir(parents=True, exist_ok=True)
    unfinished = options.out / "device-check-unfinished.json"
    result = run_check(settings, keep=lambda so_far: _write(unfinished, json.dumps(so_far, indent=1)))
    for name, text in (("device-check.json", json.dumps(result, indent=1)), ("device-check.md", report(result))):
        _write(options.out / name, text)
    unfinished.unlink(missing_ok=True)
    print(report(result))
    for failure in result["failures"]:
        print(f"device check: {failure}", file=sys.stderr)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
