"""Who is on the other end of a data-plane socket: a mutual challenge-response.

Every connection of the chain (stage k's upstream, the result, stage i's
cancels, a drafter) opens with this exchange, keyed by a secret made
for one pipeline (``new_secret``) that reaches each actor only as an argument
of Ray's own authenticated calls:

    connector -> acceptor:  MAGIC | len(role) (1 byte) | role | nonce_c (32 bytes)
    acceptor  -> connector: nonce_a (32) | HMAC-SHA256(secret, "acceptor|" role "|" nonce_c nonce_a)
    connector -> acceptor:  HMAC-SHA256(secret, "connector|" role "|" nonce_c nonce_a)

Each side proves it holds the secret, for this role and these fresh nonces
(no replay, no reflection: the two proofs are labelled). A peer that names
another role, proves nothing, or stalls past HANDSHAKE_SECONDS ends the
attempt, and the acceptor drops it. The acceptor checks each connection in
a thread of its own while it goes on accepting, until the peer it waits for
proves itself or its deadline passes. So a stranger who reaches a port
first can neither take the peer's place nor delay it (each silent one held
the port HANDSHAKE_SECONDS when they were checked one at a time).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
import time

from orchestrator.config import ACCEPT_POLL_SECONDS, HANDSHAKE_SECONDS, HANDSHAKES_AT_ONCE
from orchestrator.transport import wire
from orchestrator.transport.tls import ChainCertificate, TLSError, client_side, server_side
from stages.errors import SpecpipeError

MAGIC = b"specpipe-1"
NONCE_BYTES = 32
PROOF_BYTES = 32


# The roles of the chain's connections, named by what the accepting side waits for.
RESULT_ROLE = "result"  # the last stage's connection to the coordinator


def upstream_role(stage_index: int) -> str:
    """The connection that feeds stage ``stage_index`` (from the coordinator or the stage before)."""
    return f"upstream of stage {stage_index}"


def drafter_role(stage_index: int) -> str:
    """The coordinator's connection to the drafter beside stage ``stage_index``."""
    return f"drafter {stage_index}"


def cancel_role(stage_index: int) -> str:
    """Stage ``stage_index``'s connection on which the coordinator cancels passes."""
    return f"cancels of stage {stage_index}"


class HandshakeError(SpecpipeError):
    """A peer did not prove itself (or the one we reached did not); the message names the role."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _proof(secret: bytes, side: bytes, role: bytes, nonce_connector: bytes, nonce_acceptor: bytes) -> bytes:
    return hmac.new(secret, side + b"|" + role + b"|" + nonce_connector + nonce_acceptor, hashlib.sha256).digest()


def _exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        data += chunk
    return data


def introduce(sock: socket.socket, secret: bytes, role: str, wait_seconds: float) -> None:
    """The connecting side: name the role, check the acceptor's proof, give ours.
    wait_seconds: for the acceptor's answer."""
    role_bytes = role.encode()
    nonce_connector = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(wait_seconds)
    try:
        sock.sendall(MAGIC + bytes([len(role_bytes)]) + role_bytes + nonce_connector)
        reply = _exactly(sock, NONCE_BYTES + PROOF_BYTES)
        nonce_acceptor, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        expected = _proof(secret, b"acceptor", role_bytes, nonce_connector, nonce_acceptor)
        if not hmac.compare_digest(proof, expected):
            raise HandshakeError(f"the peer reached as {role} does not hold this pipeline's secret")
        sock.sendall(_proof(secret, b"connector", role_bytes, nonce_connector, nonce_acceptor))
    except OSError as error:
        raise HandshakeError(f"handshake as {role} failed: {error or type(error).__name__}") from None
    sock.settimeout(None)


def verify(sock: socket.socket, secret: bytes, role: str) -> None:
    """The accepting side: the peer must name ``role`` and prove it holds the secret."""
    sock.settimeout(HANDSHAKE_SECONDS)
    try:
        head = _exactly(sock, len(MAGIC) + 1)
        if head[: len(MAGIC)] != MAGIC:
            raise HandshakeError("not a specpipe peer")
        role_bytes = _exactly(sock, head[-1])
        if role_bytes != role.encode():
            raise HandshakeError(f"a peer for {role_bytes.decode(errors='replace')!r}, not {role!r}")
        nonce_connector = _exactly(sock, NONCE_BYTES)
        nonce_acceptor = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(nonce_acceptor + _proof(secret, b"acceptor", role_bytes, nonce_connector, nonce_acceptor))
        proof = _exactly(sock, PROOF_BYTES)
        if not hmac.compare_digest(proof, _proof(secret, b"connector", role_bytes, nonce_connector, nonce_acceptor)):
            raise HandshakeError(f"a peer for {role!r} without this pipeline's secret")
    except OSError as error:
        raise HandshakeError(f"handshake for {role} failed: {error or type(error).__name__}") from None
    sock.settimeout(None)


def accept_peer(listener: socket.socket, secret: bytes, role: str, deadline_seconds: float,
                certificate: ChainCertificate | None = None) -> socket.socket:
    """The first connection to ``listener`` that proves itself as ``role``; strangers are dropped.
    Each connection is checked in a thread of its own (at most HANDSHAKES_AT_ONCE; more are
    dropped unheard) while the listener accepts the next.
    certificate: the pipeline's (``--tls``): the connection is TLS first, the handshake inside it."""
    end = time.monotonic() + deadline_seconds
    acceptance = _Acceptance(secret, role, certificate)
    try:
        while acceptance.peer is None:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise HandshakeError(f"no peer proved itself as {role} within {deadline_seconds:.0f} s")
            listener.settimeout(min(remaining, ACCEPT_POLL_SECONDS))
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            acceptance.check(connection)
        return wire.tune(acceptance.take())
    finally:
        acceptance.close()


class _Acceptance:
    """accept_peer's connections being checked, and the first that proved itself."""

    def __init__(self, secret: bytes, role: str, certificate: ChainCertificate | None):
        self.secret, self.role, self.certificate = secret, role, certificate
        self.lock = threading.Lock()
        self.peer: socket.socket | None = None
        self.taken = False
        self.checking = 0
        self.closed = False

    def check(self, connection: socket.socket) -> None:
        with self.lock:
            if self.checking >= HANDSHAKES_AT_ONCE:
                connection.close()
                return
            self.checking += 1
        threading.Thread(target=self._prove, args=(connection,), daemon=True, name=f"handshake-{self.role}").start()

    def _prove(self, connection: socket.socket) -> None:
        try:
            if self.certificate is not None:
                connection = server_side(wire.tune(connection), self.certificate, HANDSHAKE_SECONDS)
            verify(connection, self.secret, self.role)
        except (HandshakeError, TLSError, OSError):
            connection.close()  # a stranger, or a peer of another pipeline: wait for ours
            connection = None
        with self.lock:
            self.checking -= 1
            if connection is not None and self.peer is None and not self.closed:
                self.peer, connection = connection, None
        if connection is not None:
            connection.close()  # proved itself after another did, or after accept_peer gave up

    def take(self) -> socket.socket:
        with self.lock:
            self.taken = True
            return self.peer

    def close(self) -> None:
        """accept_peer returns or gives up: a connection that proves itself
        later is closed, as is one that proved itself as it gave up."""
        with self.lock:
            self.closed = True
            left = None if self.taken else self.peer
        if left is not None:
            left.close()


def connect_peer(host: str, port: int, secret: bytes, role: str, timeout: float,
                 certificate: ChainCertificate | None = None) -> socket.socket:
    """Connect to the peer that accepts ``role`` at host:port, and prove both sides
    (in TLS first with the pipeline's ``certificate``, ``--tls``)."""
    sock = wire.connect(host, port, timeout=timeout)
    try:
        if certificate is not None:
            sock = client_side(sock, certificate, timeout)
        introduce(sock, secret, role, timeout)
    except (HandshakeError, TLSError) as error:  # either is a HandshakeError to the caller
        sock.close()
        raise HandshakeError(f"{host}:{port}: {error}") from None
    return sock
