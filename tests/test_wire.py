"""Every message kind through a real socket pair and back, field by field; frames
that a socket takes in pieces; kinds and types the wire refuses."""

import dataclasses
import socket
import struct
import threading
import typing

import hypothesis
import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest

from orchestrator.transport import wire
from orchestrator.transport.messages import (
    MESSAGE_TYPES,
    Boundary,
    Cancel,
    Cancelled,
    CollectDraft,
    DraftReply,
    Message,
    PassResult,
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
    ),
    PassResult(pass_id=9, logits=random_numbers.normal(size=(2, 49152)).astype(np.float32), stage_seconds=(0.1, 0.2)),
    StageFailure(pass_id=2, stage_index=1, message="boom: ünïcode survives"),
    Shutdown(),
    Boundary(pass_id=11, stage_index=0),
    Cancel(pass_id=12),
    Cancelled(pass_id=12, stage_index=1, stage_seconds=(0.5, 0.0625)),
    SpeculateFrom(epoch=7, context=np.array([1, 17, 4, 99999], np.int32)),
    CollectDraft(epoch=7, wait=True),
    CollectDraft(epoch=8, wait=False),
    DraftReply(epoch=7, tokens=np.array([4, 5, 6], np.int32), busy_seconds=0.03125),
    DraftReply(epoch=8, tokens=np.array([], np.int32), busy_seconds=0.0, error="drafter crashed"),
]
"""At least one of every message class, every field set away from its default somewhere."""

pytestmark = pytest.mark.pure


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
         "tokens": int32(5, 6), "seconds": []}


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
    (frame({**BATCH, "tokens": int32(5)}), "tokens: 1 for 2 positions"),
    (frame({**BATCH, "rows": int32(2)}), "rows: outside the batch's 2 rows"),
    (frame({**BATCH, "positions": b"\0\0\0"}), "positions: expected int32 bytes"),
    (frame({**BATCH, "tokens": None}), "exactly one of tokens and hidden"),
    (frame({**BATCH, "keep": -1}), "keep: expected an integer >= 0"),
    (frame({**BATCH, "array": ["<f4", [3, 4]]}, b"\0" * 48), "hidden: 3 rows for 2 positions"),
    (frame({k: v for k, v in BATCH.items() if k != "sequence"}), "sequence: expected an integer"),
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
