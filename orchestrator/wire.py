"""Framing of pipeline messages on a TCP socket.

A frame is ``u32 header length | msgpack header | raw array bytes``. Small
arrays (tokens, positions, rows) ride inside the header as bytes; the one large
array of a message (hidden states or logits) follows as a raw frame described
by the header's ``array`` entry ``[dtype, shape]``, written with one
``sendmsg`` from the array's own memory and read with ``recv_into`` straight
into a new array: no copy through Python objects. Measured on these machines:
a msgpack header plus a raw frame costs microseconds whatever the size, while
packing ``tobytes()`` into msgpack swings up to milliseconds (shared/design/ray.md).
"""

from __future__ import annotations

import socket
import struct

import msgpack
import numpy as np

from orchestrator.messages import (
    Boundary,
    CollectDraft,
    DraftReply,
    Message,
    PassResult,
    Shutdown,
    SpeculateFrom,
    StageBatch,
    StageFailure,
)

_LENGTH = struct.Struct("!I")


class ConnectionClosed(ConnectionError):
    """The other end closed the connection."""


def _small(array: np.ndarray | None) -> bytes | None:
    return None if array is None else np.ascontiguousarray(array, dtype=np.int32).tobytes()


def _from_small(data: bytes | None) -> np.ndarray | None:
    return None if data is None else np.frombuffer(data, dtype=np.int32)


def send_message(sock: socket.socket, message: Message) -> None:
    array: np.ndarray | None = None
    if isinstance(message, StageBatch):
        header = {
            "kind": "batch",
            "pass": message.pass_id,
            "keep": message.keep,
            "positions": _small(message.positions),
            "rows": _small(message.logit_rows),
            "tokens": _small(message.tokens),
            "seconds": list(message.stage_seconds),
        }
        array = message.hidden
    elif isinstance(message, PassResult):
        header = {"kind": "result", "pass": message.pass_id, "seconds": list(message.stage_seconds)}
        array = message.logits
    elif isinstance(message, StageFailure):
        header = {"kind": "failure", "pass": message.pass_id, "stage": message.stage_index, "message": message.message}
    elif isinstance(message, Shutdown):
        header = {"kind": "shutdown"}
    elif isinstance(message, Boundary):
        header = {"kind": "boundary", "pass": message.pass_id, "stage": message.stage_index}
    elif isinstance(message, SpeculateFrom):
        header = {"kind": "speculate", "epoch": message.epoch}
        array = np.ascontiguousarray(message.context, dtype=np.int32)
    elif isinstance(message, CollectDraft):
        header = {"kind": "collect", "epoch": message.epoch, "wait": message.wait}
    elif isinstance(message, DraftReply):
        header = {"kind": "draft", "epoch": message.epoch, "tokens": _small(message.tokens),
                  "busy": message.busy_seconds, "error": message.error}
    else:
        raise TypeError(f"cannot send {type(message).__name__}")
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
    array: np.ndarray | None = None
    if "array" in header:
        dtype, shape = header["array"]
        array = np.empty(shape, dtype=np.dtype(dtype))
        if array.nbytes:
            _receive_exactly(sock, memoryview(array).cast("B"))
    kind = header["kind"]
    if kind == "batch":
        return StageBatch(
            pass_id=header["pass"],
            keep=header["keep"],
            positions=_from_small(header["positions"]),  # type: ignore[arg-type]
            logit_rows=_from_small(header["rows"]),  # type: ignore[arg-type]
            tokens=_from_small(header["tokens"]),
            hidden=array,
            stage_seconds=tuple(header["seconds"]),
        )
    if kind == "result":
        return PassResult(pass_id=header["pass"], logits=array, stage_seconds=tuple(header["seconds"]))  # type: ignore[arg-type]
    if kind == "failure":
        return StageFailure(pass_id=header["pass"], stage_index=header["stage"], message=header["message"])
    if kind == "shutdown":
        return Shutdown()
    if kind == "boundary":
        return Boundary(pass_id=header["pass"], stage_index=header["stage"])
    if kind == "speculate":
        return SpeculateFrom(epoch=header["epoch"], context=array)  # type: ignore[arg-type]
    if kind == "collect":
        return CollectDraft(epoch=header["epoch"], wait=header["wait"])
    if kind == "draft":
        return DraftReply(epoch=header["epoch"], tokens=_from_small(header["tokens"]),  # type: ignore[arg-type]
                          busy_seconds=header["busy"], error=header["error"])
    raise ValueError(f"unknown message kind {kind!r}")


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
