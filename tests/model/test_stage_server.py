"""A live stage server (the real first stage of SmolLM2, no Ray) fed frames it
must refuse: each refusal reaches downstream as one StageFailure naming why,
never a crash or a silent thread death; and passes cancelled before they
arrive or while they run."""

from __future__ import annotations

import struct
from dataclasses import replace
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest

from orchestrator.transport import wire
from orchestrator.transport.handshake import accept_peer, cancel_role, connect_peer, upstream_role
from orchestrator.transport.messages import Cancel, Cancelled, Shutdown, StageBatch, StageFailure
from orchestrator.workers.stage_server import StageServer
from stages.backend import detect
from stages.cost_curve import BatchCurve, CostCurve, StageCurve
from stages.engine import StageError
from stages.settings import ALL_LAYERS, StageSettings

SECRET = b"k" * 32


@pytest.fixture
def stage(splits):
    """(server, upstream socket to it, downstream socket from it)."""
    yield from serving(StageServer(splits[2][0], StageSettings(n_ctx=64, n_batch=16), "127.0.0.1", "node",
                                   secret=SECRET))


@pytest.fixture
def cancelling_stage(splits):
    """(server, upstream, downstream, the coordinator's cancel connection to
    it), with batches of up to 512 tokens (long enough to be cancelled while
    they run)."""
    server = StageServer(splits[2][0], StageSettings(n_ctx=1024, n_batch=512), "127.0.0.1", "node", secret=SECRET)
    yield from serving_with_cancels(server)


def serving_with_cancels(server):
    """``serving``, and the coordinator's cancel connection to the stage: yield (server, upstream, downstream, cancels)."""
    for server, upstream, downstream in serving(server):
        listener = wire.listen("127.0.0.1")
        accepting = ThreadPoolExecutor(1).submit(accept_peer, listener, SECRET, cancel_role(0), 30)
        server.connect_cancel(*listener.getsockname())
        cancels = accepting.result(timeout=30)
        yield server, upstream, downstream, cancels
        cancels.close()
        listener.close()


def serving(server):
    """Wire ``server`` to a downstream listener and an upstream connection; yield (server, upstream, downstream)."""
    listener = wire.listen("127.0.0.1")
    accepting = ThreadPoolExecutor(1).submit(accept_peer, listener, SECRET, upstream_role(1), 30)
    server.connect_downstream(*listener.getsockname())
    downstream = accepting.result(timeout=30)
    downstream.settimeout(30)
    upstream = connect_peer("127.0.0.1", server.description.port, SECRET, upstream_role(0), 30)
    yield server, upstream, downstream
    upstream.close()
    downstream.close()
    listener.close()
    server._thread.join(timeout=30)


def encoded(message) -> bytes:
    fields, _ = message.to_wire()
    header = msgpack.packb({"kind": message.KIND, **fields}, use_bin_type=True)
    return struct.pack("!I", len(header)) + header


def batch(tokens, positions=None, sequence=0) -> StageBatch:
    tokens = np.asarray(tokens, np.int32)
    positions = np.arange(len(tokens), dtype=np.int32) if positions is None else np.asarray(positions, np.int32)
    return StageBatch(1, 0, positions, np.array([len(tokens) - 1], np.int32), tokens=tokens, sequence=sequence)


def test_a_stage_describes_the_backend_it_computes_on(stage):
    """This build (make install's default, BACKEND=cpu): the CPU alone, nothing offloaded, though
    n_gpu_layers is all; what ggml's registry says, not what the Makefile meant."""
    server, _, _ = stage
    compute = server.description.compute
    assert compute.backend == detect().name == "cpu" and compute.devices
    assert all(device.startswith("CPU") for device in compute.devices)
    assert server.engine.settings.n_gpu_layers == ALL_LAYERS
    assert (compute.offloaded_layers, compute.offloadable_layers) == (0, server.engine.block_count + 1)


@pytest.mark.parametrize("bad, reason", [
    (batch([1, 2, 10**6]), "a token id outside the vocabulary"),
    (batch([1, 2], sequence=3), "sequence 3 is not one of the stage's 1"),
    (batch(list(range(1, 20))), "batch of 19 tokens (allowed 1..16)"),
    (batch([1, 2], positions=[5000, 5001]), "position 5001 is beyond the context of"),
])
def test_a_batch_the_stage_cannot_run_fails_that_pass_and_the_stage_goes_on(stage, bad, reason):
    server, upstream, downstream = stage
    wire.send_message(upstream, bad)
    failure = wire.receive_message(downstream)
    assert isinstance(failure, StageFailure) and reason in failure.message and failure.stage_index == 0
    wire.send_message(upstream, batch([1, 2, 3]))  # and it still serves
    hidden = wire.receive_message(downstream)
    assert isinstance(hidden, StageBatch) and hidden.hidden.shape == (3, 576)


@pytest.mark.parametrize("raw, reason", [
    (b"\x00\x00\x00\x02\xc1\xc1", "not msgpack"),
    (struct.pack("!I", 2**31), "a header of 2147483648 bytes"),
    (None, "exactly one of tokens and hidden"),
    ("negative", "positions: negative"),
])
def test_a_bad_frame_is_reported_downstream_and_the_stage_stops(stage, raw, reason):
    server, upstream, downstream = stage
    if raw == "negative":
        raw = encoded(batch([1, 2], positions=[-3, -2]))
    if raw is None:  # a well-formed frame whose fields disagree
        header = msgpack.packb({"kind": "batch", "pass": 1, "sequence": 0, "keep": 0, "positions": b"",
                                "rows": b"", "tokens": None, "seconds": []}, use_bin_type=True)
        raw = struct.pack("!I", len(header)) + header
    upstream.sendall(raw)
    failure = wire.receive_message(downstream)
    assert isinstance(failure, StageFailure) and "a bad frame from upstream" in failure.message
    assert reason in failure.message
    server._thread.join(timeout=30)
    assert not server._thread.is_alive()
    with pytest.raises((wire.ConnectionClosed, OSError)):
        downstream.settimeout(5)
        if downstream.recv(1) == b"":
            raise wire.ConnectionClosed("closed")


def test_an_unexpected_error_in_the_loop_is_reported_downstream_not_a_silent_thread_death(stage):
    server, upstream, downstream = stage

    def broken_metrics(seconds, cells, sequences, pass_sequences, busy):
        raise RuntimeError("the metrics broke")

    server.on_pass = broken_metrics
    wire.send_message(upstream, batch([1, 2, 3]))
    failure = wire.receive_message(downstream)
    assert isinstance(failure, StageFailure)
    assert failure.message == "the stage's loop failed: RuntimeError: the metrics broke"


def test_after_its_chain_breaks_a_stage_keeps_its_model_and_port_and_serves_a_new_chain(stage):
    """What a surviving stage does when another stage is lost: its upstream
    goes away, then it is wired again (same listening port, same loaded
    model) and serves the new chain's passes, with its cache as it was."""
    server, upstream, downstream = stage
    wire.send_message(upstream, batch([1, 2, 3]))
    first = wire.receive_message(downstream)
    upstream.close()  # the old chain breaks
    server._thread.join(timeout=30)
    assert not server._thread.is_alive()
    listener = wire.listen("127.0.0.1")
    accepting = ThreadPoolExecutor(1).submit(accept_peer, listener, SECRET, upstream_role(1), 30)
    server.connect_downstream(*listener.getsockname())
    new_downstream = accepting.result(timeout=30)
    new_upstream = connect_peer("127.0.0.1", server.description.port, SECRET, upstream_role(0), 30)
    try:
        wire.send_message(new_upstream, StageBatch(2, 3, np.array([3], np.int32), np.array([0], np.int32),
                                                   tokens=np.array([4], np.int32)))
        after = wire.receive_message(new_downstream)
        assert isinstance(after, StageBatch) and after.pass_id == 2 and after.hidden.shape == (1, 576)
        assert server.kv_cells == 4  # positions 0-2 of the old chain, 3 of the new: the cache was kept
        assert first.hidden.shape == (3, 576)
    finally:
        new_upstream.close()
        new_downstream.close()
        listener.close()


def wait_until(condition) -> None:
    """Wait on the stage's state (a liveness bound, not a speed limit)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the stage never reached the state"
        time.sleep(0.001)


def numbered(pass_id, tokens, first=0, keep=None) -> StageBatch:
    tokens = np.asarray(tokens, np.int32)
    positions = np.arange(first, first + len(tokens), dtype=np.int32)
    return StageBatch(pass_id, first if keep is None else keep, positions, np.array([len(tokens) - 1], np.int32),
                      tokens=tokens)


def hidden_after(server, upstream, downstream, pass_id, prompt, tokens):
    """The hidden states of ``tokens`` after ``prompt``, decoded afresh (keep 0)."""
    wire.send_message(upstream, numbered(pass_id, prompt, keep=0))
    wire.receive_message(downstream)
    wire.send_message(upstream, numbered(pass_id + 1, tokens, first=len(prompt)))
    return wire.receive_message(downstream).hidden


PROMPT = [1, 17, 42, 99, 7, 3, 5, 8]
NEXT = [11, 12, 13]


def test_a_pass_cancelled_before_it_arrives_is_dropped_and_the_next_pass_is_exact(cancelling_stage):
    server, upstream, downstream, cancels = cancelling_stage
    wire.send_message(upstream, numbered(1, PROMPT))
    assert isinstance(wire.receive_message(downstream), StageBatch)
    wire.send_message(cancels, Cancel(2))
    wait_until(lambda: 2 in server.cancels.wanted)
    wire.send_message(upstream, numbered(2, [50, 51, 52, 53], first=len(PROMPT)))
    dropped = wire.receive_message(downstream)
    assert dropped == Cancelled(2, 0, (0.0,), dropped.stage_started) and len(dropped.stage_started) == 1
    assert (server.dropped_passes, server.stopped_passes) == (1, 0)
    wire.send_message(upstream, numbered(3, NEXT, first=len(PROMPT)))
    after = wire.receive_message(downstream)
    assert after.pass_id == 3
    np.testing.assert_array_equal(after.hidden, hidden_after(server, upstream, downstream, 4, PROMPT, NEXT))


def test_a_pass_cancelled_while_it_runs_is_stopped_mid_graph_and_the_next_pass_is_exact(cancelling_stage):
    server, upstream, downstream, cancels = cancelling_stage
    wire.send_message(upstream, numbered(1, PROMPT))
    wire.receive_message(downstream)
    long = np.arange(100, 600, dtype=np.int32)  # 500 tokens: a pass of a second or so here
    wire.send_message(upstream, numbered(2, long, first=len(PROMPT)))
    wait_until(lambda: 2 in server.cancels.running)
    wire.send_message(cancels, Cancel(2))
    stopped = wire.receive_message(downstream)
    assert isinstance(stopped, Cancelled) and (stopped.pass_id, stopped.stage_index) == (2, 0)
    assert len(stopped.stage_seconds) == 1 and stopped.stage_seconds[0] > 0
    assert (server.dropped_passes, server.stopped_passes) == (0, 1)
    assert not server.engine.abort.is_set  # cleared for the next pass
    wire.send_message(upstream, numbered(3, NEXT, first=len(PROMPT)))
    after = wire.receive_message(downstream)
    assert isinstance(after, StageBatch) and after.pass_id == 3
    np.testing.assert_array_equal(after.hidden, hidden_after(server, upstream, downstream, 4, PROMPT, NEXT))


def test_a_cancel_of_a_pass_that_already_left_changes_nothing(cancelling_stage):
    server, upstream, downstream, cancels = cancelling_stage
    wire.send_message(upstream, numbered(1, PROMPT))
    wire.receive_message(downstream)
    wire.send_message(cancels, Cancel(1))
    wire.send_message(cancels, Cancel(3))  # read after Cancel(1): once 3 waits, 1 was seen
    wait_until(lambda: 3 in server.cancels.wanted)
    assert server.cancels.wanted == {3}
    wire.send_message(upstream, numbered(2, NEXT, first=len(PROMPT)))
    assert isinstance(wire.receive_message(downstream), StageBatch)


def test_anything_but_a_cancel_on_the_cancel_connection_fails_the_next_pass(cancelling_stage):
    server, upstream, downstream, cancels = cancelling_stage
    wire.send_message(cancels, Shutdown())
    wait_until(lambda: server.cancels.problem)
    wire.send_message(upstream, numbered(1, PROMPT))
    failure = wire.receive_message(downstream)
    assert failure == StageFailure(1, 0, "the cancel connection sent Shutdown, not a cancel")


# -- under an emulated cost curve (--cost-curve, stages.cost_curve)

# 120 ms for one token, 240 ms for 8, and 1 ms per position of context: far above this stage's real compute
EMULATED = CostCurve("test curve", stages=(StageCurve(BatchCurve((1, 8), (0.120, 0.240)), context_seconds=0.001),))


@pytest.fixture
def emulated_stage(splits):
    """(server, upstream, downstream, cancels) of the first stage held to EMULATED."""
    server = StageServer(splits[2][0], StageSettings(n_ctx=64, n_batch=16, cost_curve=EMULATED), "127.0.0.1", "node",
                         secret=SECRET)
    yield from serving_with_cancels(server)


def test_an_emulated_pass_never_returns_before_its_curve_time_and_computes_the_same(emulated_stage, stage):
    """The emulator's contract: each pass lasts at least the curve's time for
    its width and context (it reports that time as the stage's), and the
    hidden states are bit for bit the unemulated stage's."""
    server, upstream, downstream, _ = emulated_stage
    for pass_id, (first, tokens) in enumerate([(0, PROMPT), (len(PROMPT), NEXT)], start=1):
        started = time.perf_counter()
        wire.send_message(upstream, numbered(pass_id, tokens, first=first))
        emulated = wire.receive_message(downstream)
        elapsed = time.perf_counter() - started
        least = EMULATED.stages[0].seconds(len(tokens), first + len(tokens))
        assert elapsed >= least and emulated.stage_seconds[-1] >= least
        plain_server, plain_up, plain_down = stage
        wire.send_message(plain_up, numbered(pass_id, tokens, first=first))
        np.testing.assert_array_equal(emulated.hidden, wire.receive_message(plain_down).hidden)


def test_a_cancel_ends_an_emulated_pass_as_it_would_stop_a_real_one(splits):
    """A cancel that comes while the stage sleeps out its curve time stops the
    pass (Cancelled), as it stops one llama.cpp is computing; the next pass is exact."""
    slow = CostCurve("slow", stages=(StageCurve(BatchCurve((1,), (600.0,))),))
    server = StageServer(splits[2][0], StageSettings(n_ctx=64, n_batch=16, cost_curve=slow), "127.0.0.1", "node",
                         secret=SECRET)
    for server, upstream, downstream, cancels in serving_with_cancels(server):
        wire.send_message(upstream, numbered(1, PROMPT))
        wait_until(lambda: 1 in server.cancels.running)
        time.sleep(2)  # llama.cpp's 8 tokens take milliseconds: the stage now sleeps out the curve
        wire.send_message(cancels, Cancel(1))
        stopped = wire.receive_message(downstream)  # downstream's 30 s timeout: never the 600 s of the curve
        assert isinstance(stopped, Cancelled) and stopped.pass_id == 1
        assert server.stopped_passes == 1 and not server.engine.abort.is_set


def test_a_curve_for_another_number_of_stages_is_refused_naming_the_file(splits):
    two = CostCurve("two stages", stages=(EMULATED.stages[0],) * 2)
    with pytest.raises(StageError, match=r"the cost curve 'two stages' has 2 stages, the pipeline 3$"):
        StageServer(splits[3][0], StageSettings(n_ctx=64, cost_curve=two), "127.0.0.1", "node", secret=SECRET)


# -- a batched pass: several sequences' batches decoded in one llama.cpp call (StageBatch.more)

@pytest.fixture
def two_sequence_stage(splits):
    """(server, upstream, downstream, cancels) of the first stage, holding 2 KV sequences."""
    server = StageServer(splits[2][0], StageSettings(n_ctx=64, n_batch=32, sequences=2), "127.0.0.1", "node",
                         secret=SECRET)
    yield from serving_with_cancels(server)


def of_sequence(pass_id, tokens, sequence, first=0, more=0):
    return replace(numbered(pass_id, tokens, first), sequence=sequence, more=more)


def test_a_batched_pass_computes_each_sequence_as_alone_and_hands_each_on(two_sequence_stage):
    server, upstream, downstream, _ = two_sequence_stage
    prompts = {0: PROMPT, 1: [5, 6, 7, 8, 9, 10, 11, 12]}
    alone = {}
    for pass_id, sequence in ((1, 0), (3, 1)):  # each sequence's prompt, then its next tokens, alone
        wire.send_message(upstream, of_sequence(pass_id, prompts[sequence], sequence))
        wire.receive_message(downstream)
        wire.send_message(upstream, of_sequence(pass_id + 1, NEXT, sequence, first=len(prompts[sequence])))
        alone[sequence] = wire.receive_message(downstream).hidden
    passes_before = server.passes
    wire.send_message(upstream, of_sequence(5, NEXT, 0, first=len(PROMPT), more=1))
    wire.send_message(upstream, of_sequence(6, NEXT, 1, first=len(PROMPT)))
    first, second = wire.receive_message(downstream), wire.receive_message(downstream)
    assert [(message.pass_id, message.sequence, message.more) for message in (first, second)] == [(5, 0, 1), (6, 1, 0)]
    np.testing.assert_array_equal(first.hidden, alone[0])
    np.testing.assert_array_equal(second.hidden, alone[1])
    assert server.passes == passes_before + 1  # one llama.cpp call for both


def test_a_batch_of_a_batched_pass_cancelled_before_it_arrives_is_dropped_in_its_place(two_sequence_stage):
    server, upstream, downstream, cancels = two_sequence_stage
    for pass_id, sequence in ((1, 0), (2, 1)):
        wire.send_message(upstream, of_sequence(pass_id, PROMPT, sequence))
        wire.receive_message(downstream)
    wire.send_message(cancels, Cancel(4))
    wait_until(lambda: 4 in server.cancels.wanted)
    wire.send_message(upstream, of_sequence(3, NEXT, 0, first=len(PROMPT), more=1))
    wire.send_message(upstream, of_sequence(4, NEXT, 1, first=len(PROMPT)))
    kept, dropped = wire.receive_message(downstream), wire.receive_message(downstream)
    # the next stage must not wait for a batch that is not coming: the count goes down with it
    assert isinstance(kept, StageBatch) and (kept.pass_id, kept.more) == (3, 0)
    assert dropped == Cancelled(4, 0, (0.0,), dropped.stage_started) and len(dropped.stage_started) == 1


def test_a_batched_pass_that_is_not_followed_by_its_batches_is_a_bad_frame(two_sequence_stage):
    _, upstream, downstream, _ = two_sequence_stage
    wire.send_message(upstream, of_sequence(1, PROMPT, 0, more=2))
    wire.send_message(upstream, of_sequence(2, PROMPT, 1, more=0))  # 1 was to follow, not 0
    failure = wire.receive_message(downstream)
    assert isinstance(failure, StageFailure) and "waiting for 2 more batches got StageBatch (more 0)" in failure.message
