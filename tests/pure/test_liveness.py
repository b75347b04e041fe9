"""The coordinator's pings while it waits for a result
(orchestrator.transport.liveness; the stage's side: orchestrator.workers.cancels):
a stage that answers keeps the wait going however long its pass takes, one
that goes silent ends it, named, long before the pass deadline. Short ping
and silence times; only what happens is asserted, never how fast."""

import socket
import threading

import pytest

from orchestrator.transport import wire
from orchestrator.transport.liveness import StageDeadlines, StageLiveness, StageSilent
from orchestrator.transport.messages import Alive, Cancel, Ping
from orchestrator.workers.cancels import PassCancels


def answering(connection: socket.socket, stage: int, stop: threading.Event, as_stage: int | None = None) -> None:
    """A stage's cancel thread that answers every ping (as ``as_stage`` if given) until ``stop``."""
    while not stop.is_set():
        try:
            message = wire.receive_message(connection)
        except (wire.ConnectionClosed, OSError):
            return
        if isinstance(message, Ping):
            wire.send_message(connection, Alive(message.number, stage if as_stage is None else as_stage))


@pytest.fixture
def chain():
    """(the result socket's two ends, the coordinator's cancel ends, the stages' ends) of two stages."""
    ours, theirs = zip(*(socket.socketpair() for _ in range(2)))
    result_in, result_out = socket.socketpair()
    yield result_in, result_out, list(ours), list(theirs)
    for sock in (result_in, result_out, *ours, *theirs):
        sock.close()


def liveness(cancels):
    return StageLiveness(cancels, deadlines=StageDeadlines(ping_seconds=0.02, silence_seconds=0.3))


def test_stages_that_answer_keep_a_long_wait_going_until_the_result(chain):
    result_in, result_out, ours, theirs = chain
    stop = threading.Event()
    for stage, end in enumerate(theirs):
        threading.Thread(target=answering, args=(end, stage, stop), daemon=True).start()
    watch = liveness(ours)
    assert watch.wait(result_in, 1.0) is False  # many pings answered, no result: the time ran out
    wire.send_message(result_out, Cancel(1))
    assert watch.wait(result_in, 1.0) is True
    stop.set()


def test_a_stage_that_stops_answering_is_named_before_the_wait_ends(chain):
    result_in, _, ours, theirs = chain
    stop = threading.Event()
    threading.Thread(target=answering, args=(theirs[0], 0, stop), daemon=True).start()  # stage 1 never answers
    with pytest.raises(StageSilent, match=r"^stage 1 is silent: no answer to the coordinator's ping for \d+ s "
                                          r"\(a frozen process or machine, or a cut link\)$"):
        liveness(ours).wait(result_in, 60.0)
    stop.set()


def test_an_answer_in_another_stages_name_is_refused(chain):
    result_in, _, ours, theirs = chain
    stop = threading.Event()
    threading.Thread(target=answering, args=(theirs[0], 0, stop), daemon=True).start()
    threading.Thread(target=answering, args=(theirs[1], 1, stop, 0), daemon=True).start()
    with pytest.raises(StageSilent, match=r"^stage 1 sent Alive\(number=1, stage_index=0\) on its cancel connection"):
        liveness(ours).wait(result_in, 60.0)
    stop.set()


def test_a_closed_cancel_connection_ends_the_wait(chain):
    result_in, _, ours, theirs = chain
    theirs[0].close()
    with pytest.raises(StageSilent, match=r"^stage 0's cancel connection broke"):
        liveness(ours).wait(result_in, 60.0)


def test_a_stages_cancel_thread_answers_pings_and_still_takes_cancels(chain):
    """The stage's side: PassCancels.read answers each Ping with its stage's
    Alive, and a Cancel after them still reaches the running pass."""
    _, _, ours, theirs = chain
    abort = threading.Event()
    cancels = PassCancels(abort, stage=1)
    cancels.running = {7}
    threading.Thread(target=cancels.read, args=(theirs[1], cancels.generation), daemon=True).start()
    for number in (1, 2):
        wire.send_message(ours[1], Ping(number))
        assert wire.receive_message(ours[1]) == Alive(number, 1)
    wire.send_message(ours[1], Cancel(7))
    assert abort.wait(10)
