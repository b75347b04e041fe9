"""Typed records that travel between the coordinator and the stages.

The per-token path is a chain of TCP sockets: coordinator -> stage 0 -> stage 1
-> ... -> last stage -> coordinator. Each pass is one ``StageBatch`` going down
the chain (its ``hidden`` replaced at every hop) and one ``PassResult`` (or a
``StageFailure``) coming back to the coordinator. ``Shutdown`` travels the same
way and closes every stage's loop. ``orchestrator.wire`` frames them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageBatch:
    """One decode pass down the pipeline.

    pass_id: increasing number of the pass, echoed in its result.
    keep: every stage first drops its cached positions >= keep (rollback).
    positions: int32[n_tokens], absolute positions of the batch's tokens.
    tokens: int32[n_tokens] token ids; set for the first stage only.
    hidden: float32[n_tokens, n_embd] (or float16 on a lossy wire); set from stage 1 on.
    logit_rows: int32[n_rows], batch rows whose logits the last stage returns.
    stage_seconds: busy seconds of each stage already passed, in stage order.
    """

    pass_id: int
    keep: int
    positions: np.ndarray
    logit_rows: np.ndarray
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    stage_seconds: tuple[float, ...] = ()


@dataclass(frozen=True)
class PassResult:
    """Logits of one pass, from the last stage to the coordinator.

    logits: float32[n_rows, n_vocab], one row per requested logit row.
    stage_seconds: busy seconds of every stage for this pass.
    """

    pass_id: int
    logits: np.ndarray
    stage_seconds: tuple[float, ...]


@dataclass(frozen=True)
class StageFailure:
    """A stage could not run a pass; forwarded unchanged to the coordinator."""

    pass_id: int
    stage_index: int
    message: str


@dataclass(frozen=True)
class Shutdown:
    """Closes each stage's loop in turn, then reaches the coordinator."""


@dataclass(frozen=True)
class Boundary:
    """A non-last stage finished a pass and handed it on (sent to the coordinator,
    which uses the moment to move drafting to the machine that just went idle)."""

    pass_id: int
    stage_index: int


@dataclass(frozen=True)
class SpeculateFrom:
    """Coordinator -> drafter: extend this text (committed tokens then the
    current speculation) until collected.

    epoch: increasing number of the request, echoed in the reply.
    context: int32[n_tokens].
    """

    epoch: int
    context: np.ndarray


@dataclass(frozen=True)
class CollectDraft:
    """Coordinator -> drafter: reply with what you have drafted for ``epoch``.

    wait: first let the drafting finish by itself (synchronous schedule).
    """

    epoch: int
    wait: bool


@dataclass(frozen=True)
class DraftReply:
    """Drafter -> coordinator: tokens int32[k] extending the context of ``epoch``
    (empty when the epoch is stale or drafting failed); busy_seconds: drafting time so far."""

    epoch: int
    tokens: np.ndarray
    busy_seconds: float
    error: str = ""


Message = StageBatch | PassResult | StageFailure | Shutdown | Boundary | SpeculateFrom | CollectDraft | DraftReply
