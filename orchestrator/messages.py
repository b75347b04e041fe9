"""Typed records that travel between the coordinator and the stages.

The per-token path is a chain of TCP sockets: coordinator -> stage 0 -> stage 1
-> ... -> last stage -> coordinator. Each pass is one ``StageBatch`` going down
the chain (its ``hidden`` replaced at every hop) and one ``PassResult`` (or a
``StageFailure``) coming back to the coordinator. ``Shutdown`` travels the same
way and closes every stage's loop. ``orchestrator.wire`` frames them.

Every message declares its own wire form, so adding one touches only this file:
``KIND`` names it on the wire, ``to_wire()`` returns its msgpack header entries
(without ``kind``) and its one large array (or None), and ``from_wire(header,
array)`` builds it back from them. Small int32 arrays ride inside the header as
bytes; the large array (hidden states, logits, a drafting context) is framed
raw by ``orchestrator.wire``. ``MESSAGE_TYPES`` lists every message class; the
wire decodes by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

WireHeader = dict[str, Any]
"""A message's msgpack header entries, without the ``kind`` and ``array`` entries of the frame."""


def _int32_bytes(array: np.ndarray | None) -> bytes | None:
    """A small int32 array as header bytes (None stays None)."""
    return None if array is None else np.ascontiguousarray(array, dtype=np.int32).tobytes()


def _int32_array(data: bytes | None) -> np.ndarray | None:
    """Header bytes back as a (read-only) int32 array (None stays None)."""
    return None if data is None else np.frombuffer(data, dtype=np.int32)


@dataclass(frozen=True)
class StageBatch:
    """One decode pass down the pipeline.

    pass_id: increasing number of the pass, echoed in its result.
    sequence: the KV sequence (request) the batch belongs to.
    keep: every stage first drops the sequence's cached positions >= keep (rollback).
    positions: int32[n_tokens], absolute positions of the batch's tokens; no
    tokens at all releases the sequence from keep on (keep 0: all of it) and
    its result has no logit rows.
    tokens: int32[n_tokens] token ids; set for the first stage only.
    hidden: float32[n_tokens, n_embd] (or float16 on a lossy wire); set from stage 1 on.
    logit_rows: int32[n_rows], batch rows whose logits the last stage returns.
    stage_seconds: busy seconds of each stage already passed, in stage order.

    On the wire: positions, logit_rows and tokens in the header; hidden raw, dtype kept.
    """

    KIND: ClassVar[str] = "batch"

    pass_id: int
    keep: int
    positions: np.ndarray
    logit_rows: np.ndarray
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    stage_seconds: tuple[float, ...] = ()
    sequence: int = 0

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        header = {
            "pass": self.pass_id,
            "sequence": self.sequence,
            "keep": self.keep,
            "positions": _int32_bytes(self.positions),
            "rows": _int32_bytes(self.logit_rows),
            "tokens": _int32_bytes(self.tokens),
            "seconds": list(self.stage_seconds),
        }
        return header, self.hidden

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> StageBatch:
        return cls(
            pass_id=header["pass"],
            sequence=header["sequence"],
            keep=header["keep"],
            positions=_int32_array(header["positions"]),  # type: ignore[arg-type]
            logit_rows=_int32_array(header["rows"]),  # type: ignore[arg-type]
            tokens=_int32_array(header["tokens"]),
            hidden=array,
            stage_seconds=tuple(header["seconds"]),
        )


@dataclass(frozen=True)
class PassResult:
    """Logits of one pass, from the last stage to the coordinator.

    logits: float32[n_rows, n_vocab], one row per requested logit row.
    stage_seconds: busy seconds of every stage for this pass.

    On the wire: logits raw.
    """

    KIND: ClassVar[str] = "result"

    pass_id: int
    logits: np.ndarray
    stage_seconds: tuple[float, ...]

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"pass": self.pass_id, "seconds": list(self.stage_seconds)}, self.logits

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> PassResult:
        return cls(pass_id=header["pass"], logits=array, stage_seconds=tuple(header["seconds"]))  # type: ignore[arg-type]


@dataclass(frozen=True)
class StageFailure:
    """A stage could not run a pass; forwarded unchanged to the coordinator."""

    KIND: ClassVar[str] = "failure"

    pass_id: int
    stage_index: int
    message: str

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"pass": self.pass_id, "stage": self.stage_index, "message": self.message}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> StageFailure:
        return cls(pass_id=header["pass"], stage_index=header["stage"], message=header["message"])


@dataclass(frozen=True)
class Shutdown:
    """Closes each stage's loop in turn, then reaches the coordinator."""

    KIND: ClassVar[str] = "shutdown"

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> Shutdown:
        return cls()


@dataclass(frozen=True)
class Boundary:
    """A non-last stage finished a pass and handed it on (sent to the coordinator,
    which uses the moment to move drafting to the machine that just went idle)."""

    KIND: ClassVar[str] = "boundary"

    pass_id: int
    stage_index: int

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"pass": self.pass_id, "stage": self.stage_index}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> Boundary:
        return cls(pass_id=header["pass"], stage_index=header["stage"])


@dataclass(frozen=True)
class SpeculateFrom:
    """Coordinator -> drafter: extend this text (committed tokens then the
    current speculation) until collected.

    epoch: increasing number of the request, echoed in the reply.
    context: int32[n_tokens].

    On the wire: context raw (it can be long), as int32.
    """

    KIND: ClassVar[str] = "speculate"

    epoch: int
    context: np.ndarray

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"epoch": self.epoch}, np.ascontiguousarray(self.context, dtype=np.int32)

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> SpeculateFrom:
        return cls(epoch=header["epoch"], context=array)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CollectDraft:
    """Coordinator -> drafter: reply with what you have drafted for ``epoch``.

    wait: first let the drafting finish by itself (synchronous schedule).
    """

    KIND: ClassVar[str] = "collect"

    epoch: int
    wait: bool

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"epoch": self.epoch, "wait": self.wait}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> CollectDraft:
        return cls(epoch=header["epoch"], wait=header["wait"])


@dataclass(frozen=True)
class DraftReply:
    """Drafter -> coordinator: tokens int32[k] extending the context of ``epoch``
    (empty when the epoch is stale or drafting failed); busy_seconds: drafting time so far.

    On the wire: tokens in the header.
    """

    KIND: ClassVar[str] = "draft"

    epoch: int
    tokens: np.ndarray
    busy_seconds: float
    error: str = ""

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        header = {"epoch": self.epoch, "tokens": _int32_bytes(self.tokens), "busy": self.busy_seconds, "error": self.error}
        return header, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> DraftReply:
        return cls(
            epoch=header["epoch"],
            tokens=_int32_array(header["tokens"]),  # type: ignore[arg-type]
            busy_seconds=header["busy"],
            error=header["error"],
        )


Message = StageBatch | PassResult | StageFailure | Shutdown | Boundary | SpeculateFrom | CollectDraft | DraftReply

MESSAGE_TYPES: tuple[type[Message], ...] = (
    StageBatch,
    PassResult,
    StageFailure,
    Shutdown,
    Boundary,
    SpeculateFrom,
    CollectDraft,
    DraftReply,
)
"""Every message class, each with its own ``KIND``: the wire decodes by this list."""
