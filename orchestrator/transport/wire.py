"""Framing of pipeline messages on a TCP socket.

A frame is ``u32 header length | msgpack header | raw array bytes``. Each
message class in ``orchestrator.transport.messages`` declares its own header entries and
its one large array (``to_wire`` / ``from_wire``); this module adds the
header's ``kind`` entry, frames the message, and decodes a frame through
``MESSAGE_CLASS_BY_KIND``. Small arrays (tokens, positions, rows) ride inside
the header as bytes; the one large array of a message (hidden states, logits,
a drafting context) follows as a raw frame described by the header's ``array``
entry ``[dtype, shape]``, written with one ``sendmsg`` from the array's own
memory and read with ``recv_into`` straight into a new array: no copy through
Python objects (a TLS socket, orchestrator.transport.tls, has no ``sendmsg``: there a
frame that fits one TLS record goes as one ``sendall``, a larger one header
then array). Measured on these machines: a msgpack header plus a raw frame
costs microseconds whatever the size, while packing ``tobytes()`` into msgpack
swings up to milliseconds. Nothing received is
trusted: the header's size, the array's dtype, rank and size are checked
before anything is allocated, and every message's fields by its ``from_wire``
(``ProtocolError``).
"""

from __future__ import annotations

import socket
import ssl
import struct

import msgpack
import numpy as np

from orchestrator.config import (CONNECT_SECONDS, KEEPALIVE_IDLE_SECONDS, KEEPALIVE_INTERVAL_SECONDS, KEEPALIVE_PROBES,
                                 MAX_ARRAY_BYTES, MAX_HEADER_BYTES)
from orchestrator.transport.fields import ProtocolError
from orchestrator.transport.messages import MESSAGE_TYPES, Message

_LENGTH = struct.Struct("!I")

# What a received frame may be (and config.MAX_HEADER_BYTES, MAX_ARRAY_BYTES);
# anything else is a ProtocolError before any allocation it asks for.
ARRAY_DTYPES = ("<f4", "<f2", "<i4")  # little-endian float32, float16, int32: never object or structured

TLS_RECORD_BYTES = 16 * 1024  # the most plaintext one TLS record carries

MESSAGE_CLASS_BY_KIND: dict[str, type[Message]] = {message_class.KIND: message_class for message_class in MESSAGE_TYPES}
"""Which class a received header's ``kind`` names."""


class ConnectionClosed(ConnectionError):
    """The other end closed the connection."""


def send_message(sock: socket.socket, message: Message) -> None:
    message_class = type(message)
    if MESSAGE_CLASS_BY_KIND.get(getattr(message_class, "KIND", None)) is not message_class:
        raise TypeError(f"cannot send {message_class.__name__}: not a message class of orchestrator.transport.messages.MESSAGE_TYPES")
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
    if isinstance(sock, ssl.SSLSocket):  # orchestrator.transport.tls; joined, a small frame is one record and one segment
        if sum(len(part) for part in parts) <= TLS_RECORD_BYTES:
            sock.sendall(b"".join(parts))
        else:
            for part in parts:
                sock.sendall(part)
        return
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
    """The next message; a frame that breaks the protocol raises ProtocolError
    (the connection is then out of step: close it), a closed one ConnectionClosed."""
    length_bytes = bytearray(_LENGTH.size)
    _receive_exactly(sock, memoryview(length_bytes))
    (length,) = _LENGTH.unpack(length_bytes)
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
    packed = bytearray(length)
    _receive_exactly(sock, memoryview(packed))
    try:
        header = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several types for malformed input
        raise ProtocolError(f"a header that is not msgpack ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"a header that is a {type(header).__name__}, not a map")
    kind = header.pop("kind", None)
    message_class = MESSAGE_CLASS_BY_KIND.get(kind) if isinstance(kind, str) else None
    if message_class is None:
        raise ProtocolError(f"unknown message kind {kind!r:.40} (known kinds: {', '.join(MESSAGE_CLASS_BY_KIND)})")
    array = _receive_array(sock, header.pop("array", None))
    try:
        return message_class.from_wire(header, array)
    except ProtocolError as error:
        raise ProtocolError(f"{kind}: {error}") from None
    except (KeyError, TypeError, ValueError, OverflowError) as error:  # a check from_wire missed: still one error
        raise ProtocolError(f"{kind}: malformed ({type(error).__name__}: {error})") from None


def _receive_array(sock: socket.socket, description) -> np.ndarray | None:
    """The frame's raw array, after checking its description [dtype, shape]."""
    if description is None:
        return None
    if not (isinstance(description, list) and len(description) == 2 and description[0] in ARRAY_DTYPES
            and isinstance(description[1], list) and 1 <= len(description[1]) <= 2
            and all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in description[1])):
        raise ProtocolError(f"array: expected [dtype in {ARRAY_DTYPES}, a shape of rank 1 or 2], got {description!r:.80}")
    dtype, shape = np.dtype(description[0]), description[1]
    if dtype.itemsize * int(np.prod(shape, dtype=object)) > MAX_ARRAY_BYTES:
        raise ProtocolError(f"array: {shape} of {dtype.str} is more than {MAX_ARRAY_BYTES} bytes")
    array = np.empty(shape, dtype=dtype)
    if array.nbytes:
        _receive_exactly(sock, memoryview(array).cast("B"))
    return array


def listen(host: str) -> socket.socket:
    """A listening socket on host, on a free port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(16)  # strangers waiting in the queue must not keep the real peer out
    return listener


def tune(sock: socket.socket) -> socket.socket:
    """Small messages must leave at once: no Nagle delay. A peer gone silent
    (a partitioned node, a frozen machine) is found within the same bound
    whether the socket is idle (TCP keepalive probes) or holds data the peer
    never acknowledged (TCP_USER_TIMEOUT: without it Linux retransmits for
    about 15 minutes)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, silent_peer_milliseconds())
    return sock


def silent_peer_milliseconds() -> int:
    """How long a chain socket waits on a silent peer before it breaks: the
    keepalive probes' whole span, which TCP_USER_TIMEOUT holds for unacknowledged data too."""
    return 1000 * (KEEPALIVE_IDLE_SECONDS + KEEPALIVE_INTERVAL_SECONDS * KEEPALIVE_PROBES)


def connect(host: str, port: int, timeout: float = CONNECT_SECONDS) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    return tune(sock)
