"""The drafter server and its client over a real socket, without Ray or llama.cpp."""

import functools
import sys
import threading
import time

import fakes
from orchestrator.config import DRAFT_MAX, chain_reach
from orchestrator.transport import wire
from orchestrator.workers.drafter_server import DrafterServer
from orchestrator.cluster.drafters import DrafterClient, draft_seconds_per_token
from speculators.corrections import Forks
from speculators.draft_length import DraftPrices
from orchestrator.transport.handshake import connect_peer, drafter_role
from speculators.prompt_lookup import PromptLookupSpeculator

TRUTH = list(range(100, 160))


LIVENESS_SECONDS = 30
"""Fail instead of hanging when a state never comes; not a speed limit."""


def wait_until(condition, what: str) -> None:
    """Liveness, not speed: fail instead of hanging if condition never holds."""
    deadline = time.monotonic() + LIVENESS_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


SECRET = b"s" * 32


def serve(make, **settings):
    server = DrafterServer(make, "127.0.0.1", secret=SECRET, **settings)
    sock = connect_peer("127.0.0.1", server.port, SECRET, drafter_role(0), 10)
    return server, DrafterClient(0, sock, draft_max=settings.get("draft_max", DRAFT_MAX))


def test_synchronous_collect_waits_for_a_full_draft():
    server, client = serve(PromptLookupSpeculator, draft_max=5)
    client.speculate([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert client.collect(wait=True) == [4, 5, 6, 7, 1]
    assert client.collect() == []  # nothing requested since
    client.close()


def test_a_request_for_fewer_drafts_stops_the_drafter_there():
    server, client = serve(PromptLookupSpeculator, draft_max=5)
    client.speculate([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], most=2)  # the draft policy wants two
    assert client.collect(wait=True) == [4, 5]
    assert server.drafted_tokens == 2  # not drafted and thrown away
    client.speculate([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])  # none asked: draft_max
    assert client.collect(wait=True) == [4, 5, 6, 7, 1]
    client.speculate([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], most=99)  # never past two windows' worth
    assert len(client.collect(wait=True)) == chain_reach(5) == 12
    assert client.alive  # which the client takes from it
    client.close()


class GatedSpeculator:
    """Right, one token per permit the test releases; ``contexts`` records what
    each call was asked to extend, from the moment the call begins."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.contexts: list[list[int]] = []

    def extend(self, context, sampling=None):
        self.contexts.append(list(context))
        assert self.permits.acquire(timeout=LIVENESS_SECONDS), "never released"
        return TRUTH[len(context)]


def draft_loop_is_idle(server: DrafterServer) -> bool:
    """The server's drafting thread waits for work (not inside its speculator)."""
    for frame in sys._current_frames().values():
        callee = None
        while frame is not None:
            if frame.f_code.co_name == "_draft_loop" and frame.f_locals.get("self") is server:
                return callee is not None and callee.f_code.co_name == "wait" \
                    and callee.f_code.co_filename == threading.__file__
            callee, frame = frame, frame.f_back
    return False


def two_drafted(**settings):
    """A gated drafter after TRUTH[:5] that drafted two tokens and began a third."""
    speculator = GatedSpeculator()
    server, client = serve(lambda: speculator, draft_max=40, **settings)
    client.speculate(TRUTH[:5])
    speculator.permits.release(2)
    wait_until(lambda: len(speculator.contexts) == 3, "two tokens drafted, the third begun")
    return speculator, server, client


def test_drafting_stops_at_collect():
    speculator, server, client = two_drafted()
    assert client.collect() == TRUTH[5:7]
    speculator.permits.release(1)  # the token in progress ends, and is not wanted any more
    wait_until(lambda: draft_loop_is_idle(server) or len(speculator.contexts) > 3, "the drafting thread settled")
    assert len(speculator.contexts) == 3, "drafting went on after the collect"
    client.speculate(TRUTH[:9])  # a new request starts it again, from its own context
    wait_until(lambda: len(speculator.contexts) == 4, "drafting resumed")
    assert speculator.contexts[3] == TRUTH[:9]
    client.close()


def test_with_overlap_drafting_goes_on_after_collect():
    speculator, server, client = two_drafted(overlap=True)
    assert client.collect() == TRUTH[5:7]
    speculator.permits.release(3)
    wait_until(lambda: len(speculator.contexts) == 6, "drafting went on after the collect")
    assert speculator.contexts[3:] == [TRUTH[:8], TRUTH[:9], TRUTH[:10]]
    client.close()


def test_a_peek_hands_over_what_is_drafted_and_drafting_goes_on():
    """A branch window takes what the drafter has (DrafterClient.peek); the
    collect after it returns those tokens and the ones drafted since."""
    speculator, server, client = two_drafted()
    assert client.peek() == TRUTH[5:7]
    speculator.permits.release(2)
    wait_until(lambda: len(speculator.contexts) == 5, "drafting went on after the peek")
    assert client.collect() == TRUTH[5:9]
    assert client.peek() == [] and client.alive  # collected: nothing more to peek at
    client.close()


def test_a_hanging_speculator_still_gets_an_answer_and_is_not_waited_for_twice():
    make = functools.partial(fakes.HangingSpeculator, TRUTH, good_calls=2)
    server, client = serve(make, draft_max=8, wait_seconds=0.3)  # how long a wait may last, not a speed
    client.speculate(TRUTH[:5])
    wait_until(lambda: server.speculator.calls == 3, "two tokens drafted, then the hang")
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


class PrefillingSpeculator(fakes.ScriptedSpeculator):
    """Right; a context it has not seen costs PREFILL seconds, each token after it STEP."""

    PREFILL, STEP = 1.0, 0.01

    def __init__(self, truth):
        super().__init__(truth, set())
        self.seen = 0

    def extend(self, context, sampling=None):
        time.sleep(self.STEP if len(context) == self.seen + 1 else self.PREFILL)
        self.seen = len(context)
        return super().extend(context)


class SlowedPipeline:
    """A pipeline double whose one-token pass takes twice PASS while drafters draft (as on shared cores)."""

    PASS = 0.02

    def forward(self, positions, tokens, keep):
        time.sleep(2 * self.PASS)


def test_a_draft_token_is_timed_after_the_prefill_of_its_context():
    """The draft's step that prices awaited drafts (cluster.drafters.draft_prices)
    leaves out the prefill of the prompt: a sleep of a second, against a step of 10 ms."""
    from orchestrator.cluster.drafters import draft_prices

    server, client = serve(functools.partial(PrefillingSpeculator, TRUTH), draft_max=8)
    seconds = draft_seconds_per_token(client, TRUTH[:10])
    assert PrefillingSpeculator.STEP <= seconds < PrefillingSpeculator.PREFILL / 8  # counted over 4 tokens
    assert draft_prices("ngram", SlowedPipeline(), [client], TRUTH[:10], 0.1) == DraftPrices()  # asked in process
    prices = draft_prices("model", SlowedPipeline(), [client], TRUTH[:20], 0.1)
    assert PrefillingSpeculator.STEP / 0.1 <= prices.awaited < 1.25
    client.close()


def test_drafting_that_slows_the_passes_prices_each_relayed_token_by_the_slowdown():
    """Two drafters draft 8 tokens each while 4 passes take twice their time:
    4 passes lost over 16 tokens, a quarter of a pass a token."""
    from orchestrator.cluster.drafters import draft_prices

    pairs = [serve(functools.partial(fakes.ScriptedSpeculator, TRUTH, set()), draft_max=8) for _ in range(2)]
    clients = [client for _, client in pairs]
    prices = draft_prices("model", SlowedPipeline(), clients, TRUTH[:10], SlowedPipeline.PASS, passes=4)
    assert 0.25 <= prices.relayed < 0.5 and prices.awaited >= 0
    for client in clients:
        client.close()


def answered_by(reply_for):
    """A DrafterClient whose drafter is this test: it reads each request and
    sends ``reply_for(request)`` back when collected."""
    import socket

    ours, theirs = socket.socketpair()
    client = DrafterClient(0, ours, draft_max=4, n_vocab=100)

    def serve_once():
        request = wire.receive_message(theirs)
        collect = wire.receive_message(theirs)
        wire.send_message(theirs, reply_for(request, collect))

    return client, threading.Thread(target=serve_once, daemon=True), theirs


def reply_with(corrections):
    import numpy as np
    from orchestrator.transport.messages import DraftReply

    return lambda request, collect: DraftReply(collect.epoch, np.array([5], np.int32), 0.0, corrections=corrections)


def test_corrections_where_they_were_asked_for_are_kept_by_position_and_token():
    client, drafter, _ = answered_by(reply_with(((3, (7, 8, 9)), (3, (11,)), (4, (12, 13)))))
    drafter.start()
    client.speculate([1, 2, 3, 4, 5], 2, forks=Forks(3, 2))
    assert client.collect(wait=True) == [5]
    assert client.corrections() == {(3, 7): [7, 8, 9], (3, 11): [11], (4, 12): [12, 13]}
    assert client.corrections() == {}  # handed over once
    assert client.alive


def test_corrections_outside_the_window_asked_for_lose_the_drafter():
    for corrections, forks, reason in [
        (((5, (7,)),), Forks(3, 2), "a correction at position 5 of 1 tokens (asked for 3..4, at most 5)"),
        (((3, (7,) * 6),), Forks(3, 2), "a correction at position 3 of 6 tokens"),
        (((3, (700,)),), Forks(3, 2), "outside the vocabulary of 100"),
        (((3, (7,)),), None, "corrections that were not asked for"),
    ]:
        client, drafter, _ = answered_by(reply_with(corrections))
        drafter.start()
        client.speculate([1, 2, 3, 4, 5], 2, forks=forks)
        assert client.collect(wait=True) == [] and client.corrections() == {}
        assert not client.alive and reason in client.lost_reason, client.lost_reason


def test_more_corrections_than_asked_for_lose_the_drafter():
    corrections = tuple((3, (token,)) for token in range(7, 12))  # five at one position: two runners-up asked for
    client, drafter, _ = answered_by(reply_with(corrections))
    drafter.start()
    client.speculate([1, 2, 3, 4, 5], 2, forks=Forks(3, 2))
    assert client.collect(wait=True) == [] and "sent 5 corrections (at most 4)" in client.lost_reason
