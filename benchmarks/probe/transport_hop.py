"""What one hop of the chain costs, per transport, side by side in one run.

A hop: one message from one process to another over loopback TCP, framed,
sent, received and decoded there. An echo relay in a child process receives
each message and sends it back, as a stage hands its pass on; a hop is half a
round trip. The transports:

    socket chain        orchestrator.transport.wire over a tuned plain TCP socket (today's chain)
    socket chain + TLS  the same in TLS 1.3 (orchestrator.transport.tls, the per-run certificate)
    zmq                 pyzmq PAIR sockets, no security
    zmq CURVE           pyzmq PAIR sockets with CURVE: encrypted, both ends' keys pinned (ZAP)

Every transport carries the messages of orchestrator.transport.messages: the socket
chains through orchestrator.transport.wire, zmq as two frames (the msgpack header, then
the array from its own memory, zero-copy on both sides). The messages: a
decode step's hidden state (1 x 576 float32, SmolLM2-135M's n_embd), a
9-token batch's, and a result's logits (1 x 49152 float32). A repetition is
ROUND_TRIPS of each, after a warm-up; repetitions go round every transport
in turn, the order rotating (benchmarks.side_by_side), so load from other
processes falls on all of them alike. Per-hop time: median and min-max over
the repetitions.

    python -m benchmarks.probe transport-hop [--repetitions 5] [--transport NAME ...] [--json PATH]

The zmq transports need pyzmq (not a dependency of specpipe: ``pip install
pyzmq``); ``--transport "socket chain" --transport "socket chain + TLS"``
runs without it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import click
import msgpack
import numpy as np

from benchmarks.probe.harness import Report, probe, table
from benchmarks.side_by_side import Outcome, Samples, side_by_side, spread
from orchestrator.transport import tls, wire
from orchestrator.transport.fields import ProtocolError
from orchestrator.transport.messages import Message, PassResult, Shutdown, StageBatch

N_EMBD, N_VOCAB = 576, 49152  # SmolLM2-135M
WARMUP_ROUND_TRIPS = 50


def _batch(tokens: int) -> StageBatch:
    hidden = np.random.default_rng(tokens).normal(size=(tokens, N_EMBD)).astype(np.float32)
    return StageBatch(pass_id=1, keep=100, positions=np.arange(100, 100 + tokens, dtype=np.int32),
                      logit_rows=np.arange(tokens, dtype=np.int32), hidden=hidden, stage_seconds=(0.01,))


MESSAGES: dict[str, tuple[Message, int]] = {  # name: (message, round trips per repetition)
    "decode step: StageBatch 1 x 576 f32 (2.3 KB)": (_batch(1), 2000),
    "9-token batch: StageBatch 9 x 576 f32 (20.7 KB)": (_batch(9), 2000),
    "logits: PassResult 1 x 49152 f32 (196 KB)": (
        PassResult(1, np.random.default_rng(0).normal(size=(1, N_VOCAB)).astype(np.float32), (0.01, 0.02)), 300),
}


@dataclass
class Link:
    """One end of a transport: send a message, receive the next one, close."""

    send: Callable[[Message], None]
    receive: Callable[[], Message]
    close: Callable[[], None]
    note: str = ""  # what was negotiated, for the report


@dataclass
class End:
    """What one side needs to open its end of a transport. The accepting side
    (this process) binds, then starts the relay (a child process) that connects."""

    transport: str
    accepting: bool
    certificate: tls.ChainCertificate
    curve_server: tuple[bytes, bytes]  # (public, secret), z85
    curve_client: tuple[bytes, bytes]
    port: int = 0
    relay: multiprocessing.Process | None = field(default=None, repr=False)

    def tcp_socket(self) -> socket.socket:
        if not self.accepting:
            return wire.connect("127.0.0.1", self.port)
        with wire.listen("127.0.0.1") as listener:
            self._start_relay(listener.getsockname()[1])
            connection, _ = listener.accept()
        return wire.tune(connection)

    def zmq_socket(self, sock):
        if not self.accepting:
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            return sock
        self._start_relay(sock.bind_to_random_port("tcp://127.0.0.1"))
        return sock

    def _start_relay(self, port: int) -> None:
        child = End(self.transport, False, self.certificate, self.curve_server, self.curve_client, port)
        self.relay = multiprocessing.get_context("spawn").Process(target=relay, args=(child,), daemon=True)
        self.relay.start()


# -- the transports: one function each, both ends --------------------------------------------------------


def socket_chain(end: End) -> Link:
    """Today's chain: orchestrator.transport.wire on a tuned plain TCP socket."""
    return _wire_link(end.tcp_socket())


def socket_chain_tls(end: End) -> Link:
    """The same in TLS 1.3 (orchestrator.transport.tls)."""
    sock = end.tcp_socket()
    sock = tls.server_side(sock, end.certificate) if end.accepting else tls.client_side(sock, end.certificate)
    return _wire_link(sock, note=f"{sock.version()} {sock.cipher()[0]}")


def zmq_pair(end: End) -> Link:
    """pyzmq PAIR sockets, no security."""
    import zmq

    context = zmq.Context()
    return _zmq_link(context, end.zmq_socket(context.socket(zmq.PAIR)), note=f"libzmq {zmq.zmq_version()}")


def zmq_curve(end: End) -> Link:
    """pyzmq PAIR sockets with CURVE; the server lets in the client's key only (a ZAP handler)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    authenticator = None
    if end.accepting:
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback("*", _PinnedKey(end.curve_client[0]))
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = end.curve_server
    else:
        sock.curve_serverkey = end.curve_server[0]
        sock.curve_publickey, sock.curve_secretkey = end.curve_client
    return _zmq_link(context, end.zmq_socket(sock), authenticator, note=f"libzmq {zmq.zmq_version()} CURVE")


TRANSPORTS: dict[str, Callable[[End], Link]] = {
    "socket chain": socket_chain,
    "socket chain + TLS": socket_chain_tls,
    "zmq": zmq_pair,
    "zmq CURVE": zmq_curve,
}
BASELINE = "socket chain"


def _wire_link(sock: socket.socket, note: str = "") -> Link:
    return Link(lambda message: wire.send_message(sock, message), lambda: wire.receive_message(sock), sock.close, note)


def _zmq_link(context, sock, authenticator=None, note: str = "") -> Link:
    def close() -> None:
        sock.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        context.term()

    return Link(lambda message: sock.send_multipart(_frames(message), copy=False),
                lambda: _message(sock.recv_multipart(copy=False)), close, note)


@dataclass(frozen=True)
class _PinnedKey:
    """A ZAP credentials provider that knows one client key."""

    key: bytes

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def _frames(message: Message) -> list:
    """A message as zmq frames: the msgpack header (wire's header), then its array's own memory."""
    fields, array = message.to_wire()
    header = {"kind": message.KIND, **fields}
    frames = []
    if array is not None:
        array = np.ascontiguousarray(array)
        header["array"] = [array.dtype.str, list(array.shape)]
        frames.append(memoryview(array).cast("B"))
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _message(frames) -> Message:
    """zmq frames back as a message, with wire's checks in short (zmq has checked the frame sizes)."""
    header = msgpack.unpackb(frames[0].bytes, raw=False, strict_map_key=True)
    message_class = wire.MESSAGE_CLASS_BY_KIND.get(header.pop("kind", None))
    description = header.pop("array", None)
    if message_class is None or (description is None) != (len(frames) == 1):
        raise ProtocolError("not a message")
    array = None
    if description is not None:
        if description[0] not in wire.ARRAY_DTYPES:
            raise ProtocolError(f"array: {description[0]!r:.20}")
        array = np.frombuffer(frames[1].buffer, dtype=description[0]).reshape(description[1])
    return message_class.from_wire(header, array)


# -- the relay and the timing loop -----------------------------------------------------------------------


def relay(end: End) -> None:
    """The child process: echo every message until Shutdown (echoed too)."""
    link = TRANSPORTS[end.transport](end)
    while True:
        message = link.receive()
        link.send(message)
        if isinstance(message, Shutdown):
            break
    link.close()


def hop_seconds(link: Link, message: Message, round_trips: int) -> float:
    """Seconds of one hop: round trips of the message through the relay, halved."""
    for _ in range(WARMUP_ROUND_TRIPS):
        link.send(message)
        if type(link.receive()) is not type(message):
            raise RuntimeError("the relay sent back something else")
    started = time.perf_counter()
    for _ in range(round_trips):
        link.send(message)
        link.receive()
    return (time.perf_counter() - started) / round_trips / 2


def _uses_zmq(transports: list[str]) -> bool:
    return any(name.startswith("zmq") for name in transports)


@contextlib.contextmanager
def opened(transports: list[str]):
    """Every transport's link to its own relay, open at once; Shutdown and close at the end."""
    keys = {"curve_server": (b"", b""), "curve_client": (b"", b"")}
    if _uses_zmq(transports):
        import zmq

        keys = {"curve_server": zmq.curve_keypair(), "curve_client": zmq.curve_keypair()}
    common = dict(certificate=tls.new_chain_certificate(), **keys)
    links: dict[str, Link] = {}
    ends: list[End] = []
    try:
        for name in transports:
            ends.append(End(name, True, **common))
            links[name] = TRANSPORTS[name](ends[-1])
        yield links
    finally:
        for link in links.values():
            with contextlib.suppress(Exception):
                link.send(Shutdown())
                link.receive()
            link.close()
        for end in ends:
            if end.relay is not None:
                end.relay.join(10)


def measure(repetitions: int, transports: list[str]) -> tuple[Samples, dict]:
    """Per-hop seconds of every message (a figure each) for every transport
    (a mode each), and what each transport negotiated."""
    with opened(transports) as links:
        def run(name: str, repetition: int) -> Outcome:
            return Outcome({message_name: hop_seconds(links[name], message, round_trips)
                            for message_name, (message, round_trips) in MESSAGES.items()})

        samples = side_by_side(transports, repetitions, run)
        notes = {name: link.note for name, link in links.items() if link.note}
    return samples, notes


def versions(transports: list[str]) -> dict:
    found = {"openssl": ssl.OPENSSL_VERSION}
    if _uses_zmq(transports):
        import zmq

        found.update(pyzmq=zmq.pyzmq_version(), libzmq=zmq.zmq_version())
    return found


def rows(samples: Samples, transports: list[str]) -> list[list[str]]:
    """Per message: each transport's per-hop median (min-max) in microseconds, and its ratio to today's chain."""
    found = []
    for message_name in MESSAGES:
        cells = [message_name]
        baseline = samples.median(BASELINE, message_name) if BASELINE in transports else None
        for name in transports:
            cell = spread(samples.of(name, message_name), 1e6, 1)
            if name != BASELINE and baseline:
                cell += f", {samples.median(name, message_name) / baseline:.2f}x"
            cells.append(cell)
        found.append(cells)
    return found


@probe("transport-hop", repetitions=5)
@click.option("--transport", "chosen", multiple=True, type=click.Choice(list(TRANSPORTS)),
              help="Only these (repeatable; default: all). The ratio needs 'socket chain'.")
def transport_hop(repetitions: int, chosen: tuple[str, ...]) -> Report:
    """One hop of the chain (a message to another process over loopback TCP
    and decoded there) per transport: plain sockets, TLS, zmq, zmq CURVE."""
    transports = list(chosen) or list(TRANSPORTS)
    samples, notes = measure(repetitions, transports)
    lines = table(["message (per-hop us)", *transports], rows(samples, transports))
    title = (f"Per-hop time (round trip / 2) over loopback TCP between two processes; x = median against "
             f"'{BASELINE}'. " + "; ".join(f"{name}: {note}" for name, note in notes.items()))
    round_trips = {message_name: count for message_name, (_, count) in MESSAGES.items()}
    return Report(title, lines, {"": samples},
                  {"versions": versions(transports), "notes": notes, "round_trips_per_repetition": round_trips})
