"""Framing of pipeline messages on a TCP socket.

A frame is ``u32 header length | msgpack header | raw array bytes``. Each
message class in ``orchestrator.messages`` declares its own header entries and
its one large array (``to_wire`` / ``from_wire``); this module adds the
header's ``kind`` entry, frames the message, and decodes a frame through
``MESSAGE_CLASS_BY_KIND``. Small arrays (tokens, positions, rows) ride inside
the header as bytes; the one large array of a message (hidden states, logits,
a drafting context) follows as a raw frame described by the header's ``array``
entry ``[dtype, shape]``, written with one ``sendmsg`` from the array's own
memory and read with ``recv_into`` straight into a new array: no copy through
Python objects. Measured on these machines: a msgpack header plus a raw frame
costs microseconds whatever the size, while packing ``tobytes()`` into msgpack
swings up to milliseconds (shared/design/ray.md).
"""

from __future__ import annotations

import socket
import struct

import msgpack
import numpy as np

from orchestrator.messages import MESSAGE_TYPES, Message

_LENGTH = struct.Struct("!I")

MESSAGE_CLASS_BY_KIND: dict[str, type[Message]] = {message_class.KIND: message_class for message_class in MESSAGE_TYPES}
"""Which class a received header's ``kind`` names."""


class ConnectionClosed(ConnectionError):
    """The other end closed the connection."""


def send_message(sock: socket.socket, message: Message) -> None:
    message_class = type(message)
    if MESSAGE_CLASS_BY_KIND.get(getattr(message_class, "KIND", None)) is not message_class:
        raise TypeError(f"cannot send {message_class.__name__}: not a message class of orchestrator.messages.MESSAGE_TYPES")
    fields, array = message.to_wire()
    header = {"kind": message.KIND, **fields}
    if array is not None:
        array = np.ascontiguousarray(array)
        header["array"] = [array.dtype.str, list(array.shape)]
    packed = msgpack.packb(header, use_bin_type=True)
    parts: list[bytes | memoryview] = [_LENGTH.pack(len(packed)) + packed]
    if array is not None and array.nbytes:
        parts.append(memoryview(array).cast("B"))
    _send_all(sock, parts)


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(part) for part in parts]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _receive_exactly(sock: socket.socket, buffer: memoryview) -> None:
    while len(buffer):
        count = sock.recv_into(buffer)
        if count == 0:
            raise ConnectionClosed("connection closed by peer")
        buffer = buffer[count:]


def receive_message(sock: socket.socket) -> Message:
    length_bytes = bytearray(_LENGTH.size)
    _receive_exactly(sock, memoryview(length_bytes))
    (length,) = _LENGTH.unpack(length_bytes)
    packed = bytearray(length)
    _receive_exactly(sock, memoryview(packed))
    header = msgpack.unpackb(packed, raw=False)
    kind = header.pop("kind", None)
    array_description = header.pop("array", None)
    array: np.ndarray | None = None
    if array_description is not None:
        dtype, shape = array_description
        array = np.empty(shape, dtype=np.dtype(dtype))
        if array.nbytes:
            _receive_exactly(sock, memoryview(array).cast("B"))
    message_class = MESSAGE_CLASS_BY_KIND.get(kind)
    if message_class is None:
        raise ValueError(f"unknown message kind {kind!r} (known kinds: {', '.join(MESSAGE_CLASS_BY_KIND)})")
    return message_class.from_wire(header, array)


def listen(host: str) -> socket.socket:
    """A listening socket on host, on a free port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(1)
    return listener


def tune(sock: socket.socket) -> socket.socket:
    """Small messages must leave at once: no Nagle delay."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(host: str, port: int, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    return tune(sock)
