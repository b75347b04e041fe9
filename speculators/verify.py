"""Which draft tokens a target pass accepts: sample and match.

A pass feeds the target [last committed token, d_1, ..., d_k] and gets one logits
row per input: row i predicts the token at absolute position ``first_position + i``.
At each row the target's own token is chosen exactly as plain decoding would
choose it (argmax, or a draw seeded by (seed, position): see
speculators.sampling); while it equals the draft token the walk goes on; the
first mismatch, or the row after the last draft, contributes the target's token
and ends the pass. The committed tokens are therefore exactly those plain
decoding would produce, for any draft: greedy and seeded sampling alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speculators.sampling import SamplingSettings, choose_token


def verify(drafts: Sequence[int], logits: np.ndarray, first_position: int, sampling: SamplingSettings) -> list[int]:
    """Tokens one pass commits: the accepted drafts, then the target's own token.

    drafts: d_1..d_k, the speculated tokens that followed the last committed one.
    logits: float32[k + 1, n_vocab], rows for the last committed token and each draft.
    first_position: absolute position of the token row 0 predicts.
    """
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} logits rows for {len(drafts)} drafts (need drafts + 1)")
    committed: list[int] = []
    for row in range(len(drafts) + 1):
        token = choose_token(logits[row], first_position + row, sampling)
        committed.append(token)
        if row == len(drafts) or token != drafts[row]:
            break
    return committed
