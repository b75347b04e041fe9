"""``orchestrate profile``: measure what the planner needs, on this machine.

* Stage time for a batch of n tokens (n = 1, 2, 4, ... 64), for each stage file
  and for the whole model, in this process (one engine each, after a context of
  ``context`` positions, the batch rolled back after every repetition; medians).
  From these: a block's time, the output head's time and a pass's fixed time
  for each n (``costs.MeasuredMachine``), so the planner can price any split.
* The drafter's time per draft token: prompt lookup on a context of
  ``context`` tokens, and a draft model if one is given.
* The hop time, from a short plain generation through the real pipeline on a
  local Ray (the pipeline measures each pass's wall time minus its stages'
  compute); the bytes per second of a large frame over a local socket.
* The coordinator's own time per pass (the decoding loop against a target
  that answers at once) and the time to verify one more logits row.

The profile is one JSON file (schema in ``profile_schema``); ``plan`` reads it.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PROFILE_KIND = "specpipe-profile"
PROFILE_VERSION = 1
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXT = 128


@dataclass(frozen=True)
class ProfileSettings:
    stage_paths: list[str]
    whole_path: str
    draft_path: str | None = None
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    repetitions: int = 7
    context: int = DEFAULT_CONTEXT
    threads: int = 1
    pipeline_tokens: int = 48


def _median_seconds(action: Callable[[], object], repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_stages(settings: ProfileSettings, progress: Callable[[int, int], None]) -> tuple[list[dict], dict]:
    """Median seconds per batch size for each stage (fed its real input) and the whole model."""
    from stages.engine import StageEngine, StageSettings

    engine_settings = StageSettings(n_ctx=settings.context + max(settings.batch_sizes) + 16, threads=settings.threads)
    stages = [StageEngine(path, engine_settings) for path in settings.stage_paths]
    whole = StageEngine(settings.whole_path, engine_settings)
    rng = np.random.default_rng(0)
    context_tokens = rng.integers(100, 10000, settings.context).astype(np.int32)
    context_positions = np.arange(settings.context, dtype=np.int32)

    def chain(positions: np.ndarray, tokens: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        """Every stage's input for this batch (running the chain once)."""
        inputs, value = [], tokens
        for stage in stages:
            inputs.append(value)
            stage.remove(int(positions[0]))
            value = stage.decode(positions, **({"tokens": value} if stage.is_first else {"hidden": value}), logit_rows=rows)
        return inputs

    chain(context_positions, context_tokens, np.array([settings.context - 1], dtype=np.int32))
    whole.decode(context_positions, tokens=context_tokens)
    stage_seconds: list[list[float]] = [[] for _ in stages]
    whole_seconds: list[float] = []
    total = len(settings.batch_sizes)
    for done, size in enumerate(settings.batch_sizes):
        positions = np.arange(settings.context, settings.context + size, dtype=np.int32)
        tokens = rng.integers(100, 10000, size).astype(np.int32)
        rows = np.arange(size, dtype=np.int32)  # a verification pass wants every row's logits
        inputs = chain(positions, tokens, rows)
        for index, stage in enumerate(stages):
            keyword = {"tokens": inputs[index]} if stage.is_first else {"hidden": inputs[index]}

            def one_pass(stage=stage, keyword=keyword) -> None:
                stage.remove(settings.context)
                stage.decode(positions, logit_rows=rows if stage.is_last else None, **keyword)

            stage_seconds[index].append(_median_seconds(one_pass, settings.repetitions))

        def whole_pass() -> None:
            whole.remove(settings.context)
            whole.decode(positions, tokens=tokens, logit_rows=rows)

        whole_seconds.append(_median_seconds(whole_pass, settings.repetitions))
        progress(done + 1, total)
    described = [
        {"path": stage.path, "first_block": stage.first_block, "end_block": stage.end_block, "is_last": stage.is_last,
         "seconds": seconds}
        for stage, seconds in zip(stages, stage_seconds)
    ]
    whole_description = {"path": whole.path, "blocks": whole.block_count, "width": whole.n_embd,
                         "vocab": whole.n_vocab, "seconds": whole_seconds}
    for engine in [*stages, whole]:
        engine.close()
    return described, whole_description


def split_costs(stages: list[dict], whole: dict) -> dict[str, list[float]]:
    """Per batch size: a block's time, the head's, and a pass's fixed time.

    Non-last stage i: fixed + blocks_i * block; last: fixed + blocks * block +
    head; whole: fixed + all blocks * block + head. With k >= 2 stages the sum
    of the stages holds k fixed costs and the whole model one, which gives the
    fixed cost; the non-last stages then give the block, the last the head.
    Noise can push a derived time below zero; it is clamped at zero."""
    if len(stages) < 2:
        raise ValueError("profiling the costs of a split needs at least two stage files")
    sizes = len(whole["seconds"])
    fixed, block, head = [], [], []
    for column in range(sizes):
        stage_sum = sum(stage["seconds"][column] for stage in stages)
        fixed_time = max(0.0, (stage_sum - whole["seconds"][column]) / (len(stages) - 1))
        inner = stages[:-1]
        inner_blocks = sum(stage["end_block"] - stage["first_block"] for stage in inner)
        block_time = max(0.0, sum(stage["seconds"][column] - fixed_time for stage in inner) / inner_blocks)
        last = stages[-1]
        head_time = last["seconds"][column] - fixed_time - (last["end_block"] - last["first_block"]) * block_time
        fixed.append(fixed_time)
        block.append(block_time)
        head.append(max(0.0, head_time))
    return {"fixed_seconds": fixed, "block_seconds": block, "head_seconds": head}


def measure_drafters(settings: ProfileSettings) -> dict:
    """Seconds per draft token: prompt lookup, and the draft model if given."""
    from speculators.prompt_lookup import PromptLookupSpeculator

    rng = np.random.default_rng(1)
    context = rng.integers(100, 10000, settings.context + 64).tolist()
    lookup = PromptLookupSpeculator()
    result = {"ngram": _median_seconds(lambda: lookup.extend(context), 50)}
    if settings.draft_path:
        from speculators.model import ModelSpeculator

        draft = ModelSpeculator(settings.draft_path, n_ctx=len(context) + 64, threads=settings.threads)
        draft.extend(context)
        growing = list(context)

        def one_token() -> None:
            growing.append(draft.extend(growing) or 0)

        result["model"] = _median_seconds(one_token, 32)
        result["model_path"] = settings.draft_path
        draft.engine.close()
    return result


def measure_socket_bandwidth(payload_bytes: int = 8 * 1024 * 1024, repetitions: int = 5) -> float:
    """Bytes per second of one large frame over a local TCP socket (orchestrator.wire)."""
    from orchestrator import wire
    from orchestrator.messages import PassResult

    listener = wire.listen("127.0.0.1")
    received = threading.Event()

    def sink() -> None:
        connection, _ = listener.accept()
        wire.tune(connection)
        for _ in range(repetitions + 1):
            wire.receive_message(connection)
            received.set()
        connection.close()

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    sender = wire.connect("127.0.0.1", listener.getsockname()[1])
    rows = payload_bytes // (4 * 1024)
    message = PassResult(1, np.zeros((rows, 1024), dtype=np.float32), (0.0,))
    times = []
    for repetition in range(repetitions + 1):
        received.clear()
        started = time.perf_counter()
        wire.send_message(sender, message)
        received.wait(30)
        if repetition:  # the first warms the buffers
            times.append(time.perf_counter() - started)
    thread.join(10)
    sender.close()
    listener.close()
    return payload_bytes / statistics.median(times)


def measure_verification(vocab: int) -> float:
    """Seconds to verify one logits row (greedy)."""
    from orchestrator.sampling import SamplingSettings
    from speculators.verify import verify

    logits = np.random.default_rng(2).standard_normal((9, vocab)).astype(np.float32)
    drafts = [int(np.argmax(row)) for row in logits[:-1]]
    return _median_seconds(lambda: verify(drafts, logits, 0, SamplingSettings()), 20) / 9


class _InstantTarget:
    """A pipeline that answers every pass at once with zero logits: timing
    generate() against it leaves the coordinator's own time per pass."""

    n_batch = 512

    def __init__(self, vocab: int):
        self.logits = np.zeros((64, vocab), dtype=np.float32)
        self.pending: deque[int] = deque()

    def submit(self, positions, tokens, keep, logit_rows=None) -> None:
        self.pending.append(1 if logit_rows is None else len(logit_rows))

    def receive(self):
        from orchestrator.messages import PassResult

        return PassResult(0, self.logits[: self.pending.popleft()], (0.0,))

    def forward(self, positions, tokens, keep, logit_rows=None):
        self.submit(positions, tokens, keep, logit_rows)
        return self.receive()


def measure_coordinator(vocab: int, tokens: int = 400) -> float:
    """Seconds of the decoding loop's own work per plain pass (verification of
    one row, bookkeeping), with a target that takes no time."""
    from orchestrator.generate import generate
    from orchestrator.sampling import SamplingSettings

    target = _InstantTarget(vocab)
    generate(target, [1, 2, 3], 20, SamplingSettings(), lambda token: False)  # warm-up
    started = time.perf_counter()
    result = generate(target, [1, 2, 3], tokens, SamplingSettings(), lambda token: False)
    return (time.perf_counter() - started) / result.passes


def measure_pipeline(settings: ProfileSettings) -> dict:
    """The hop time from a short plain generation on a local Ray: the pipeline
    measures each pass's wall time minus its stages' compute."""
    from orchestrator.defaults import DEFAULT_PROMPT
    from orchestrator.sampling import SamplingSettings
    from orchestrator.session import RunSettings, run_generation
    from stages.engine import StageSettings

    outcome = run_generation(RunSettings(
        stage_paths=settings.stage_paths, prompt=DEFAULT_PROMPT, chat=True, max_tokens=settings.pipeline_tokens,
        sampling=SamplingSettings(), stage=StageSettings(threads=settings.threads),
    ))
    return {"hop_seconds": outcome.hop_seconds, "pipeline_tokens_per_second": outcome.generation.tokens_per_second}


def profile_machine(settings: ProfileSettings, progress: Callable[[int, int], None] = lambda done, total: None,
                    status: Callable[[str], None] = lambda line: None) -> dict:
    import platform

    status("timing stage batches")
    stages, whole = measure_stages(settings, progress)
    status("timing drafters, sockets and verification")
    drafters = measure_drafters(settings)
    bandwidth = measure_socket_bandwidth()
    row_seconds = measure_verification(whole["vocab"])
    coordinator = measure_coordinator(whole["vocab"])
    status("timing the pipeline on a local Ray")
    pipeline = measure_pipeline(settings)
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "threads_per_stage": settings.threads},
        "context": settings.context,
        "batch_sizes": list(settings.batch_sizes),
        "repetitions": settings.repetitions,
        "model": whole,
        "stages": stages,
        **split_costs(stages, whole),
        "drafter_seconds_per_token": drafters,
        "socket_bytes_per_second": bandwidth,
        "coordinator_row_seconds": row_seconds,
        "coordinator_pass_seconds": coordinator,
        **pipeline,
    }
