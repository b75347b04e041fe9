"""Prefixes of finished requests kept in the stages' KV, found again by later requests: pure decisions.

A chat's second turn begins with its first turn and the answer; requests of
one application begin with the same system prompt. The service
(orchestrator.decoding.service) keeps a finished request's tokens in one of
the stages' prefix sequences (StageSettings.prefix_sequences, each a KV
stream of its own): it asks ``store`` which one, and has every stage copy the
request's sequence there. A new request asks ``lookup`` for the longest
cached prefix of its prompt; every stage copies that sequence into the
request's own and the request prefills only the rest. The copy keeps each
cell's place and value (stages.engine.copy), so the output is bit for bit
what the request computes without the cache.

Which entry goes when space runs out: the least recently used (stored or
found). Entries are found by chained hashes of PREFIX_BLOCK-token blocks
(vLLM's automatic prefix caching works on such blocks); a hash only proposes
candidates, and the length reused is the candidates' exact common prefix
with the prompt, so a hash collision cannot reuse a wrong token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.config import PREFIX_BLOCK


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix: the KV sequence that holds it and how many of the prompt's tokens it holds."""

    sequence: int
    length: int


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    length = min(len(first), len(second))
    differ = np.flatnonzero(np.asarray(first[:length], np.int64) != np.asarray(second[:length], np.int64))
    return int(differ[0]) if len(differ) else length


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """The chained hash of each whole block: hash i covers tokens[: (i + 1) * PREFIX_BLOCK]."""
    hashes, chained = [], 0
    for start in range(0, len(tokens) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        chained = hash((chained, tuple(int(token) for token in tokens[start:start + PREFIX_BLOCK])))
        hashes.append(chained)
    return hashes


class PrefixCache:
    """The prefixes held in ``sequences`` (KV sequence ids of the stages'
    prefix sequences), at most ``budget_tokens`` tokens in all."""

    def __init__(self, sequences: Sequence[int], budget_tokens: int):
        if not sequences or budget_tokens < PREFIX_BLOCK:
            raise ValueError("a prefix cache needs a sequence and a budget of at least one block")
        self.budget_tokens = budget_tokens
        self._free = list(sequences)
        self._entries: dict[int, list[int]] = {}  # sequence -> the tokens it holds
        self._recent: OrderedDict[int, None] = OrderedDict()  # held sequences, least recently used first
        self._blocks: dict[int, set[int]] = {}  # chained block hash -> sequences holding that prefix

    @property
    def tokens(self) -> int:
        """Tokens held over every entry."""
        return sum(map(len, self._entries.values()))

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The entry sharing the longest prefix with ``prompt`` (at least a block), or None."""
        candidates: set[int] = set()
        for chained in block_hashes(prompt):
            holders = self._blocks.get(chained)
            if not holders:
                break
            candidates = holders
        best = PrefixHit(-1, 0)
        for sequence in reversed(self._recent):  # the most recently used first: it wins a tie
            if sequence in candidates and (length := common_prefix(self._entries[sequence], prompt)) > best.length:
                best = PrefixHit(sequence, length)
        if best.length < PREFIX_BLOCK:
            return None
        self._recent.move_to_end(best.sequence)
        return best

    def store(self, tokens: Sequence[int]) -> int | None:
        """The sequence to copy a finished request's ``tokens`` into (it is then
        entered as holding them), or None: too short or too long to keep, or
        already held (an entry that begins with them is used again instead).
        An entry the tokens extend is replaced by them; else the least
        recently used entries go until they fit."""
        tokens = [int(token) for token in tokens]
        if not PREFIX_BLOCK <= len(tokens) <= self.budget_tokens:
            return None
        for sequence, held in self._entries.items():
            if common_prefix(held, tokens) == len(tokens):
                self._recent.move_to_end(sequence)
                return None
        extended = next((sequence for sequence, held in self._entries.items()
                         if common_prefix(held, tokens) == len(held)), None)
        if extended is not None:
            self._evict(extended)
        while self._recent and (not self._free or self.tokens + len(tokens) > self.budget_tokens):
            self._evict(next(iter(self._recent)))
        sequence = self._free.pop(0)
        self._entries[sequence] = tokens
        self._recent[sequence] = None
        for chained in block_hashes(tokens):
            self._blocks.setdefault(chained, set()).add(sequence)
        return sequence

    def _evict(self, sequence: int) -> None:
        tokens = self._entries.pop(sequence)
        del self._recent[sequence]
        for chained in block_hashes(tokens):
            holders = self._blocks[chained]
            holders.discard(sequence)
            if not holders:
                del self._blocks[chained]
        self._free.insert(0, sequence)
