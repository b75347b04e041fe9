"""The checked fields of the data plane's messages (orchestrator.transport.messages):
each reads one header entry or array and raises ProtocolError naming the
field when it is missing, of the wrong type or out of range. Nothing on the
network is trusted."""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.errors import SpecpipeError
from stages.tree_shape import TreeError, check_preorder

WireHeader = dict[str, Any]
"""A message's msgpack header entries, without the ``kind`` and ``array`` entries of the frame."""


class ProtocolError(SpecpipeError):
    """A frame or message that breaks the protocol: the message names the field.
    Nothing on the network is trusted: every received field is checked before use."""


def int32_bytes(array: np.ndarray | None) -> bytes | None:
    """A small int32 array as header bytes (None stays None)."""
    return None if array is None else np.ascontiguousarray(array, dtype=np.int32).tobytes()


def int32_array(header: WireHeader, name: str, *, optional: bool = False) -> np.ndarray | None:
    """Header bytes back as a (read-only) int32 array (None stays None where optional)."""
    data = header.get(name)
    if data is None and optional:
        return None
    if not isinstance(data, bytes) or len(data) % 4:
        raise ProtocolError(f"{name}: expected int32 bytes, got {type(data).__name__}"
                            + (f" of {len(data)} bytes" if isinstance(data, bytes) else ""))
    return np.frombuffer(data, dtype="<i4")


def tree_field(header: WireHeader, name: str, rows: int) -> np.ndarray | None:
    """An optional int32[rows] of parents that must describe a tree in preorder."""
    parents = int32_array(header, name, optional=True)
    if parents is None:
        return None
    if len(parents) != rows:
        raise ProtocolError(f"{name}: {len(parents)} parents for {rows} rows")
    try:
        check_preorder(parents)
    except TreeError as error:
        raise ProtocolError(f"{name}: {error}") from None
    return parents


def integer(header: WireHeader, name: str, low: int = 0) -> int:
    value = header.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProtocolError(f"{name}: expected an integer >= {low}, got {value!r:.40}")
    return value


def number(header: WireHeader, name: str, what: str = "seconds") -> float:
    value = header.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise ProtocolError(f"{name}: expected {what} (a finite number >= 0), got {value!r:.40}")
    return float(value)


def text_field(header: WireHeader, name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise ProtocolError(f"{name}: expected text, got {type(value).__name__}")
    return value


def flag(header: WireHeader, name: str) -> bool:
    value = header.get(name)
    if not isinstance(value, bool):
        raise ProtocolError(f"{name}: expected true or false, got {value!r:.40}")
    return value


def seconds_field(header: WireHeader, name: str) -> tuple[float, ...]:
    values = header.get(name)
    if not isinstance(values, list) or len(values) > 4096:
        raise ProtocolError(f"{name}: expected a list of seconds, got {type(values).__name__}")
    return tuple(number({name: value}, name) for value in values)


def started_field(header: WireHeader, seconds: tuple[float, ...]) -> tuple[float, ...]:
    """The "started" times beside a message's stage seconds: none, or one per stage time."""
    if header.get("started") is None:
        return ()
    started = seconds_field(header, "started")
    if started and len(started) != len(seconds):
        raise ProtocolError(f"started: {len(started)} times for {len(seconds)} stage times")
    return started


def checked_array(array: np.ndarray | None, name: str, rank: int, dtypes: tuple[str, ...], optional: bool = False):
    if array is None and optional:
        return None
    if array is None or array.ndim != rank or array.dtype.str not in dtypes:
        described = "none" if array is None else f"{array.dtype.str}{list(array.shape)}"
        raise ProtocolError(f"{name}: expected a rank-{rank} array of {'/'.join(dtypes)}, got {described}")
    return array
