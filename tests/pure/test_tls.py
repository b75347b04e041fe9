"""The chain's optional TLS (orchestrator.transport.tls) over real loopback sockets:
messages both ways, the HMAC handshake inside it, a peer with another run's
certificate refused in one line, and no plaintext on the wire."""

from __future__ import annotations

import pickle
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from orchestrator.transport import handshake

from orchestrator.transport import tls

from orchestrator.transport import wire
from orchestrator.transport.messages import PassResult, StageBatch

LIVENESS_SECONDS = 30
"""Fail instead of hanging; not a speed limit."""

SECRET = b"s" * 32
ROLE = handshake.upstream_role(1)

random_numbers = np.random.default_rng(0)
TOKENS = np.arange(1_000_000, 1_000_064, dtype=np.int32)  # a pattern no TLS record would carry by chance
BATCH = StageBatch(pass_id=1, keep=0, positions=np.arange(64, dtype=np.int32), logit_rows=np.array([63], np.int32),
                   tokens=TOKENS)
HIDDEN_BATCH = StageBatch(pass_id=2, keep=64, positions=np.array([64], np.int32), logit_rows=np.array([0], np.int32),
                          hidden=random_numbers.normal(size=(1, 576)).astype(np.float32), stage_seconds=(0.5,))
RESULT = PassResult(pass_id=2, logits=random_numbers.normal(size=(1, 49152)).astype(np.float32),  # 196 KB
                    stage_seconds=(0.5, 0.25))


@pytest.fixture(scope="module")
def certificate() -> tls.ChainCertificate:
    return tls.new_chain_certificate()


@pytest.fixture
def listener():
    sock = wire.listen("127.0.0.1")
    sock.settimeout(LIVENESS_SECONDS)
    yield sock
    sock.close()


def accepting(listener, action):
    """action(accepted plain socket) in a thread; its result is the future's."""
    def accept_and_act():
        connection, _ = listener.accept()
        return action(connection)

    return ThreadPoolExecutor(1).submit(accept_and_act)


def tls_pair(listener, certificate) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    """(client end, server end) of a loopback connection in TLS."""
    pending = accepting(listener, lambda connection: tls.server_side(connection, certificate))
    client = tls.client_side(wire.connect(*listener.getsockname()), certificate)
    return client, pending.result(timeout=LIVENESS_SECONDS)


def exchange(sending: socket.socket, receiving: socket.socket, message):
    """Send from a thread (a large message fills the socket buffers before it is read)."""
    receiving.settimeout(LIVENESS_SECONDS)
    sender = ThreadPoolExecutor(1).submit(wire.send_message, sending, message)
    received = wire.receive_message(receiving)
    sender.result(timeout=LIVENESS_SECONDS)
    return received


def assert_same(received, sent) -> None:
    assert type(received) is type(sent)
    for name, value in vars(sent).items():
        if isinstance(value, np.ndarray):
            assert getattr(received, name).dtype == value.dtype and getattr(received, name).tobytes() == value.tobytes()
        else:
            assert getattr(received, name) == value, name


def test_messages_travel_both_ways_in_tls_1_3(listener, certificate):
    client, server = tls_pair(listener, certificate)
    with client, server:
        assert client.version() == server.version() == "TLSv1.3"
        for message in (BATCH, HIDDEN_BATCH, RESULT):
            assert_same(exchange(client, server, message), message)
            assert_same(exchange(server, client, message), message)
        for _ in range(3):  # frames back to back stay in step
            wire.send_message(client, HIDDEN_BATCH)
        for _ in range(3):
            assert_same(wire.receive_message(server), HIDDEN_BATCH)


@pytest.mark.parametrize("how", ["close", "abrupt"])
def test_a_peer_that_goes_away_is_connection_closed_as_on_a_plain_socket(listener, certificate, how):
    client, server = tls_pair(listener, certificate)
    with server:
        if how == "close":
            client.close()
        else:  # no TLS close_notify: the plain socket under it closes
            socket.socket(fileno=client.detach()).close()
        server.settimeout(LIVENESS_SECONDS)
        with pytest.raises(wire.ConnectionClosed):
            wire.receive_message(server)


def test_a_peer_with_another_runs_certificate_is_refused_in_one_line(listener, certificate):
    other_run = tls.new_chain_certificate()
    server_errors = accepting(listener, lambda connection: tls.server_side(connection, other_run))
    plain = wire.connect(*listener.getsockname())
    with pytest.raises(tls.TLSError, match="the peer's certificate is not this pipeline's") as caught:
        tls.client_side(plain, certificate)
    assert "\n" not in str(caught.value)
    assert plain.fileno() == -1, "the failed socket is closed"
    with pytest.raises(tls.TLSError) as on_server:  # the acceptor's side fails too: it drops the peer
        server_errors.result(timeout=LIVENESS_SECONDS)
    assert "\n" not in str(on_server.value)


def test_accept_peer_drops_a_peer_of_another_run_and_waits_for_its_own(listener, certificate):
    """A TLS failure is a stranger to accept_peer, which goes on waiting;
    connect_peer reports it as a HandshakeError naming the address."""
    accepted = ThreadPoolExecutor(1).submit(handshake.accept_peer, listener, SECRET, ROLE, LIVENESS_SECONDS, certificate)
    host, port = listener.getsockname()
    with pytest.raises(handshake.HandshakeError, match=rf"{host}:{port}: .*not this pipeline's"):
        handshake.connect_peer(host, port, SECRET, ROLE, LIVENESS_SECONDS, tls.new_chain_certificate())
    own = handshake.connect_peer(host, port, SECRET, ROLE, LIVENESS_SECONDS, certificate)
    with own, accepted.result(timeout=LIVENESS_SECONDS) as theirs:
        assert_same(exchange(own, theirs, RESULT), RESULT)


def test_a_plain_client_is_refused_by_a_tls_acceptor(listener, certificate):
    pending = accepting(listener, lambda connection: tls.server_side(connection, certificate))
    with wire.connect(*listener.getsockname()) as plain:
        plain.sendall(handshake.MAGIC + bytes([len(ROLE)]) + ROLE.encode() + b"n" * handshake.NONCE_BYTES)
        with pytest.raises(tls.TLSError, match="TLS handshake from 127.0.0.1:[0-9]+ failed"):
            pending.result(timeout=LIVENESS_SECONDS)


def test_a_silent_acceptor_times_the_client_out(listener, certificate):
    with wire.connect(*listener.getsockname()) as plain:
        silent, _ = listener.accept()
        with silent:
            with pytest.raises(tls.TLSError, match="no answer within 0.2 s"):
                tls.client_side(plain, certificate, timeout=0.2)


def test_a_silent_connector_times_the_acceptor_out(listener, certificate):
    """A stranger who connects and says nothing holds the acceptor for its turn only."""
    pending = accepting(listener, lambda connection: tls.server_side(connection, certificate, timeout=0.2))
    with wire.connect(*listener.getsockname()):
        with pytest.raises(tls.TLSError, match="TLS handshake from 127.0.0.1:[0-9]+: no answer within 0.2 s"):
            pending.result(timeout=LIVENESS_SECONDS)


def test_the_hmac_handshake_runs_inside_tls(listener, certificate):
    def accept_and_verify(connection):
        secured = tls.server_side(connection, certificate)
        handshake.verify(secured, SECRET, ROLE)
        return secured

    pending = accepting(listener, accept_and_verify)
    client = tls.client_side(wire.connect(*listener.getsockname()), certificate)
    handshake.introduce(client, SECRET, ROLE, LIVENESS_SECONDS)
    server = pending.result(timeout=LIVENESS_SECONDS)
    with client, server:
        assert_same(exchange(client, server, HIDDEN_BATCH), HIDDEN_BATCH)
        assert_same(exchange(server, client, RESULT), RESULT)


def test_a_wrong_secret_still_fails_the_hmac_handshake_inside_tls(listener, certificate):
    def accept_and_verify(connection):
        secured = tls.server_side(connection, certificate)
        with secured:
            handshake.verify(secured, SECRET, ROLE)

    pending = accepting(listener, accept_and_verify)
    with tls.client_side(wire.connect(*listener.getsockname()), certificate) as client:
        with pytest.raises(handshake.HandshakeError, match="does not hold this pipeline's secret"):
            handshake.introduce(client, b"x" * 32, ROLE, LIVENESS_SECONDS)
    with pytest.raises(handshake.HandshakeError):
        pending.result(timeout=LIVENESS_SECONDS)


class Tap:
    """A TCP proxy between a client and the listener that records every byte it relays."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = wire.listen("127.0.0.1")
        self.address = self.listener.getsockname()
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        incoming, _ = self.listener.accept()
        outgoing = socket.create_connection(self.target)
        for source, sink in ((incoming, outgoing), (outgoing, incoming)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(1 << 16):
                with self.lock:
                    self.seen += chunk
                sink.sendall(chunk)
        except OSError:
            pass


def talk_through(tap: Tap, listener, certificate: tls.ChainCertificate | None) -> None:
    """The handshake, a token batch, hidden states and logits through the tap, in TLS or not."""
    def accept_and_relay(connection):
        if certificate is not None:
            connection = tls.server_side(connection, certificate)
        with connection:
            handshake.verify(connection, SECRET, ROLE)
            for _ in range(3):
                wire.send_message(connection, wire.receive_message(connection))

    pending = accepting(listener, accept_and_relay)
    client = wire.connect(*tap.address)
    if certificate is not None:
        client = tls.client_side(client, certificate)
    with client:
        client.settimeout(LIVENESS_SECONDS)
        handshake.introduce(client, SECRET, ROLE, LIVENESS_SECONDS)
        client.settimeout(LIVENESS_SECONDS)
        for message in (BATCH, HIDDEN_BATCH, RESULT):
            wire.send_message(client, message)  # the acceptor reads it whole, then echoes it
            assert_same(wire.receive_message(client), message)
    pending.result(timeout=LIVENESS_SECONDS)


PLAINTEXTS = {
    "the handshake's magic": handshake.MAGIC,
    "the role": ROLE.encode(),
    "the tokens": TOKENS.tobytes(),
    "hidden states": HIDDEN_BATCH.hidden.tobytes()[:64],
    "logits": RESULT.logits.tobytes()[100_000:100_064],
    "a header key": b"positions",
}


@pytest.mark.parametrize("in_tls", [False, True], ids=["plain (control)", "tls"])
def test_no_plaintext_on_the_wire(listener, certificate, in_tls):
    tap = Tap(listener.getsockname())
    talk_through(tap, listener, certificate if in_tls else None)
    with tap.lock:
        seen = bytes(tap.seen)
    assert len(seen) > RESULT.logits.nbytes * 2, "the tap saw the traffic"
    found = [name for name, plaintext in PLAINTEXTS.items() if plaintext in seen]
    if in_tls:
        assert found == []
    else:  # the tap would see them: the check above can fail
        assert found == list(PLAINTEXTS)


def test_the_certificate_travels_by_pickle_and_keeps_its_key_out_of_repr(certificate):
    assert pickle.loads(pickle.dumps(certificate)) == certificate
    assert b"PRIVATE KEY" in certificate.key_pem and b"CERTIFICATE" in certificate.certificate_pem
    assert "PRIVATE" not in repr(certificate)
    assert tls.new_chain_certificate() != certificate, "one per run"


def test_contexts_are_built_once_per_certificate(certificate):
    assert tls._client_context(certificate) is tls._client_context(certificate)
    assert tls._server_context(certificate) is tls._server_context(certificate)
