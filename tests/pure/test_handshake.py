"""The data plane's handshake (orchestrator.transport.handshake) over real sockets: the
peer holding the secret for the role gets through; strangers, wrong secrets,
wrong roles and stalled peers are dropped, and the real peer still gets in."""

from __future__ import annotations

import socket
import struct
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest

from orchestrator.transport import handshake

from orchestrator.transport import wire
from orchestrator.transport.handshake import HandshakeError, accept_peer, connect_peer
from orchestrator.transport.messages import Cancel, StageBatch

SECRET = b"a" * 32
ROLE = handshake.upstream_role(0)


@pytest.fixture(autouse=True)
def quick_strangers(monkeypatch):
    """A stalled stranger is dropped after 0.5 s here instead of 5."""
    monkeypatch.setattr(handshake, "HANDSHAKE_SECONDS", 0.5)


@pytest.fixture
def listener():
    sock = wire.listen("127.0.0.1")
    yield sock
    sock.close()


def accepting(listener, role=ROLE, deadline=10.0):
    return ThreadPoolExecutor(1).submit(accept_peer, listener, SECRET, role, deadline)


def port(listener) -> int:
    return listener.getsockname()[1]


def assert_connected(ours: socket.socket, theirs: socket.socket) -> None:
    wire.send_message(ours, Cancel(7))
    theirs.settimeout(10)
    assert wire.receive_message(theirs) == Cancel(7)


def test_the_peer_with_the_secret_and_the_role_gets_through(listener):
    pending = accepting(listener)
    ours = connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 10)
    theirs = pending.result(timeout=10)
    assert_connected(ours, theirs)
    assert_connected(theirs, ours)


def forged_frame() -> bytes:
    batch = StageBatch(1, 0, np.arange(2, dtype=np.int32), np.array([1], np.int32), tokens=np.array([5, 6], np.int32))
    fields, _ = batch.to_wire()
    header = msgpack.packb({"kind": batch.KIND, **fields}, use_bin_type=True)
    return struct.pack("!I", len(header)) + header


STRANGERS = {
    "silent": b"",
    "garbage": b"\x00\xff" * 64,
    "a forged frame": forged_frame(),
    "the magic, then nothing": handshake.MAGIC + bytes([len(ROLE)]) + ROLE.encode(),
}


@pytest.mark.parametrize("stranger", STRANGERS, ids=str)
def test_a_stranger_who_comes_first_is_dropped_and_the_peer_gets_in(listener, stranger):
    pending = accepting(listener)
    intruder = socket.create_connection(("127.0.0.1", port(listener)))
    intruder.sendall(STRANGERS[stranger])
    ours = connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 10)
    theirs = pending.result(timeout=10)
    assert_connected(ours, theirs)
    intruder.settimeout(10)
    try:  # the acceptor hung up on it
        assert intruder.recv(1024) == b""
    except ConnectionResetError:
        pass
    intruder.close()


def test_a_wrong_secret_is_refused_on_both_sides_and_the_peer_gets_in(listener):
    pending = accepting(listener)
    with pytest.raises(HandshakeError, match="does not hold this pipeline's secret"):
        connect_peer_with(b"b" * 32, listener)
    ours = connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 10)
    assert_connected(ours, pending.result(timeout=10))


def connect_peer_with(secret: bytes, listener, role: str = ROLE):
    return connect_peer("127.0.0.1", port(listener), secret, role, 10)


def test_a_peer_for_another_role_is_dropped(listener):
    pending = accepting(listener)
    with pytest.raises(HandshakeError):
        connect_peer_with(SECRET, listener, role=handshake.RESULT_ROLE)
    ours = connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 10)
    assert_connected(ours, pending.result(timeout=10))


def test_an_acceptor_without_the_secret_is_refused_by_the_connector(listener):
    def impostor():
        connection, _ = listener.accept()
        connection.recv(1024)
        connection.sendall(b"\x01" * 64)  # a nonce and a made-up proof
        return connection

    pending = ThreadPoolExecutor(1).submit(impostor)
    with pytest.raises(HandshakeError, match="does not hold this pipeline's secret"):
        connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 10)
    pending.result(timeout=10).close()


def test_nobody_proving_itself_ends_at_the_deadline(listener):
    intruder = socket.create_connection(("127.0.0.1", port(listener)))
    with pytest.raises(HandshakeError, match=f"no peer proved itself as {ROLE} within 2 s"):
        accept_peer(listener, SECRET, ROLE, 2.0)
    intruder.close()


@pytest.mark.parametrize("stall_seconds", [0.5, 60.0], ids=["dropped", "checked-at-once"])
def test_many_silent_strangers_do_not_keep_the_peer_out(listener, monkeypatch, stall_seconds):
    """Eight silent strangers before the peer: dropped after 0.5 s, or able
    to hold a port a minute each, the peer still gets in (each connection is
    checked in a thread of its own: one at a time, the peer waited 8
    minutes, past the acceptor's 30 s)."""
    monkeypatch.setattr(handshake, "HANDSHAKE_SECONDS", stall_seconds)
    pending = accepting(listener, deadline=30)
    intruders = [socket.create_connection(("127.0.0.1", port(listener))) for _ in range(8)]  # all silent
    ours = connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 30)
    assert_connected(ours, pending.result(timeout=30))
    for intruder in intruders:
        intruder.close()


def test_a_stranger_who_speaks_the_protocol_but_forges_its_proof_is_dropped(listener):
    pending = accepting(listener)
    forger = socket.create_connection(("127.0.0.1", port(listener)))
    forger.sendall(handshake.MAGIC + bytes([len(ROLE)]) + ROLE.encode() + b"\x02" * handshake.NONCE_BYTES)
    forger.settimeout(10)
    assert len(forger.recv(1024)) == handshake.NONCE_BYTES + handshake.PROOF_BYTES
    forger.sendall(b"\x03" * handshake.PROOF_BYTES)  # it cannot compute the real proof
    ours = connect_peer("127.0.0.1", port(listener), SECRET, ROLE, 10)
    assert_connected(ours, pending.result(timeout=10))  # the accepted connection is ours, not the forger's
    forger.close()

