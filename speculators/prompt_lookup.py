"""Prompt lookup: draft by copying what followed the same n-gram earlier in the text.

No model: the most recent earlier occurrence of the last n tokens (longest n
first) predicts the next token. Input-grounded work (rewriting, summarising,
editing code) repeats long spans of its input, which this finds for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptLookupSpeculator:
    """max_ngram..min_ngram: suffix lengths tried, longest first."""

    max_ngram: int = 3
    min_ngram: int = 2

    def extend(self, context: Sequence[int], sampling=None) -> int | None:
        """The next draft token after context, or None when no n-gram recurs."""
        for token in self._continuations(context):
            return token
        return None

    def candidates(self, context: Sequence[int], most: int = 8) -> list[int]:
        """Up to ``most`` distinct next tokens, best first: the longest n-gram's
        matches before shorter ones, the most recent match first (the first
        is ``extend``'s). A token tree's forks (speculators.tree) offer them."""
        found: list[int] = []
        for token in self._continuations(context):
            if token not in found:
                found.append(token)
                if len(found) == most:
                    break
        return found

    def _continuations(self, context: Sequence[int]):
        """The tokens that followed earlier occurrences of the last n tokens, in rank order."""
        tokens = np.asarray(context, dtype=np.int64)
        length = len(tokens)
        for size in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # starts of earlier occurrences of the last `size` tokens (with a continuation)
            candidates = length - size
            match = np.ones(candidates, dtype=bool)
            for offset in range(size):
                match &= tokens[offset : offset + candidates] == tokens[length - size + offset]
            for start in np.flatnonzero(match)[::-1]:
                yield int(tokens[start + size])
