"""Typed records that travel between the coordinator and the stages.

The per-token path is a chain of TCP sockets: coordinator -> stage 0 -> stage 1
-> ... -> last stage -> coordinator. Each pass is one ``StageBatch`` going down
the chain (its ``hidden`` replaced at every hop) and one ``PassResult`` (or a
``StageFailure``) coming back to the coordinator. ``Shutdown`` travels the same
way and closes every stage's loop. ``orchestrator.transport.wire`` frames them.

Every message declares its own wire form, so adding one touches only this file:
``KIND`` names it on the wire, ``to_wire()`` returns its msgpack header entries
(without ``kind``) and its one large array (or None), and ``from_wire(header,
array)`` builds it back from them. Small int32 arrays ride inside the header as
bytes; the large array (hidden states, logits, a drafting context) is framed
raw by ``orchestrator.transport.wire``. ``MESSAGE_TYPES`` lists every message class; the
wire decodes by it. ``from_wire`` checks every field's type, and the lengths
and shapes that must agree, before building a message: a violation is one
``ProtocolError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from speculators.corrections import Forks
from speculators.grammar import MAX_GRAMMAR_TOKENS
from stages.settings import MAX_GRAMMAR_BYTES
from speculators.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from speculators.sampling import SamplingSettings
from speculators.tree import MAX_TREE_ROWS, TreeAsk
from stages.tree_shape import TreeError
from orchestrator.transport.fields import (ProtocolError, WireHeader, checked_array, flag, int32_array, int32_bytes, integer,
                                            number, seconds_field, started_field, text_field, tree_field)

MAX_BATCHED = 255  # StageBatch.more: the most batches one batched pass adds to the first (KV sequences are fewer)

@dataclass(frozen=True)
class TokenChoice:
    """What the last stage needs to turn a pass's logit rows into tokens
    (speculators.tree.verify_rows, called beside it), so that only token ids travel back.

    drafts: int32[rows - 1], the draft tokens the rows after the first verify.
    first_position: the absolute position the first logit row predicts.
    sampling: greedy, or the seeded draw (the same function the coordinator
    would apply to the same float32 rows: the tokens are the same).
    parents: int32[rows], the rows form a token tree in preorder
    (speculators.tree.walk verifies it); None: a chain.
    top_logprobs: -1, none; else the result also carries each chosen
    token's log-probability and this many likeliest alternatives
    (speculators.logprobs, at most MAX_TOP_LOGPROBS).
    grammar: None, or the tokens are chosen under this GBNF grammar
    (speculators.grammar, structured output), from its state after
    ``generated``: int32[g], the tokens generated before row 0's choice (row
    0's own input the last of them). Sent whole with every pass, so the last
    stage needs nothing remembered to choose right (a restarted one too).

    On the wire: a small map in the batch's header.
    """

    drafts: np.ndarray
    first_position: int
    sampling: SamplingSettings
    parents: np.ndarray | None = None
    top_logprobs: int = -1
    grammar: str | None = None
    generated: np.ndarray | None = None

    def to_wire(self) -> WireHeader:
        return {"drafts": int32_bytes(self.drafts), "first": self.first_position, "parents": int32_bytes(self.parents),
                "temperature": self.sampling.temperature, "top_p": self.sampling.top_p, "seed": self.sampling.seed,
                "logprobs": self.top_logprobs, "grammar": self.grammar, "generated": int32_bytes(self.generated)}

    @classmethod
    def from_wire(cls, header: WireHeader) -> TokenChoice:
        if not isinstance(header, dict):
            raise ProtocolError(f"choice: expected a map, got {type(header).__name__}")
        drafts = int32_array(header, "drafts")
        top_logprobs = integer(header, "logprobs", low=-1)
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise ProtocolError(f"logprobs: {top_logprobs} alternatives (at most {MAX_TOP_LOGPROBS})")
        grammar, generated = _grammar(header)
        return cls(drafts=drafts,  # type: ignore[arg-type]
                   first_position=integer(header, "first"),
                   sampling=_sampling(header),
                   parents=tree_field(header, "parents", len(drafts) + 1),  # type: ignore[arg-type]
                   top_logprobs=top_logprobs, grammar=grammar, generated=generated)


def _sampling(header: WireHeader) -> SamplingSettings:
    temperature, top_p = number(header, "temperature", "a temperature"), number(header, "top_p", "a share")
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"top_p: expected a number in (0, 1], got {top_p!r:.40}")
    seed = integer(header, "seed")
    if seed >= 2**64:
        raise ProtocolError("seed: more than 64 bits")
    return SamplingSettings(temperature=temperature, top_p=top_p, seed=seed)


def _grammar(header: WireHeader) -> tuple[str | None, np.ndarray | None]:
    """A choice's grammar and the tokens generated under it, checked (both or neither)."""
    if header.get("grammar") is None:
        if header.get("generated") is not None:
            raise ProtocolError("generated: tokens without a grammar")
        return None, None
    grammar = text_field(header, "grammar")
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise ProtocolError(f"grammar: over {MAX_GRAMMAR_BYTES} bytes")
    generated = int32_array(header, "generated")
    if len(generated) > MAX_GRAMMAR_TOKENS or (len(generated) and generated.min() < 0):  # type: ignore[arg-type]
        raise ProtocolError(f"generated: {len(generated)} tokens (at most {MAX_GRAMMAR_TOKENS}, none negative)")
    return grammar, generated


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
    stage_seconds: busy seconds of each stage already passed, in stage order;
    stage_started: when each began it, in seconds of its machine's clock
    (time.time(); the timeline of a run, orchestrator.decoding.timeline), or
    none at all.
    choice: set, the last stage chooses the tokens (TokenChoice) and returns
    them instead of the logit rows.
    parents: int32[n_tokens], the rows form a token tree in preorder, each at
    its root's position plus its depth (stages.engine); None: a chain.
    more: how many of the batches right after this one (of other sequences,
    as many rows each, chains) every stage decodes with it in one llama.cpp
    call: a batched pass travels as its windows' batches in a row, counting
    down to 0; each keeps its own pass id and result.
    source: set (no positions then), a copy: every stage makes ``sequence``
    hold sequence ``source``'s cached positions below keep (stages.engine.copy).

    On the wire: positions, logit_rows, tokens, parents and choice in the header; hidden raw, dtype kept.
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
    choice: TokenChoice | None = None
    stage_started: tuple[float, ...] = ()
    parents: np.ndarray | None = None
    more: int = 0
    source: int | None = None

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        header = {
            "more": self.more,
            "source": self.source,
            "choice": None if self.choice is None else self.choice.to_wire(),
            "parents": int32_bytes(self.parents),
            "pass": self.pass_id,
            "sequence": self.sequence,
            "keep": self.keep,
            "positions": int32_bytes(self.positions),
            "rows": int32_bytes(self.logit_rows),
            "tokens": int32_bytes(self.tokens),
            "seconds": list(self.stage_seconds),
            "started": list(self.stage_started),
        }
        return header, self.hidden

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> StageBatch:
        positions = int32_array(header, "positions")
        rows = int32_array(header, "rows")
        tokens = int32_array(header, "tokens", optional=True)
        hidden = checked_array(array, "hidden", 2, ("<f4", "<f2"), optional=True)
        count = len(positions)  # type: ignore[arg-type]
        if tokens is not None and len(tokens) != count:
            raise ProtocolError(f"tokens: {len(tokens)} for {count} positions")
        if hidden is not None and hidden.shape[0] != count:
            raise ProtocolError(f"hidden: {hidden.shape[0]} rows for {count} positions")
        if (tokens is None) == (hidden is None):
            raise ProtocolError("a batch carries exactly one of tokens and hidden")
        if len(rows) and (rows.min() < 0 or rows.max() >= count):  # type: ignore[union-attr]
            raise ProtocolError(f"rows: outside the batch's {count} rows")
        if count and (positions.min() < 0):  # type: ignore[union-attr]
            raise ProtocolError("positions: negative")
        choice = None if header.get("choice") is None else TokenChoice.from_wire(header["choice"])
        if choice is not None and len(choice.drafts) + 1 != len(rows):  # type: ignore[arg-type]
            raise ProtocolError(f"choice: {len(choice.drafts)} drafts for {len(rows)} logit rows (need rows - 1)")
        pass_id, sequence, keep = integer(header, "pass"), integer(header, "sequence"), integer(header, "keep")
        more = integer(header, "more")
        if more > MAX_BATCHED:
            raise ProtocolError(f"more: {more} batches to follow (at most {MAX_BATCHED})")
        parents = tree_field(header, "parents", count)
        if more and (parents is not None or not count):
            raise ProtocolError("more: a batched pass carries chains of tokens, not a tree or a release")
        source = None if header.get("source") is None else integer(header, "source")
        if source is not None and (count or more):
            raise ProtocolError("source: a copy carries no tokens and is not batched")
        seconds = seconds_field(header, "seconds")
        return cls(
            pass_id=pass_id,
            sequence=sequence,
            keep=keep,
            positions=positions,  # type: ignore[arg-type]
            logit_rows=rows,  # type: ignore[arg-type]
            tokens=tokens,
            hidden=hidden,
            stage_seconds=seconds,
            choice=choice,
            parents=parents,
            more=more,
            source=source,
            stage_started=started_field(header, seconds),
        )


@dataclass(frozen=True)
class PassResult:
    """What one pass gives, from the last stage to the coordinator: its logit
    rows, or (for a batch with a choice) the tokens chosen from them.

    logits: float32[n_rows, n_vocab], one row per requested logit row; None when chosen.
    tokens: int32[k], what the pass commits (speculators.verify: the accepted
    drafts, then the target's own token); None when the logits came back.
    stage_seconds: busy seconds of every stage for this pass; stage_started:
    when each began it (StageBatch.stage_started), or none at all.
    logprobs: with tokens, when the choice asked (TokenChoice.top_logprobs):
    each token's log-probability and the likeliest alternatives
    (speculators.logprobs.TokenLogprobs: float32[k], int32[k, m], float32[k, m]).

    On the wire: logits raw, or the tokens (and logprobs) in the header.
    """

    KIND: ClassVar[str] = "result"

    pass_id: int
    logits: np.ndarray | None
    stage_seconds: tuple[float, ...]
    tokens: np.ndarray | None = None
    logprobs: TokenLogprobs | None = None
    stage_started: tuple[float, ...] = ()

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        header = {"pass": self.pass_id, "seconds": list(self.stage_seconds), "tokens": int32_bytes(self.tokens),
                  "started": list(self.stage_started)}
        if self.logprobs is not None:
            header["logprobs"] = {"chosen": self.logprobs.logprobs.astype("<f4").tobytes(),
                                  "top": self.logprobs.top_tokens.shape[1],
                                  "top_tokens": int32_bytes(self.logprobs.top_tokens),
                                  "top_logprobs": self.logprobs.top_logprobs.astype("<f4").tobytes()}
        return header, self.logits

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> PassResult:
        logits = checked_array(array, "logits", 2, ("<f4",), optional=True)
        tokens = int32_array(header, "tokens", optional=True)
        if (logits is None) == (tokens is None):
            raise ProtocolError("a result carries exactly one of logits and tokens")
        logprobs = None if header.get("logprobs") is None else _logprobs(header["logprobs"], tokens)
        seconds = seconds_field(header, "seconds")
        return cls(pass_id=integer(header, "pass"), logits=logits, stage_seconds=seconds,
                   tokens=tokens, logprobs=logprobs, stage_started=started_field(header, seconds))


def _float32_array(header: WireHeader, name: str) -> np.ndarray:
    data = header.get(name)
    if not isinstance(data, bytes) or len(data) % 4:
        raise ProtocolError(f"{name}: expected float32 bytes, got {type(data).__name__}")
    return np.frombuffer(data, dtype="<f4")


def _logprobs(header: WireHeader, tokens: np.ndarray | None) -> TokenLogprobs:
    """A result's logprobs map, checked against its tokens."""
    if not isinstance(header, dict) or tokens is None:
        raise ProtocolError("logprobs: expected a map beside chosen tokens")
    top = integer(header, "top")
    if top > MAX_TOP_LOGPROBS:
        raise ProtocolError(f"logprobs: {top} alternatives (at most {MAX_TOP_LOGPROBS})")
    chosen, top_tokens = _float32_array(header, "chosen"), int32_array(header, "top_tokens")
    top_logprobs = _float32_array(header, "top_logprobs")
    if len(chosen) != len(tokens) or len(top_tokens) != len(tokens) * top or len(top_logprobs) != len(top_tokens):
        raise ProtocolError(f"logprobs: {len(chosen)}, {len(top_tokens)} and {len(top_logprobs)} entries for "
                            f"{len(tokens)} tokens with {top} alternatives")
    entries = TokenLogprobs(chosen, top_tokens.reshape(len(tokens), top), top_logprobs.reshape(len(tokens), top))
    problem = entries.check(len(tokens), top)
    if problem:
        raise ProtocolError(f"logprobs: {problem}")
    return entries


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
        return cls(pass_id=integer(header, "pass"), stage_index=integer(header, "stage"),
                   message=text_field(header, "message")[:2000])


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
class Cancel:
    """Coordinator -> every stage, on its cancel connection: pass ``pass_id``
    is no longer wanted (a rejection invalidated its window). A stage that
    has not started it drops it; one running it stops it mid-graph."""

    KIND: ClassVar[str] = "cancel"

    pass_id: int

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"pass": self.pass_id}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> Cancel:
        return cls(pass_id=integer(header, "pass", low=1))


@dataclass(frozen=True)
class Ping:
    """Coordinator -> a stage on its cancel connection while a result is awaited: answer ``Alive``."""

    KIND: ClassVar[str] = "ping"

    number: int

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"number": self.number}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> Ping:
        return cls(number=integer(header, "number", low=1))


@dataclass(frozen=True)
class Alive:
    """A stage -> the coordinator on its cancel connection: stage ``stage_index`` answers ping ``number``."""

    KIND: ClassVar[str] = "alive"

    number: int
    stage_index: int

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"number": self.number, "stage": self.stage_index}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> Alive:
        return cls(number=integer(header, "number", low=1), stage_index=integer(header, "stage"))


@dataclass(frozen=True)
class Cancelled:
    """A cancelled pass, dropped or stopped by stage ``stage_index``: travels
    the rest of the chain in its place (later stages forward it) and reaches
    the coordinator instead of its result.

    stage_seconds: busy seconds of the stages up to ``stage_index`` for it
    (as the coordinator hands it out: of every stage, zero for those after);
    stage_started: when each began or dropped it (StageBatch.stage_started), or none.
    """

    KIND: ClassVar[str] = "cancelled"

    pass_id: int
    stage_index: int
    stage_seconds: tuple[float, ...]
    stage_started: tuple[float, ...] = ()

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        return {"pass": self.pass_id, "stage": self.stage_index, "seconds": list(self.stage_seconds),
                "started": list(self.stage_started)}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> Cancelled:
        seconds = seconds_field(header, "seconds")
        return cls(pass_id=integer(header, "pass"), stage_index=integer(header, "stage"),
                   stage_seconds=seconds, stage_started=started_field(header, seconds))


@dataclass(frozen=True)
class SpeculateFrom:
    """Coordinator -> drafter: extend this text (committed tokens then the
    current speculation) until collected.

    epoch: increasing number of the request (per sequence), echoed in the reply.
    context: int32[n_tokens].
    most: draft at most this many tokens (0: up to the drafter's draft_max);
    for a tree, its depth.
    sequence: the request's KV sequence in the drafter (one per request it drafts for).
    tree: grow a token tree of at most tree.rows rows and tree.leaves leaves
    (speculators.model_tree), not a chain; None: a chain.
    sampling: the request's, for coupled drafting (the draft samples with the
    target's seeded uniforms); None or greedy: the draft's top choices.
    forks: also draft corrections at the window being verified, within the
    rounds its pass lasts (speculators.corrections.Forks); None: none.

    On the wire: context raw (it can be long), as int32; sequence only when
    not 0; tree, sampling and forks only when given.
    """

    KIND: ClassVar[str] = "speculate"

    epoch: int
    context: np.ndarray
    most: int = 0
    sequence: int = 0
    tree: TreeAsk | None = None
    sampling: SamplingSettings | None = None
    forks: Forks | None = None

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        header: WireHeader = {"epoch": self.epoch, "most": self.most, **_sequence_field(self.sequence)}
        if self.forks is not None:
            header.update(fork_from=self.forks.first, forks=self.forks.count, fork_rounds=self.forks.rounds)
        if self.tree is not None:
            header.update(rows=self.tree.rows, leaves=self.tree.leaves, acceptance=self.tree.acceptance)
        if self.sampling is not None:
            header.update(temperature=self.sampling.temperature, top_p=self.sampling.top_p, seed=self.sampling.seed)
        return header, np.ascontiguousarray(self.context, dtype=np.int32)

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> SpeculateFrom:
        tree = None
        if "rows" in header:
            try:
                tree = TreeAsk(integer(header, "rows"), integer(header, "leaves"),
                               number(header, "acceptance", "a share"))
            except TreeError as error:
                raise ProtocolError(str(error)) from None
        return cls(epoch=integer(header, "epoch"), context=checked_array(array, "context", 1, ("<i4",)),
                   most=integer(header, "most"), sequence=_sequence(header), tree=tree,
                   sampling=_sampling(header) if "temperature" in header else None,
                   forks=Forks(integer(header, "fork_from", 1), integer(header, "forks", 1),
                               number(header, "fork_rounds", "draft rounds")) if "forks" in header else None)


def _sequence_field(sequence: int) -> WireHeader:
    """A drafter message's KV sequence on the wire: left out when 0 (every run's)."""
    return {"sequence": sequence} if sequence else {}


def _sequence(header: WireHeader) -> int:
    return integer(header, "sequence") if "sequence" in header else 0


@dataclass(frozen=True)
class CollectDraft:
    """Coordinator -> drafter: reply with what you have drafted for ``epoch``
    of KV sequence ``sequence``. wait: first let the drafting finish by itself
    (synchronous schedule); keep: draft on after the reply (a branch window's).
    """

    KIND: ClassVar[str] = "collect"

    epoch: int
    wait: bool
    sequence: int = 0
    keep: bool = False

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        keep = {"keep": True} if self.keep else {}
        return {"epoch": self.epoch, "wait": self.wait, **keep, **_sequence_field(self.sequence)}, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> CollectDraft:
        return cls(epoch=integer(header, "epoch"), wait=flag(header, "wait"), sequence=_sequence(header),
                   keep="keep" in header and flag(header, "keep"))


@dataclass(frozen=True)
class DraftReply:
    """Drafter -> coordinator: tokens int32[k] extending the context of ``epoch``
    of KV sequence ``sequence`` (empty when the epoch is stale or drafting
    failed); busy_seconds: drafting time so far, all sequences together.
    A tree (asked with SpeculateFrom.tree): tokens are its rows after the
    root, parents int32[k + 1] the rows' parents in preorder (row 0 the
    root, the context's last token) and ranks int32[k + 1] each row's rank
    among its siblings (speculators.tree.DraftTree); None for a chain.
    corrections: asked with SpeculateFrom.forks, (position, tokens) for each
    correction drafted: the draft's runner-up at that context position, then
    its continuation (speculators.corrections).

    On the wire: tokens (and a tree's parents and ranks, and the corrections'
    positions, lengths and tokens) in the header.
    """

    KIND: ClassVar[str] = "draft"

    epoch: int
    tokens: np.ndarray
    busy_seconds: float
    error: str = ""
    sequence: int = 0
    parents: np.ndarray | None = None
    ranks: np.ndarray | None = None
    corrections: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def to_wire(self) -> tuple[WireHeader, np.ndarray | None]:
        header = {"epoch": self.epoch, "tokens": int32_bytes(self.tokens), "busy": self.busy_seconds, "error": self.error,
                  **_sequence_field(self.sequence)}
        if self.parents is not None:
            header.update(parents=int32_bytes(self.parents), ranks=int32_bytes(self.ranks))
        if self.corrections:
            header.update(
                fork_at=int32_bytes(np.array([position for position, _ in self.corrections], np.int32)),
                fork_lengths=int32_bytes(np.array([len(tokens) for _, tokens in self.corrections], np.int32)),
                fork_tokens=int32_bytes(np.array([token for _, tokens in self.corrections for token in tokens], np.int32)))
        return header, None

    @classmethod
    def from_wire(cls, header: WireHeader, array: np.ndarray | None) -> DraftReply:
        tokens = int32_array(header, "tokens")
        if len(tokens) > MAX_TREE_ROWS:  # type: ignore[arg-type]
            raise ProtocolError(f"tokens: {len(tokens)} draft rows (at most {MAX_TREE_ROWS})")  # type: ignore[arg-type]
        parents = tree_field(header, "parents", len(tokens) + 1)  # type: ignore[arg-type]
        ranks = None
        if parents is not None:
            ranks = int32_array(header, "ranks")
            if len(ranks) != len(parents) or int(ranks[0]) != 0 or (len(ranks) > 1 and int(ranks[1:].min()) < 1):
                raise ProtocolError("ranks: one per row, 0 for the root and at least 1 for the others")
        return cls(
            epoch=integer(header, "epoch"),
            tokens=tokens,  # type: ignore[arg-type]
            busy_seconds=number(header, "busy"),
            error=text_field(header, "error")[:2000],
            sequence=_sequence(header),
            parents=parents,
            ranks=ranks,
            corrections=_corrections(header) if "fork_at" in header else (),
        )


def _corrections(header: WireHeader) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A DraftReply's corrections: positions, each one's length (at least 1), their tokens one after the other."""
    at, lengths, tokens = (np.asarray(int32_array(header, name)) for name in ("fork_at", "fork_lengths", "fork_tokens"))
    if len(at) != len(lengths) or len(at) > MAX_TREE_ROWS:
        raise ProtocolError(f"fork_at, fork_lengths: {len(at)} positions and {len(lengths)} lengths"
                            f" (one each, at most {MAX_TREE_ROWS})")
    if len(lengths) and (int(lengths.min()) < 1 or int(lengths.sum()) != len(tokens)):
        raise ProtocolError("fork_lengths: each at least 1, adding up to the fork_tokens sent")
    if len(at) and int(at.min()) < 1:
        raise ProtocolError("fork_at: positions from 1")
    ends = np.cumsum(lengths)
    return tuple((int(position), tuple(int(token) for token in tokens[end - length:end]))
                 for position, length, end in zip(at, lengths, ends))


Message = (StageBatch | PassResult | StageFailure | Shutdown | Cancel | Ping | Alive | Cancelled | SpeculateFrom
           | CollectDraft | DraftReply)

MESSAGE_TYPES: tuple[type[Message], ...] = (
    StageBatch,
    PassResult,
    StageFailure,
    Shutdown,
    Cancel,
    Ping,
    Alive,
    Cancelled,
    SpeculateFrom,
    CollectDraft,
    DraftReply,
)
"""Every message class, each with its own ``KIND``: the wire decodes by this list."""
