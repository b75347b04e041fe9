"""``orchestrate profile``: measure what the planner needs, on this machine.

* Stage time for a batch of n tokens (n = 1, 2, 4, ... 64): each stage file
  through the real pipeline on a local Ray, timed by the stage actors as in a
  run; the whole model in this process, as bench's whole mode runs it. Every
  batch follows a context of ``context`` positions and is rolled back after
  each repetition; medians. From these: a block's time, the output head's
  time and a pass's fixed time for each n (``costs.MeasuredMachine``), so the
  planner can price any split.
* The hop time: the pipeline's wall time minus stage compute, per hop, over
  the one-token passes; the bytes per second of a large frame over a local socket.
* The drafter's time per draft token: prompt lookup on a context of
  ``context`` tokens, and a draft model if one is given.
* The coordinator's own time per pass (the decoding loop against a target
  that answers at once), the time to verify one more logits row, and one
  drafting request's round trip to a drafter in another process.

The profile is one JSON file; orchestrator.planning.loaders reads it.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from orchestrator.cluster.connect import ray_session
from orchestrator.config import (CONNECT_SECONDS, DRAFT_MAX, PROFILE_BATCH_SIZES, PROFILE_CONTEXT, PROFILE_JOIN_SECONDS,
                                 PROFILE_MESSAGE_SECONDS, PROFILE_REPETITIONS)
from orchestrator.decoding.loop import generate
from orchestrator.decoding.targets import InstantTarget
from orchestrator.planning.costs import split_costs
from orchestrator.planning.loaders import PROFILE_KIND, PROFILE_VERSION, model_shape_of_gguf
from orchestrator.transport import wire
from orchestrator.transport.chain import PipelineError
from orchestrator.transport.handshake import connect_peer, drafter_role, new_secret
from orchestrator.transport.messages import CollectDraft, PassResult, Shutdown, SpeculateFrom
from orchestrator.workers.drafter_server import DrafterServer
from speculators.model import ModelSpeculator
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from speculators.verify import verify
from stages.settings import StageSettings


@dataclass(frozen=True)
class ProfileSettings:
    stage_paths: list[str]
    whole_path: str
    draft_path: str | None = None
    batch_sizes: tuple[int, ...] = PROFILE_BATCH_SIZES
    repetitions: int = PROFILE_REPETITIONS
    context: int = PROFILE_CONTEXT
    threads: int = 1


def _median_seconds(action: Callable[[], object], repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_whole(settings: ProfileSettings, progress: Callable[[int, int], None]) -> dict:
    """Median seconds per batch size for the whole model in this process (as
    bench's whole mode runs it), after a context of settings.context positions."""
    from stages.engine import StageEngine

    whole = StageEngine(settings.whole_path, StageSettings(n_ctx=_context_size(settings), threads=settings.threads))
    rng = np.random.default_rng(0)
    whole.decode(np.arange(settings.context, dtype=np.int32), tokens=rng.integers(100, 10000, settings.context).astype(np.int32))
    seconds = []
    for done, size in enumerate(settings.batch_sizes):
        positions = np.arange(settings.context, settings.context + size, dtype=np.int32)
        tokens = rng.integers(100, 10000, size).astype(np.int32)
        rows = np.arange(size, dtype=np.int32)  # a verification pass wants every row's logits

        def one_pass() -> None:
            whole.remove(settings.context)
            whole.decode(positions, tokens=tokens, logit_rows=rows)

        one_pass()  # warms this batch size, as the pipeline's first pass does
        seconds.append(_median_seconds(one_pass, settings.repetitions))
        progress(done + 1, 2 * len(settings.batch_sizes))
    description = {"path": whole.path, "blocks": whole.block_count, "width": whole.n_embd, "vocab": whole.n_vocab,
                   "seconds": seconds}
    whole.close()
    return description


def _context_size(settings: ProfileSettings) -> int:
    return settings.context + max(settings.batch_sizes) + 16


def measure_pipeline(settings: ProfileSettings, progress: Callable[[int, int], None]) -> tuple[list[dict], float]:
    """Each stage's compute per batch size and the hop time, from passes through
    the real pipeline on a local Ray: the stage actors time their own compute
    (as they do in a run, beside the coordinator and each other), and the
    pipeline takes wall time minus compute as transport. The hop time comes
    from the one-token passes. Every pass is rolled back (keep = context)."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings

    rng = np.random.default_rng(0)
    stage_settings = StageSettings(n_ctx=_context_size(settings), threads=settings.threads)
    with ray_session(None), PipelineSettings(settings.stage_paths, stage_settings).start() as pipeline:
        context = rng.integers(100, 10000, settings.context).astype(np.int32)
        pipeline.forward(np.arange(settings.context, dtype=np.int32), context, 0)
        per_stage: list[list[float]] = [[] for _ in settings.stage_paths]
        hop_seconds = 0.0
        for done, size in enumerate(settings.batch_sizes):
            positions = np.arange(settings.context, settings.context + size, dtype=np.int32)
            tokens = rng.integers(100, 10000, size).astype(np.int32)
            rows = np.arange(size, dtype=np.int32)
            transport_before, passes_before = pipeline.chain.transport_seconds, pipeline.chain.passes_alone
            timings = [pipeline.forward(positions, tokens, settings.context, rows).stage_seconds
                       for _ in range(settings.repetitions + 1)][1:]  # the first warms this batch size
            for index in range(len(per_stage)):
                per_stage[index].append(statistics.median(timing[index] for timing in timings))
            if size == 1:
                passes = pipeline.chain.passes_alone - passes_before
                hop_seconds = (pipeline.chain.transport_seconds - transport_before) / passes / (len(per_stage) + 1)
            progress(len(settings.batch_sizes) + done + 1, 2 * len(settings.batch_sizes))
        stages = [
            {"path": path, "first_block": stage.first_block, "end_block": stage.end_block, "seconds": seconds}
            for path, stage, seconds in zip(settings.stage_paths, pipeline.stages, per_stage)
        ]
    return stages, hop_seconds


def measure_drafters(settings: ProfileSettings) -> dict:
    """Seconds per draft token: prompt lookup, and the draft model if given."""
    rng = np.random.default_rng(1)
    context = rng.integers(100, 10000, settings.context + 64).tolist()
    lookup = PromptLookupSpeculator()
    result = {"ngram": _median_seconds(lambda: lookup.extend(context), 50)}
    if settings.draft_path:
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
    """Bytes per second of one large frame over a local TCP socket (orchestrator.transport.wire)."""

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
        received.wait(PROFILE_MESSAGE_SECONDS)
        if repetition:  # the first warms the buffers
            times.append(time.perf_counter() - started)
    thread.join(PROFILE_JOIN_SECONDS)
    sender.close()
    listener.close()
    return payload_bytes / statistics.median(times)


def measure_verification(vocab: int) -> float:
    """Seconds to verify one logits row (greedy)."""

    logits = np.random.default_rng(2).standard_normal((9, vocab)).astype(np.float32)
    drafts = [int(np.argmax(row)) for row in logits[:-1]]
    return _median_seconds(lambda: verify(drafts, logits, 0, SamplingSettings()), 20) / 9


def _serve_prompt_lookup(connection, secret: bytes) -> None:
    """In a child process: a prompt-lookup drafter server until told to stop."""

    server = DrafterServer(PromptLookupSpeculator, "127.0.0.1", draft_max=DRAFT_MAX, secret=secret)
    connection.send(server.port)
    connection.recv()


def measure_drafter_call(context_length: int, calls: int = 200) -> float:
    """Seconds the coordinator spends on one drafting request to a drafter in
    another process (speculate, then collect), on a context where prompt lookup
    finds nothing: the messaging cost alone."""


    secret = new_secret()
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    process = spawn.Process(target=_serve_prompt_lookup, args=(theirs, secret), daemon=True)
    process.start()
    theirs.close()  # so that a child that dies before answering ends the wait
    try:
        if not ours.poll(60):
            raise PipelineError("the drafter process did not start within 60 s")
        connection = connect_peer("127.0.0.1", ours.recv(), secret, drafter_role(0), CONNECT_SECONDS)
        context = np.arange(context_length, dtype=np.int32)  # no n-gram recurs

        def request(epoch: int) -> None:
            wire.send_message(connection, SpeculateFrom(epoch, context))
            wire.send_message(connection, CollectDraft(epoch, True))
            wire.receive_message(connection)

        epochs = iter(range(1, 10 * calls))
        for _ in range(10):
            request(next(epochs))
        seconds = _median_seconds(lambda: request(next(epochs)), calls)
        wire.send_message(connection, Shutdown())
        connection.close()
    finally:
        try:
            ours.send(None)
        except OSError:
            pass
        process.join(PROFILE_JOIN_SECONDS)
    return seconds


def measure_coordinator(vocab: int, tokens: int = 400) -> float:
    """Seconds of the decoding loop's own work per plain pass (verification of
    one row, bookkeeping), with a target that takes no time."""

    target = InstantTarget(vocab)
    generate(target, [1, 2, 3], 20, SamplingSettings(), lambda token: False)  # warm-up
    started = time.perf_counter()
    result = generate(target, [1, 2, 3], tokens, SamplingSettings(), lambda token: False)
    return (time.perf_counter() - started) / result.passes


def profile_machine(settings: ProfileSettings, progress: Callable[[int, int], None] = lambda done, total: None,
                    status: Callable[[str], None] = lambda line: None) -> dict:
    status("timing the whole model, then the stages through a pipeline on a local Ray")
    whole = measure_whole(settings, progress)
    stages, hop_seconds = measure_pipeline(settings, progress)
    status("timing drafters, sockets and verification")
    drafters = measure_drafters(settings)
    bandwidth = measure_socket_bandwidth()
    row_seconds = measure_verification(whole["vocab"])
    coordinator = measure_coordinator(whole["vocab"])
    draft_call = measure_drafter_call(settings.context)

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
        "model_shape": asdict(model_shape_of_gguf(settings.whole_path)),
        "stages": stages,
        **split_costs(stages, whole),
        "drafter_seconds_per_token": drafters,
        "socket_bytes_per_second": bandwidth,
        "coordinator_row_seconds": row_seconds,
        "coordinator_pass_seconds": coordinator,
        "drafter_call_seconds": draft_call,
        "hop_seconds": hop_seconds,
    }
