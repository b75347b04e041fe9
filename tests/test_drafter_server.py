"""The drafter server and its client over a real socket, without Ray or llama.cpp."""

import functools
import time

import pytest

import fakes
from orchestrator import wire
from orchestrator.drafter_server import DrafterServer
from orchestrator.drafters import DrafterClient
from orchestrator.handshake import connect_peer, drafter_role
from speculators.prompt_lookup import PromptLookupSpeculator

pytestmark = pytest.mark.pure

TRUTH = list(range(100, 160))


def wait_until(condition, what: str) -> None:
    """Liveness, not speed: fail instead of hanging if condition never holds."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


SECRET = b"s" * 32


def serve(make, **settings):
    server = DrafterServer(make, "127.0.0.1", secret=SECRET, **settings)
    return server, DrafterClient(0, connect_peer("127.0.0.1", server.port, SECRET, drafter_role(0), 10))


def test_synchronous_collect_waits_for_a_full_draft():
    server, client = serve(PromptLookupSpeculator, draft_max=5)
    client.speculate([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert client.collect(wait=True) == [4, 5, 6, 7, 1]
    assert client.collect() == []  # nothing requested since
    client.close()


def test_drafting_stops_at_collect_unless_overlap():
    for overlap in (False, True):
        make = functools.partial(fakes.SlowSpeculator, TRUTH, set())  # 10 ms a token
        server, client = serve(make, draft_max=40, overlap=overlap)
        client.speculate(TRUTH[:5])
        wait_until(lambda: server.drafted_tokens >= 2, "drafting started")
        collected = client.collect()
        assert collected == TRUTH[5 : 5 + len(collected)] and collected
        drafted = server.drafted_tokens
        if overlap:  # drafting goes on after the collect
            wait_until(lambda: server.drafted_tokens >= drafted + 3, "drafting went on after collect")
        else:
            time.sleep(0.1)
            assert server.drafted_tokens <= drafted + 1  # at most the token in progress
        client.close()


def test_a_hanging_speculator_still_gets_an_answer_and_is_not_waited_for_twice():
    make = functools.partial(fakes.HangingSpeculator, TRUTH, good_calls=2)
    server, client = serve(make, draft_max=8, wait_seconds=0.3)
    client.speculate(TRUTH[:5])
    assert client.collect(wait=True) == TRUTH[5:7]  # answered although the speculator hangs
    assert server.stalled  # so later synchronous requests do not wait for it again
    client.speculate(TRUTH[:7])
    assert client.collect(wait=True) == []
    assert client.alive


def test_a_drafter_whose_connection_closes_is_dropped():
    listener = wire.listen("127.0.0.1")
    client = DrafterClient(0, wire.connect("127.0.0.1", listener.getsockname()[1]))
    accepted, _ = listener.accept()
    accepted.close()  # the drafter's process is gone
    client.speculate([1, 2, 1])
    assert client.collect() == []
    assert not client.alive and client.lost_reason
    client.speculate([1, 2, 1])
    assert client.collect() == []
