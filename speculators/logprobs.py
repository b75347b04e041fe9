"""Log-probabilities of chosen tokens, and the likeliest alternatives: pure numpy.

Computed where the logits are (beside the last stage), so that only the top
entries travel back, never a vocabulary-wide row. They are the model's own
distribution (temperature 1, no top-p, no grammar), computed in float32 as
llama-cpp-python's ``Llama.logits_to_logprobs`` does, so they agree with
its logprobs for the same text. With speculation, a committed token's entry
comes from the row that chose it (speculators.tree.accepted_rows): the same
row plain decoding computes for that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speculators.tree import accepted_rows

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """For k chosen tokens: logprobs float32[k], each token's own; top_tokens
    int32[k, m] and top_logprobs float32[k, m], the m likeliest tokens at each
    (likeliest first; among equal ones by token id, though which of several
    equal ones at the m-th place are in is the partition's choice)."""

    logprobs: np.ndarray
    top_tokens: np.ndarray
    top_logprobs: np.ndarray

    def first(self, count: int) -> TokenLogprobs:
        """The entries of the first ``count`` tokens (those the sequence committed)."""
        return TokenLogprobs(self.logprobs[:count], self.top_tokens[:count], self.top_logprobs[:count])

    def after(self, count: int) -> TokenLogprobs:
        """The entries of the tokens after the first ``count`` (those not yet sent)."""
        return TokenLogprobs(self.logprobs[count:], self.top_tokens[count:], self.top_logprobs[count:])

    def check(self, tokens: int, top: int) -> str:
        """What is wrong with these entries for ``tokens`` tokens with ``top`` alternatives, or ""."""
        shapes = (self.logprobs.shape, self.top_tokens.shape, self.top_logprobs.shape)
        if shapes != ((tokens,), (tokens, top), (tokens, top)):
            return f"logprobs of shapes {shapes} for {tokens} tokens with {top} alternatives"
        if not (np.all(self.logprobs <= 0) and np.all(self.top_logprobs <= 0)):  # NaN fails too
            return "logprobs above 0"
        return ""


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """float32 log-probabilities of float32[k, n_vocab] logit rows (llama-cpp-python's arithmetic)."""
    shifted = np.subtract(rows, np.amax(rows, axis=-1, keepdims=True), dtype=np.single)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top: int) -> TokenLogprobs:
    """Each of ``tokens``' log-probability in the row that chose it (rows:
    float32[k, n_vocab], row i chose token i), and the ``top`` likeliest there."""
    logprobs = log_softmax(rows)
    chosen = logprobs[np.arange(len(tokens)), np.asarray(tokens, np.int64)]
    likeliest = _likeliest(logprobs, top)
    return TokenLogprobs(chosen.astype(np.float32), likeliest.astype(np.int32),
                         np.take_along_axis(logprobs, likeliest, axis=-1).astype(np.float32))


def _likeliest(logprobs: np.ndarray, top: int) -> np.ndarray:
    """int64[k, top]: each row's ``top`` likeliest token ids, likeliest first (a
    partition, then a sort of those only: a vocabulary-wide sort per row costs milliseconds)."""
    if top == 0:
        return np.empty((len(logprobs), 0), np.int64)
    found = np.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
    values = np.take_along_axis(logprobs, found, axis=-1)
    return np.take_along_axis(found, np.lexsort((found, -values), axis=-1), axis=-1)


def window_logprobs(rows: np.ndarray, drafts: Sequence[int], parents: Sequence[int] | None, tokens: Sequence[int],
                    top: int) -> TokenLogprobs:
    """The logprobs of the tokens a window committed, from its logit rows
    float32[rows, n_vocab] (each token's from the row that chose it)."""
    return token_logprobs(rows[choosing_rows(drafts, parents, tokens)], tokens, top)


def choosing_rows(drafts: Sequence[int], parents: Sequence[int] | None, tokens: Sequence[int]) -> list[int]:
    """The window's rows that chose each committed token: row 0, then the rows
    of the drafts accepted on the way (a chain's 1, 2, ...; a tree's path)."""
    return [0, *accepted_rows([0, *drafts], parents, tokens)][: len(tokens)]
