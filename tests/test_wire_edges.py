"""Wire framing edges found by mutation testing: the header and array size
limits at exactly their bound, empty arrays, the exact refusal messages, map
keys that are not text, a frame of exactly one TLS record, and the options a
listening and a connected socket get."""

import socket
import struct
import sys
import threading

import msgpack
import numpy as np
import pytest

from orchestrator.transport import tls

from orchestrator.transport import wire
from orchestrator.config import KEEPALIVE_IDLE_SECONDS, KEEPALIVE_INTERVAL_SECONDS, KEEPALIVE_PROBES
from orchestrator.transport.messages import MESSAGE_TYPES, PassResult, ProtocolError, Shutdown, SpeculateFrom, StageFailure
from test_wire import receive_raw

pytestmark = pytest.mark.pure

LIVENESS_SECONDS = 30
"""Fail instead of hanging when a frame never completes; not a speed limit."""

KNOWN_KINDS = ", ".join(message_class.KIND for message_class in MESSAGE_TYPES)
"""The kinds of orchestrator.transport.messages.MESSAGE_TYPES, in its order, comma-separated
("batch, result, failure, shutdown, boundary, ..."): the list grows with the messages."""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")


def frame(header, payload: bytes = b"") -> bytes:
    packed = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return struct.pack("!I", len(packed)) + packed + payload




def round_trip(message):
    sending, receiving = socket.socketpair()
    receiving.settimeout(LIVENESS_SECONDS)
    with sending, receiving:
        sender = threading.Thread(target=lambda: (wire.send_message(sending, message), sending.shutdown(socket.SHUT_WR)))
        sender.start()
        try:
            received = wire.receive_message(receiving)
        finally:
            sender.join()
        assert receiving.recv(1) == b"", "bytes left after the frame"
    return received


# -- a peer that goes away

def test_a_peer_closing_mid_frame_is_connection_closed_by_peer():
    for cut in (b"", b"\0\0", frame({"kind": "shutdown"})[:-1]):
        with pytest.raises(wire.ConnectionClosed, match=r"^connection closed by peer$"):
            receive_raw(cut)


# -- the header

def failure_frame_header(message_length: int) -> dict:
    """A failure header whose msgpack form is 38 + message_length bytes for a
    message of 256..65535 characters: fixmap (1), "kind" (5), "failure" (8),
    "pass" (5), 1 (1), "stage" (6), 0 (1), "message" (8), str16 (3 + length)."""
    return {"kind": "failure", "pass": 1, "stage": 0, "message": "x" * message_length}


def test_a_header_of_exactly_the_largest_size_is_accepted():
    header = failure_frame_header(wire.MAX_HEADER_BYTES - 38)
    assert len(msgpack.packb(header, use_bin_type=True)) == 65536 == wire.MAX_HEADER_BYTES
    assert receive_raw(frame(header)) == StageFailure(pass_id=1, stage_index=0, message="x" * 2000)


def test_a_header_one_byte_over_the_largest_is_refused_before_it_is_read():
    header = failure_frame_header(wire.MAX_HEADER_BYTES - 37)
    with pytest.raises(wire.ProtocolError, match=r"^a header of 65537 bytes \(at most 65536\)$"):
        receive_raw(frame(header))
    with pytest.raises(wire.ProtocolError, match=r"^a header of 65537 bytes \(at most 65536\)$"):
        receive_raw(struct.pack("!I", 65537))  # no header bytes follow: refused on the length alone


def test_a_header_that_is_not_msgpack_names_the_decoder_error():
    with pytest.raises(wire.ProtocolError, match=r"^a header that is not msgpack \(FormatError\)$"):
        receive_raw(frame(b"\xc1\xc1"))  # 0xc1 is never used in msgpack


def test_a_header_map_with_a_key_that_is_not_text_is_refused():
    # {"kind": "shutdown", 1: 2}: a valid Shutdown but for the integer key
    packed = b"\x82" + msgpack.packb("kind") + msgpack.packb("shutdown") + b"\x01\x02"
    with pytest.raises(wire.ProtocolError, match=r"^a header that is not msgpack \(ValueError\)$"):
        receive_raw(frame(packed))
    assert receive_raw(frame(b"\x81" + msgpack.packb("kind") + msgpack.packb("shutdown"))) == Shutdown()


def test_an_unknown_kind_is_refused_with_the_known_kinds_listed():
    with pytest.raises(wire.ProtocolError, match=rf"^unknown message kind 'gossip' \(known kinds: {KNOWN_KINDS}\)$"):
        receive_raw(frame({"kind": "gossip"}))
    with pytest.raises(wire.ProtocolError, match=rf"^unknown message kind None \(known kinds: {KNOWN_KINDS}\)$"):
        receive_raw(frame({"pass": 1}))


def test_a_kind_that_is_not_text_is_an_unknown_kind_even_when_unhashable():
    for kind, shown in (([1, 2], r"\[1, 2\]"), ({"a": 1}, r"\{'a': 1\}"), (7, "7"), (b"batch", r"b'batch'")):
        with pytest.raises(wire.ProtocolError, match=rf"^unknown message kind {shown} \(known kinds: {KNOWN_KINDS}\)$"):
            receive_raw(frame({"kind": kind}))


def test_an_unknown_kind_is_shown_cut_to_forty_characters():
    shown = "'" + "k" * 39  # the repr, quote included, cut to 40
    with pytest.raises(wire.ProtocolError, match=rf"^unknown message kind {shown} \(known kinds: {KNOWN_KINDS}\)$"):
        receive_raw(frame({"kind": "k" * 60}))


class Probe:
    """A message class whose from_wire fails as a missed check would: it raises
    the error its header names."""

    KIND = "probe"
    ERRORS = {"key": KeyError("epoch"), "type": TypeError("not a list"), "value": ValueError("bad literal"),
              "overflow": OverflowError("too big"), "protocol": ProtocolError("epoch: expected an integer >= 0"),
              "other": RuntimeError("not the wire's")}

    @classmethod
    def from_wire(cls, header, array):
        raise cls.ERRORS[header["raise"]]


@pytest.mark.parametrize("raised, message", [
    ("key", r"^probe: malformed \(KeyError: 'epoch'\)$"),
    ("type", r"^probe: malformed \(TypeError: not a list\)$"),
    ("value", r"^probe: malformed \(ValueError: bad literal\)$"),
    ("overflow", r"^probe: malformed \(OverflowError: too big\)$"),
    ("protocol", r"^probe: epoch: expected an integer >= 0$"),
])
def test_a_check_that_a_message_missed_is_still_one_protocol_error_naming_the_kind(monkeypatch, raised, message):
    monkeypatch.setitem(wire.MESSAGE_CLASS_BY_KIND, "probe", Probe)
    with pytest.raises(wire.ProtocolError, match=message):
        receive_raw(frame({"kind": "probe", "raise": raised}))


def test_an_error_that_is_no_missed_check_is_not_turned_into_a_protocol_error(monkeypatch):
    monkeypatch.setitem(wire.MESSAGE_CLASS_BY_KIND, "probe", Probe)
    with pytest.raises(RuntimeError, match=r"^not the wire's$"):
        receive_raw(frame({"kind": "probe", "raise": "other"}))


# -- the raw array

def test_empty_arrays_travel_as_a_description_without_bytes():
    empty_context = round_trip(SpeculateFrom(epoch=3, context=np.array([], np.int32), most=2))
    assert empty_context.epoch == 3 and empty_context.most == 2
    assert empty_context.context.dtype == np.dtype("<i4") and empty_context.context.shape == (0,)
    for shape in ((0, 8), (2, 0)):
        result = round_trip(PassResult(pass_id=1, logits=np.zeros(shape, np.float32), stage_seconds=(0.5,)))
        assert result.logits.shape == shape and result.logits.dtype == np.dtype("<f4")
        assert result.stage_seconds == (0.5,)


def test_an_array_of_exactly_the_largest_size_is_accepted():
    """67108864 int32 values are 256 MiB, the limit: the receiver accepts the
    description and waits for the bytes (here the peer closes first)."""
    header = {"kind": "speculate", "epoch": 1, "most": 0, "array": ["<i4", [67108864]]}
    with pytest.raises(wire.ConnectionClosed, match=r"^connection closed by peer$"):
        receive_raw(frame(header, b"\0" * 16))


def test_an_array_one_value_over_the_largest_is_refused_before_allocation():
    header = {"kind": "speculate", "epoch": 1, "most": 0, "array": ["<i4", [67108865]]}
    with pytest.raises(wire.ProtocolError, match=r"^array: \[67108865\] of <i4 is more than 268435456 bytes$"):
        receive_raw(frame(header))


def test_an_array_size_is_counted_without_integer_overflow():
    # 2**32 * 2**32 is 2**64: 0 in 64-bit integers, 2**66 bytes in fact
    header = {"kind": "result", "pass": 1, "seconds": [], "array": ["<f4", [2**32, 2**32]]}
    with pytest.raises(wire.ProtocolError, match=r"^array: \[4294967296, 4294967296\] of <f4 is more than 268435456 bytes$"):
        receive_raw(frame(header))


def test_a_bad_array_description_is_refused_with_the_allowed_forms():
    prefix = r"^array: expected \[dtype in \('<f4', '<f2', '<i4'\), a shape of rank 1 or 2\], got "
    for description, shown in ((["<f4", [1, -1]], r"\['<f4', \[1, -1\]\]"), (["<f4", [True]], r"\['<f4', \[True\]\]"),
                               (["<f4", []], r"\['<f4', \[\]\]"), ("<f4", "'<f4'")):
        with pytest.raises(wire.ProtocolError, match=prefix + shown + "$"):
            receive_raw(frame({"kind": "result", "pass": 1, "seconds": [], "array": description}))


# -- TLS: a frame that fits one record goes as one

class Relay:
    """Two socket pairs joined by a thread per direction, keeping the bytes
    that went from end "a" to end "b"."""

    def __init__(self) -> None:
        self.a, a_inner = socket.socketpair()
        self.b, b_inner = socket.socketpair()
        self.a_to_b = bytearray()
        self.pumps = [threading.Thread(target=self._pump, args=(a_inner, b_inner, self.a_to_b), daemon=True),
                      threading.Thread(target=self._pump, args=(b_inner, a_inner, bytearray()), daemon=True)]
        for pump in self.pumps:
            pump.start()

        self.inner = (a_inner, b_inner)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, seen: bytearray) -> None:
        while chunk := source.recv(1 << 16):  # until the outer end closes
            seen += chunk
            sink.sendall(chunk)

    def join(self) -> bytes:
        """The bytes from a to b, once both outer ends are closed."""
        for pump in self.pumps:
            pump.join(LIVENESS_SECONDS)
        for inner in self.inner:
            inner.close()
        return bytes(self.a_to_b)


def application_record_lengths(stream: bytes) -> list[int]:
    """The plaintext length of each TLS 1.3 application-data record (type 23)
    after the first (the client's Finished): record length less the content
    type byte and the 16-byte AEAD tag."""
    lengths, at = [], 0
    while at < len(stream):
        record_type, length = stream[at], int.from_bytes(stream[at + 3:at + 5], "big")
        if record_type == 23:
            lengths.append(length - 17)
        at += 5 + length
    return lengths[1:]


def speculate_frame_bytes(count: int) -> int:
    """Frame bytes of SpeculateFrom(epoch=7, context of count int32, most=0) for
    256 <= count < 65536: 4 (length) + a 44-byte header: fixmap (1), "kind" (5),
    "speculate" (10), "epoch" (6), 7 (1), "most" (5), 0 (1), "array" (6),
    ["<i4", [count]] (1 + 4 + 1 + 3); then 4 bytes a value."""
    return 4 + 44 + 4 * count


@pytest.fixture(scope="module")
def certificate() -> tls.ChainCertificate:
    return tls.new_chain_certificate()


@pytest.mark.parametrize("count, records", [
    (4084, [16384]),  # 16384 bytes: exactly one record, sent whole
    (4085, [48, 16340]),  # one byte more: the header, then the array
])
def test_over_tls_a_frame_that_fits_one_record_is_sent_as_one(certificate, count, records):
    assert sum(records) == speculate_frame_bytes(count)
    message = SpeculateFrom(epoch=7, context=np.arange(count, dtype=np.int32), most=0)
    relay = Relay()
    accepted: list = []
    server = threading.Thread(target=lambda: accepted.append(tls.server_side(relay.b, certificate, LIVENESS_SECONDS)))
    server.start()
    client = tls.client_side(relay.a, certificate, LIVENESS_SECONDS)
    server.join(LIVENESS_SECONDS)
    (receiving,) = accepted
    with client, receiving:
        receiving.settimeout(LIVENESS_SECONDS)
        wire.send_message(client, message)
        received = wire.receive_message(receiving)
    stream = relay.join()
    assert received.epoch == 7 and received.most == 0 and received.context.tobytes() == message.context.tobytes()
    assert application_record_lengths(stream) == records


# -- socket options

@linux_only
def test_a_listener_queues_sixteen_connections_not_yet_accepted():
    with wire.listen("127.0.0.1") as listener:
        assert listener.type == socket.SOCK_STREAM and listener.family == socket.AF_INET
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        assert listener.getsockname()[0] == "127.0.0.1" and listener.getsockname()[1] > 0
        # Linux reports a listening socket's queue limit as tcpi_sacked (struct tcp_info, offset 28)
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        assert struct.unpack_from("=I", info, 28) == (16,)


@linux_only
def test_a_connection_sends_at_once_and_probes_a_silent_peer(monkeypatch):
    asked: list = []
    real_create_connection = socket.create_connection

    def recording_create_connection(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, *args, **kwargs):
        asked.append(timeout)
        return real_create_connection(address, timeout, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", recording_create_connection)
    with wire.listen("127.0.0.1") as listener:
        with wire.connect(*listener.getsockname()) as connected, wire.connect(*listener.getsockname(), timeout=2.5):
            assert connected.gettimeout() is None  # blocking once connected
            assert connected.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert connected.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert connected.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_SECONDS == 10
            assert connected.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == KEEPALIVE_INTERVAL_SECONDS == 5
            assert connected.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES == 3
    assert asked == [30.0, 2.5]  # the connect waits 30 s unless told otherwise
