"""Every message kind through a real socket pair and back, field by field; frames
that a socket takes in pieces; kinds and types the wire refuses."""

import dataclasses
import socket
import struct
import sys
import threading
import typing

import hypothesis
import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest

from speculators.corrections import Forks
from orchestrator.config import KEEPALIVE_IDLE_SECONDS, KEEPALIVE_INTERVAL_SECONDS, KEEPALIVE_PROBES
from orchestrator.transport import tls, wire
from orchestrator.transport.messages import (
    MESSAGE_TYPES,
    Alive,
    Cancel,
    Cancelled,
    CollectDraft,
    DraftReply,
    Message,
    PassResult,
    Ping,
    ProtocolError,
    Shutdown,
    SpeculateFrom,
    StageBatch,
    StageFailure,
)

LIVENESS_SECONDS = 30
"""Fail instead of hanging when a frame never completes; not a speed limit."""

random_numbers = np.random.default_rng(0)

EXAMPLES = [
    StageBatch(
        pass_id=3,
        keep=17,
        positions=np.arange(17, 20, dtype=np.int32),
        logit_rows=np.array([2], np.int32),
        tokens=np.array([5, 6, 7], np.int32),
    ),
    StageBatch(
        pass_id=4,
        keep=0,
        positions=np.arange(3, dtype=np.int32),
        logit_rows=np.array([0, 2], np.int32),
        hidden=random_numbers.normal(size=(3, 576)).astype(np.float32),
        stage_seconds=(0.5,),
    ),
    StageBatch(  # a lossy wire: the hidden states keep their float16
        pass_id=5,
        keep=3,
        positions=np.arange(3, 5, dtype=np.int32),
        logit_rows=np.array([0, 1], np.int32),
        hidden=random_numbers.normal(size=(2, 576)).astype(np.float16),
        stage_seconds=(0.25, 0.125),
        stage_started=(1765000000.25, 1765000000.5),
    ),
    StageBatch(  # the first of a batched pass of three sequences' windows
        pass_id=6,
        keep=40,
        positions=np.arange(40, 42, dtype=np.int32),
        logit_rows=np.array([0, 1], np.int32),
        tokens=np.array([8, 9], np.int32),
        sequence=2,
        more=2,
    ),
    PassResult(pass_id=9, logits=random_numbers.normal(size=(2, 49152)).astype(np.float32), stage_seconds=(0.1, 0.2),
               stage_started=(1765000000.0, 1765000000.125)),
    StageFailure(pass_id=2, stage_index=1, message="boom: ünïcode survives"),
    Shutdown(),
    Cancel(pass_id=12),
    Ping(number=3),
    Alive(number=3, stage_index=2),
    Cancelled(pass_id=12, stage_index=1, stage_seconds=(0.5, 0.0625), stage_started=(1765000000.0, 1765000000.5)),
    SpeculateFrom(epoch=7, context=np.array([1, 17, 4, 99999], np.int32)),
    CollectDraft(epoch=7, wait=True),
    CollectDraft(epoch=8, wait=False),
    CollectDraft(epoch=8, wait=False, sequence=5),
    CollectDraft(epoch=8, wait=False, keep=True),
    SpeculateFrom(epoch=9, context=np.array([1, 2], np.int32), most=3, sequence=7),
    DraftReply(epoch=9, tokens=np.array([3], np.int32), busy_seconds=0.5, sequence=7),
    DraftReply(epoch=7, tokens=np.array([4, 5, 6], np.int32), busy_seconds=0.03125),
    DraftReply(epoch=8, tokens=np.array([], np.int32), busy_seconds=0.0, error="drafter crashed"),
    SpeculateFrom(epoch=10, context=np.array([1, 2, 3, 4], np.int32), most=3, forks=Forks(2, 2, 4.5)),
    DraftReply(epoch=10, tokens=np.array([5], np.int32), busy_seconds=0.25, corrections=((2, (7, 8, 9)), (3, (11,)))),
]
"""At least one of every message class, every field set away from its default somewhere."""


def example_name(message: Message) -> str:
    return type(message).__name__


def socket_pair() -> tuple[socket.socket, socket.socket]:
    sending, receiving = socket.socketpair()
    receiving.settimeout(LIVENESS_SECONDS)
    return sending, receiving


def send_and_receive(sending: "socket.socket | SendRecorder", receiving: socket.socket, message: Message) -> Message:
    """Sends from a thread (a large message fills the socket buffer before it is
    read), then closes the sending direction: a frame shorter than its header
    says ends in ConnectionClosed, and a longer one leaves bytes behind."""
    sender_errors: list[BaseException] = []

    def send() -> None:
        try:
            wire.send_message(sending, message)
        except BaseException as error:
            sender_errors.append(error)
        finally:
            sending.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        received = wire.receive_message(receiving)
    finally:
        sender.join()
    assert not sender_errors, sender_errors
    assert receiving.recv(1) == b"", "bytes left after the frame"
    return received


def round_trip(message: Message) -> Message:
    sending, receiving = socket_pair()
    with sending, receiving:
        return send_and_receive(sending, receiving, message)


def assert_same_message(received: Message, sent: Message) -> None:
    assert type(received) is type(sent)
    for field in dataclasses.fields(sent):
        sent_value, received_value = getattr(sent, field.name), getattr(received, field.name)
        if isinstance(sent_value, np.ndarray):
            assert isinstance(received_value, np.ndarray), field.name
            assert received_value.dtype == sent_value.dtype, field.name
            assert received_value.shape == sent_value.shape, field.name
            assert received_value.tobytes() == sent_value.tobytes(), field.name
        else:
            assert type(received_value) is type(sent_value), field.name
            assert received_value == sent_value, field.name


@pytest.mark.parametrize("message", EXAMPLES, ids=example_name)
def test_every_field_survives_the_round_trip(message):
    assert_same_message(round_trip(message), message)


def test_examples_cover_every_message_class():
    """A new message class fails here until it has an example above."""
    assert set(wire.MESSAGE_CLASS_BY_KIND.values()) == set(MESSAGE_TYPES) == set(typing.get_args(Message))
    assert len(wire.MESSAGE_CLASS_BY_KIND) == len(MESSAGE_TYPES), "two message classes share a KIND"
    assert {type(example) for example in EXAMPLES} == set(MESSAGE_TYPES)


class SendRecorder:
    """The sending socket as send_message sees it, counting the sendmsg calls
    that took only part of what they were offered."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.partial_sends = 0

    def sendmsg(self, buffers) -> int:
        offered = sum(memoryview(buffer).nbytes for buffer in buffers)
        sent = self.sock.sendmsg(buffers)
        if sent < offered:
            self.partial_sends += 1
        return sent

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)


def test_large_logits_survive_partial_sends():
    logits = np.random.default_rng(1).normal(size=(8, 49152)).astype(np.float32)  # 1.5 MB
    message = PassResult(9, logits, (0.1, 0.2))
    sending, receiving = socket_pair()
    with sending, receiving:
        sending.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        # with a timeout the socket is non-blocking underneath: sendmsg sends what fits and says how much
        sending.settimeout(LIVENESS_SECONDS)
        recorder = SendRecorder(sending)
        received = send_and_receive(recorder, receiving, message)
    assert recorder.partial_sends > 0, "the socket took every sendmsg whole: nothing tested"
    assert_same_message(received, message)


class ReaderWaits(SendRecorder):
    """Sets ``partial`` at the first sendmsg the socket took only part of."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.partial = threading.Event()

    def sendmsg(self, buffers) -> int:
        sent = super().sendmsg(buffers)
        if self.partial_sends:
            self.partial.set()
        return sent


@pytest.mark.parametrize("message", [
    PassResult(4, np.random.default_rng(2).normal(size=(6, 49152)).astype(np.float32), (0.5,)),
    StageBatch(pass_id=6, keep=2, positions=np.arange(2, 514, dtype=np.int32), logit_rows=np.array([0, 511], np.int32),
               hidden=np.random.default_rng(3).normal(size=(512, 576)).astype(np.float16), stage_seconds=(0.25,)),
], ids=example_name)
def test_a_tcp_frame_sent_in_pieces_arrives_intact(message):
    """Loopback TCP with a small send buffer and a send timeout; the reader reads
    nothing until a sendmsg has come back partial, so the rest of the frame
    must be sent from where that call stopped."""
    listener = wire.listen("127.0.0.1")
    with listener:
        sending = socket.create_connection(listener.getsockname(), timeout=LIVENESS_SECONDS)
        receiving, _ = listener.accept()
    with sending, receiving:
        sending.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        receiving.settimeout(LIVENESS_SECONDS)
        recorder = ReaderWaits(sending)
        received: list[Message] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                assert recorder.partial.wait(LIVENESS_SECONDS), "no sendmsg came back partial"
                received.append(wire.receive_message(receiving))
            except BaseException as error:
                errors.append(error)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            wire.send_message(recorder, message)
        finally:
            recorder.partial.set()  # never leave the reader waiting
            sending.shutdown(socket.SHUT_WR)  # a frame cut short ends in ConnectionClosed, not a wait
            reader.join()
        assert not errors, errors
        assert receiving.recv(1) == b"", "bytes left after the frame"
    assert recorder.partial_sends > 0
    assert_same_message(received[0], message)


def test_unknown_kind_is_refused_by_name():
    sending, receiving = socket_pair()
    with sending, receiving:
        header = msgpack.packb({"kind": "gossip", "pass": 1}, use_bin_type=True)
        sending.sendall(struct.pack("!I", len(header)) + header)
        with pytest.raises(wire.ProtocolError, match="unknown message kind 'gossip'"):
            wire.receive_message(receiving)


def test_only_messages_can_be_sent():
    sending, receiving = socket_pair()
    with sending, receiving:
        with pytest.raises(TypeError, match="cannot send dict"):
            wire.send_message(sending, {"kind": "shutdown"})  # type: ignore[arg-type]


def frame(header, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True) if not isinstance(header, bytes) else header
    return struct.pack("!I", len(packed)) + packed + payload


def receive_raw(data: bytes):
    """What receive_message makes of these bytes, then the peer closing."""
    sending, receiving = socket_pair()
    with sending, receiving:
        sender = threading.Thread(target=lambda: (sending.sendall(data), sending.shutdown(socket.SHUT_WR)))
        sender.start()
        try:
            return wire.receive_message(receiving)
        finally:
            sender.join()


def int32(*values) -> bytes:
    return np.array(values, np.int32).tobytes()


BATCH = {"kind": "batch", "pass": 1, "sequence": 0, "keep": 0, "positions": int32(0, 1), "rows": int32(1),
         "tokens": int32(5, 6), "seconds": [], "more": 0}


@pytest.mark.parametrize("data, message", [
    (struct.pack("!I", 2**32 - 1), "a header of 4294967295 bytes"),
    (frame(b"\xc1\xc1"), "not msgpack"),
    (frame([1, 2]), "a header that is a list, not a map"),
    (frame({"kind": 7}), "unknown message kind 7"),
    (frame({"kind": "result", "pass": 1, "seconds": [], "array": ["|O", [2]]}), "array: expected [dtype"),
    (frame({"kind": "result", "pass": 1, "seconds": [], "array": ["<f4", [1, 2, 3]]}), "array: expected [dtype"),
    (frame({"kind": "result", "pass": 1, "seconds": [], "array": ["<f4", [-1]]}), "array: expected [dtype"),
    (frame({"kind": "result", "pass": 1, "seconds": [], "array": ["<f4", [2**31, 2**31]]}), "is more than"),
    (frame({"kind": "result", "pass": 1, "seconds": [], "array": [">f4", [1, 1]]}, b"\0" * 4), "array: expected"),
    (frame({"kind": "result", "pass": "one", "seconds": [], "array": ["<f4", [1, 1]]}, b"\0" * 4),
     "result: pass: expected an integer"),
    (frame({"kind": "result", "pass": 1, "seconds": [], "array": ["<f4", [4]]}, b"\0" * 16),
     "logits: expected a rank-2 array"),
    (frame({"kind": "result", "pass": 1, "seconds": [float("nan")], "array": ["<f4", [1, 1]]}, b"\0" * 4),
     "seconds: expected seconds"),
    (frame({"kind": "result", "pass": 1, "seconds": [0.5], "started": [1.0, 2.0], "array": ["<f4", [1, 1]]},
           b"\0" * 4), "started: 2 times for 1 stage times"),
    (frame({**BATCH, "seconds": [0.5], "started": "now"}), "started: expected a list of seconds"),
    (frame({"kind": "cancelled", "pass": 1, "stage": 0, "seconds": [0.5], "started": [-1.0]}), "started: expected"),
    (frame({**BATCH, "tokens": int32(5)}), "tokens: 1 for 2 positions"),
    (frame({**BATCH, "rows": int32(2)}), "rows: outside the batch's 2 rows"),
    (frame({**BATCH, "positions": b"\0\0\0"}), "positions: expected int32 bytes"),
    (frame({**BATCH, "tokens": None}), "exactly one of tokens and hidden"),
    (frame({**BATCH, "keep": -1}), "keep: expected an integer >= 0"),
    (frame({**BATCH, "array": ["<f4", [3, 4]]}, b"\0" * 48), "hidden: 3 rows for 2 positions"),
    (frame({k: v for k, v in BATCH.items() if k != "sequence"}), "sequence: expected an integer"),
    (frame({**BATCH, "more": -1}), "more: expected an integer >= 0"),
    (frame({**BATCH, "more": 256}), "more: 256 batches to follow (at most 255)"),
    (frame({**BATCH, "more": 1, "parents": int32(-1, 0)}), "more: a batched pass carries chains"),
    (frame({**BATCH, "more": 1, "positions": b"", "tokens": b"", "rows": b""}), "more: a batched pass carries"),
    (frame({**BATCH, "source": 2}), "source: a copy carries no tokens"),
    (frame({**BATCH, "source": -1, "positions": b"", "tokens": b"", "rows": b""}), "source: expected an integer >= 0"),
    (frame({"kind": "collect", "epoch": 1, "wait": "yes"}), "wait: expected true or false"),
    (frame({"kind": "speculate", "epoch": 1, "array": ["<f4", [3]]}, b"\0" * 12), "context: expected"),
    (frame({"kind": "failure", "pass": 1, "stage": 0, "message": b"bytes"}), "message: expected text"),
])
def test_a_frame_that_breaks_the_protocol_is_one_protocol_error_naming_the_field(data, message):
    with pytest.raises(wire.ProtocolError) as caught:
        receive_raw(data)
    assert message in str(caught.value)


def encoded(message: Message) -> bytes:
    """The bytes send_message writes for a message."""
    sending, receiving = socket_pair()
    chunks = []
    with sending, receiving:
        reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: receiving.recv(1 << 20), b"")))
        reader.start()
        wire.send_message(sending, message)
        sending.shutdown(socket.SHUT_WR)
        reader.join()
    return b"".join(chunks)


VALID_FRAMES = [encoded(example) for example in EXAMPLES if not isinstance(example, PassResult)] + [
    encoded(PassResult(1, np.ones((2, 8), np.float32), (0.5,)))]


@hypothesis.settings(max_examples=2000, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(st.data())
def test_fuzzed_frames_end_in_one_of_two_errors(data):
    """Valid frames of every kind, bytes flipped, cut, spliced or appended:
    each decodes, or ends in ProtocolError or ConnectionClosed: nothing else."""
    frame_bytes = bytearray(data.draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(data.draw(st.integers(1, 4))):
        operation = data.draw(st.sampled_from(["flip", "cut", "splice", "append"]))
        at = data.draw(st.integers(0, max(0, len(frame_bytes) - 1)))
        if operation == "flip" and frame_bytes:
            frame_bytes[at] = data.draw(st.integers(0, 255))
        elif operation == "cut":
            del frame_bytes[at:]
        elif operation == "splice":
            frame_bytes[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            frame_bytes += data.draw(st.binary(max_size=64))
    try:
        receive_raw(bytes(frame_bytes))
    except (wire.ProtocolError, wire.ConnectionClosed):
        pass


@hypothesis.settings(max_examples=500, deadline=None)
@hypothesis.given(st.binary(max_size=256))
def test_random_bytes_end_in_one_of_two_errors(data):
    try:
        receive_raw(data)
    except (wire.ProtocolError, wire.ConnectionClosed):
        pass


# -- the header and array size limits at exactly their bound, empty arrays, the exact refusal messages, map
# keys that are not text, a frame of exactly one TLS record, and the options a listening and a connected socket get

KNOWN_KINDS = ", ".join(message_class.KIND for message_class in MESSAGE_TYPES)
"""The kinds of orchestrator.transport.messages.MESSAGE_TYPES, in its order, comma-separated
("batch, result, failure, shutdown, cancel, ..."): the list grows with the messages."""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")


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
            # unacknowledged data waits no longer than an idle socket: 10 + 5 x 3 s
            assert connected.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 25_000
    assert asked == [30.0, 2.5]  # the connect waits 30 s unless told otherwise


def int32s(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


@pytest.mark.parametrize("at, lengths, tokens, message", [
    ([2], [2], [7], r"fork_lengths: each at least 1, adding up to the fork_tokens sent"),
    ([2], [0], [], r"fork_lengths: each at least 1, adding up to the fork_tokens sent"),
    ([2, 3], [1], [7], r"fork_at, fork_lengths: 2 positions and 1 lengths"),
    ([0], [1], [7], r"fork_at: positions from 1"),
])
def test_a_draft_replys_corrections_must_add_up(at, lengths, tokens, message):
    header = {"kind": "draft", "epoch": 1, "tokens": int32s([3]), "busy": 0.0, "error": "",
              "fork_at": int32s(at), "fork_lengths": int32s(lengths), "fork_tokens": int32s(tokens)}
    with pytest.raises(wire.ProtocolError, match=message):
        receive_raw(frame(header))


@pytest.mark.parametrize("rounds", [-1.0, float("nan"), float("inf"), "4", True])
def test_corrections_asked_within_a_bad_number_of_rounds_are_refused(rounds):
    header = {"kind": "speculate", "epoch": 1, "most": 3, "fork_from": 2, "forks": 2, "fork_rounds": rounds}
    with pytest.raises(wire.ProtocolError, match=r"^fork_rounds: expected draft rounds"):
        SpeculateFrom.from_wire(header, np.array([1, 2, 3], np.int32))
