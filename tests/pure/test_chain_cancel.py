"""The coordinator's end of the chain (orchestrator.transport.chain.SocketChain) facing
a last stage that answers with ``Cancelled``: believed only for a pass it
cancelled, with one time per stage up to the one that dropped it; the KV
ledger then holds only what every stage agrees on. A socketpair plays the
last stage."""

import socket

import numpy as np
import pytest

from orchestrator.transport import wire
from orchestrator.transport.chain import PipelineError, SocketChain
from orchestrator.transport.messages import Cancel, Cancelled
from orchestrator.transport.ledger import PassRecord


@pytest.fixture
def chain():
    """(chain with 2 stages, the last stage's end, stage 0's and 1's cancel ends)."""
    chain = SocketChain("127.0.0.1", b"s" * 32, n_vocab=10)
    chain.stage_count = 2
    to_first, first_end = socket.socketpair()
    from_last, last_end = socket.socketpair()
    cancel_ends = []
    for _ in range(2):
        ours, theirs = socket.socketpair()
        chain._cancels.append(ours)
        cancel_ends.append(theirs)
    chain._to_first, chain._from_last = to_first, from_last
    for end in (first_end, last_end, *cancel_ends):
        end.settimeout(10)
    yield chain, first_end, last_end, cancel_ends
    chain.close(shutdown=False)
    for end in (first_end, last_end, *cancel_ends):
        end.close()


def record(keep=4, first=4, count=3) -> PassRecord:
    positions = np.arange(first, first + count, dtype=np.int32)
    return PassRecord(0, keep, positions, positions + 100, np.array([count - 1], np.int32))


def test_a_cancelled_pass_is_announced_to_every_stage_once(chain):
    chain, first_end, _, cancel_ends = chain
    sent = record()
    pass_id = chain.send(sent)
    wire.receive_message(first_end)
    chain.cancel(sent)
    chain.cancel(sent)  # once is enough
    chain.cancel(PassRecord.release(0))  # not in flight: nothing
    for end in cancel_ends:
        assert wire.receive_message(end) == Cancel(pass_id)
        end.setblocking(False)
        with pytest.raises(BlockingIOError):
            end.recv(1)


def test_a_cancelled_pass_comes_back_with_a_time_for_every_stage_and_settles_as_not_decoded(chain):
    chain, first_end, last_end, _ = chain
    prompt = PassRecord(0, 0, np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), np.array([3], np.int32))
    chain.ledger.settle(prompt, decoded=True)
    ahead = record(keep=4)
    pass_id = chain.send(ahead)
    chain.cancel(ahead)
    wire.send_message(last_end, Cancelled(pass_id, 0, (0.25,)))
    assert chain.receive() == Cancelled(pass_id, 0, (0.25, 0.0))
    assert chain.in_flight == 0 and chain.cancelled_unanswered() == []
    assert chain.ledger.held(0) == ([0, 1, 2, 3], [0, 1, 2, 3])  # below its keep only


def test_a_stage_that_drops_a_pass_nobody_cancelled_is_named(chain):
    chain, _, last_end, _ = chain
    pass_id = chain.send(record())
    wire.send_message(last_end, Cancelled(pass_id, 1, (0.25, 0.5)))
    with pytest.raises(PipelineError, match=rf"^stage 1 dropped pass {pass_id}, which was not cancelled$"):
        chain.receive()


@pytest.mark.parametrize("stage, seconds", [(2, (0.1, 0.1, 0.1)), (1, (0.1,)), (0, (0.1, 0.2))])
def test_a_cancellation_with_a_stage_or_times_that_do_not_fit_the_chain_is_refused(chain, stage, seconds):
    chain, _, last_end, _ = chain
    sent = record()
    pass_id = chain.send(sent)
    chain.cancel(sent)
    wire.send_message(last_end, Cancelled(pass_id, stage, seconds))
    with pytest.raises(PipelineError, match=rf"^the last stage \(stage 1\) sent a cancellation of pass {pass_id} "
                                            rf"by stage {stage} with {len(seconds)} stage times$"):
        chain.receive()


def test_a_cancelled_pass_in_flight_is_listed_for_a_new_chain_to_cancel_again(chain):
    chain, _, _, _ = chain
    kept, cancelled = record(first=4), record(keep=7, first=7)
    chain.send(kept)
    chain.send(cancelled)
    chain.cancel(cancelled)
    assert chain.unanswered() == [kept, cancelled]
    assert chain.cancelled_unanswered() == [cancelled]
    assert chain.holds(cancelled) and not chain.holds(record())
