"""What every stage's KV cache holds, as the coordinator knows it, so a lost
stage can be rebuilt by replay (Petals' recovery, exact).

Pure: no Ray, no sockets, no llama.cpp. Each pass the coordinator sends is a
``PassRecord``; the chain (orchestrator.transport.chain) keeps the records of passes in
flight and, when a pass's result comes back, settles it into a ``KvLedger``.
Every stage applies a pass the same way (stages.engine): drop the sequence's
cached positions >= keep, then cache the pass's tokens at its positions. So
after the settled passes every stage holds, for each sequence, exactly the
ledger's (position, token) pairs, and their KV values are a function of those
tokens alone: a batch's KV is bit-identical whatever the batching (the
Makefile's build flags; docs/architecture.md, "Failure handling").

When a stage is lost, a fresh chain is rebuilt by ``rebuild`` (each sequence's
held tokens in chunks of n_batch, the first with keep 0, which also clears
whatever a surviving stage still held of it) and then the passes that were in
flight are sent again, in order. Their results are then what the lost chain
would have returned.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from orchestrator.transport.messages import TokenChoice
from stages.tree_shape import main_chain_length


@dataclass(frozen=True)
class PassRecord:
    """A pass as the coordinator sends it.

    sequence: the KV sequence; keep: every stage first drops the sequence's
    cached positions >= keep; positions, tokens: int32[n]; logit_rows:
    int32[rows], the rows whose logits come back. No positions at all is a
    release: the stages drop the sequence from keep on and return no rows.
    choice: set, the last stage returns the tokens it chooses from those rows
    (messages.TokenChoice) instead of the rows.
    parents: int32[n], the rows form a token tree (messages.StageBatch); the
    stages keep only its main chain's cells after it (stages.engine).
    origin: the decision the pass carries out (the loop's TargetPass), so a
    cancel finds it among the chain's passes in flight; never sent.
    source: set (no positions then), a copy: the stages make ``sequence``
    hold sequence ``source``'s cached positions below keep (a shared prefix,
    orchestrator.decoding.prefix_cache).
    """

    sequence: int
    keep: int
    positions: np.ndarray
    tokens: np.ndarray
    logit_rows: np.ndarray
    choice: TokenChoice | None = None
    parents: np.ndarray | None = None
    origin: object | None = field(default=None, compare=False, repr=False)
    source: int | None = None

    @property
    def kept_rows(self) -> int:
        """Rows whose cells stay cached once the next pass drops side branches."""
        return len(self.positions) if self.parents is None else main_chain_length(self.parents)

    @property
    def gives_result(self) -> bool:
        """A pass of tokens; not a release or a copy (no result is handed out for those)."""
        return len(self.positions) > 0

    @classmethod
    def release(cls, sequence: int) -> PassRecord:
        empty = np.empty(0, np.int32)
        return cls(sequence, 0, empty, empty, empty)

    @classmethod
    def copy(cls, source: int, destination: int, keep: int) -> PassRecord:
        empty = np.empty(0, np.int32)
        return cls(destination, keep, empty, empty, empty, source=source)


class KvLedger:
    """Each sequence's cached (position, token) pairs after the settled passes."""

    def __init__(self) -> None:
        # sequence -> (positions, tokens), positions ascending
        self._held: dict[int, tuple[list[int], list[int]]] = {}

    def settle(self, record: PassRecord, decoded: bool) -> None:
        """The result of ``record`` came back. decoded: every stage cached its
        tokens. Not decoded (a stage refused it): the stages before the one
        that refused cached it, the others did not even drop from keep on; all
        agree only below keep, so only that is held (the sequence's next pass
        drops the rest, as its keep is never above what the stages agree on)."""
        if record.source is not None:
            self._copy(record, decoded)
            return
        positions, tokens = self._held.setdefault(record.sequence, ([], []))
        cut = bisect.bisect_left(positions, record.keep)  # in place: a pass costs its own length, not the context's
        del positions[cut:], tokens[cut:]
        if decoded and record.gives_result:
            new_positions = record.positions[: record.kept_rows].tolist()
            if positions and new_positions[0] <= positions[-1] or any(
                    later <= earlier for earlier, later in zip(new_positions, new_positions[1:])):
                raise ValueError(f"sequence {record.sequence}: positions {new_positions[:4]}... do not follow "
                                 f"the cached ones (last {positions[-1] if positions else None})")
            positions.extend(new_positions)
            tokens.extend(record.tokens[: record.kept_rows].tolist())
        if not positions:
            del self._held[record.sequence]

    def _copy(self, record: PassRecord, decoded: bool) -> None:
        """A copy settled: the destination holds the source's pairs below keep (not
        decoded, a stage refused it and the stages disagree: nothing is held)."""
        positions, tokens = self._held.get(record.source, ([], []))
        cut = bisect.bisect_left(positions, record.keep)
        if decoded and cut:
            self._held[record.sequence] = (positions[:cut], tokens[:cut])
        else:
            self._held.pop(record.sequence, None)

    def held(self, sequence: int) -> tuple[list[int], list[int]]:
        """(positions, tokens) cached for ``sequence``."""
        positions, tokens = self._held.get(sequence, ([], []))
        return list(positions), list(tokens)

    @property
    def sequences(self) -> list[int]:
        """Sequences that hold cached tokens, in increasing order."""
        return sorted(self._held)

    def rebuild(self, n_batch: int) -> list[PassRecord]:
        """Passes that make a fresh chain hold what the ledger says: each
        sequence's tokens in chunks of at most n_batch, the first with keep 0
        (a surviving stage drops all it held of the sequence), each asking for
        its last row's logits only (they are not used)."""
        records = []
        for sequence in self.sequences:
            positions, tokens = self._held[sequence]
            for start in range(0, len(positions), n_batch):
                chunk = slice(start, start + n_batch)
                records.append(PassRecord(
                    sequence, 0 if start == 0 else positions[start],
                    np.asarray(positions[chunk], np.int32), np.asarray(tokens[chunk], np.int32),
                    np.array([len(positions[chunk]) - 1], np.int32),
                ))
        return records
