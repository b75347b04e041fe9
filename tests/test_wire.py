import socket
import threading

import numpy as np
import pytest

from orchestrator import wire
from orchestrator.messages import PassResult, Shutdown, StageBatch, StageFailure

pytestmark = pytest.mark.pure


def round_trip(message):
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=wire.send_message, args=(left, message))
        sender.start()  # a large message fills the socket buffer before it is read
        received = wire.receive_message(right)
        sender.join()
        return received


def test_batch_with_tokens_and_with_hidden_states():
    batch = StageBatch(3, 17, np.arange(17, 20, dtype=np.int32), np.array([2], np.int32), tokens=np.array([5, 6, 7], np.int32))
    received = round_trip(batch)
    assert received.pass_id == 3 and received.keep == 17
    assert received.tokens.tolist() == [5, 6, 7] and received.positions.tolist() == [17, 18, 19]
    assert received.hidden is None

    hidden = np.random.default_rng(0).normal(size=(3, 576)).astype(np.float32)
    received = round_trip(StageBatch(4, 0, np.arange(3, dtype=np.int32), np.array([2], np.int32), hidden=hidden, stage_seconds=(0.5,)))
    assert received.hidden.dtype == np.float32 and np.array_equal(received.hidden, hidden)
    assert received.stage_seconds == (0.5,) and received.tokens is None


def test_large_logits_survive_partial_sends():
    logits = np.random.default_rng(1).normal(size=(8, 49152)).astype(np.float32)  # 1.5 MB
    received = round_trip(PassResult(9, logits, (0.1, 0.2)))
    assert np.array_equal(received.logits, logits) and received.stage_seconds == (0.1, 0.2)


def test_failure_and_shutdown():
    assert round_trip(StageFailure(2, 1, "boom")) == StageFailure(2, 1, "boom")
    assert isinstance(round_trip(Shutdown()), Shutdown)
