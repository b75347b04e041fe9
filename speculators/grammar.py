"""Structured output under speculation: tokens chosen under a grammar, drafts verified under it.

A request that asks for JSON (the OpenAI API's ``response_format``) is decoded
under a grammar: at every position only the tokens the grammar allows after
the text so far may be chosen. Plain decoding under a grammar chooses each
token from the *masked row*: its logits with every forbidden token at -inf
(argmax, or the draw seeded by (seed, position) of speculators.sampling).

Exactness with speculation: a pass verifies drafts d_1..d_k (a chain, or a
tree's rows); the walk of speculators.verify / speculators.tree.walk is kept,
and each reached row's token is chosen from the masked row under the grammar
state after the committed text *plus the drafts on that row's path*. The walk
reaches a row only when every draft on its path was the token chosen before
it, so that state is exactly the one plain decoding has at that position, and
the row is chosen exactly as plain decoding chooses it: the committed tokens,
and so the output, are the same with speculation as without, for any draft
(a draft the grammar forbids is simply never chosen).

Greedy rows take a fast path, as llama.cpp's common sampler does: the row's
argmax when the grammar allows it (one token checked, not the vocabulary);
that is the masked row's argmax too, since masking only lowers other entries.

Pure: the grammar itself is a ``GrammarState`` (below), whose llama.cpp form is
stages.grammar (the grammar sampler, and the grammar of a ``response_format``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from speculators.sampling import SamplingSettings, choose_token
from stages.errors import GrammarError


MAX_GRAMMAR_TOKENS = 4096  # the most tokens generated under a grammar (each pass carries them all)


class GrammarState(Protocol):
    """Where a grammar stands after some generated tokens."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of float32[n_vocab] logits with every token the grammar forbids at -inf."""

    def allows(self, token: int) -> bool:
        """Whether the grammar allows this token next."""

    def after(self, token: int) -> GrammarState:
        """A new state that accepted the token (this one unchanged)."""

    def free(self) -> None:
        """Release the state (it is not used afterwards)."""


def masked_row(logits: np.ndarray, state: GrammarState) -> np.ndarray:
    """The row plain decoding under the grammar chooses from; GrammarError if
    the grammar allows no token at all (the choice would be meaningless)."""
    masked = state.mask(logits)
    if not np.isfinite(masked.max()):
        raise GrammarError("the grammar allows no token here")
    return masked


def choose_constrained(logits: np.ndarray, position: int, sampling: SamplingSettings, state: GrammarState) -> int:
    """The token at absolute ``position`` chosen from float32[n_vocab] logits
    under the grammar: exactly ``choose_token(masked_row(logits, state), ...)``."""
    if sampling.greedy:
        token = int(np.argmax(logits))
        if state.allows(token):
            return token  # the first maximum of the row stays the first maximum of the masked row
    return choose_token(masked_row(logits, state), position, sampling)


def child_rows(tokens: Sequence[int], parents: Sequence[int]) -> dict[int, dict[int, int]]:
    """For each row, its children by drafted token (the first child drafted
    with a token, as speculators.tree.walk descends)."""
    children: dict[int, dict[int, int]] = {}
    for row in range(1, len(tokens)):
        children.setdefault(int(parents[row]), {}).setdefault(int(tokens[row]), row)
    return children


def verify_constrained(drafts: Sequence[int], parents: Sequence[int] | None, logits: np.ndarray,
                       first_position: int, sampling: SamplingSettings, state: GrammarState) -> list[int]:
    """What a window's rows commit under a grammar: speculators.tree.verify_rows'
    walk (a chain when parents is None, a tree in preorder otherwise) with
    each row chosen by choose_constrained from the grammar state after its path.

    drafts: the rows after the root; logits: float32[rows, n_vocab], row 0 for
    the last committed token; first_position: the position row 0 predicts;
    state: the grammar after every committed token (left unchanged).
    """
    tokens = [0, *map(int, drafts)]
    parents = range(-1, len(drafts)) if parents is None else parents
    if logits.shape[0] != len(tokens) or len(parents) != len(tokens):
        raise ValueError(f"{logits.shape[0]} logits rows and {len(parents)} parents for {len(tokens)} rows")
    children = child_rows(tokens, parents)
    committed: list[int] = []
    row, here = 0, state
    try:
        while True:
            token = choose_constrained(logits[row], first_position + len(committed), sampling, here)
            committed.append(token)
            following = children.get(row, {}).get(token)
            if following is None:
                return committed
            here = advance(here, token, state)
            row = following
    finally:
        if here is not state:
            here.free()


def advance(here: GrammarState, token: int, kept: GrammarState) -> GrammarState:
    """The state after token; ``here`` is freed unless it is the caller's ``kept``."""
    following = here.after(token)
    if here is not kept:
        here.free()
    return following
