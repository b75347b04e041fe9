"""Windows kept across rejections (SequenceState.branching): the pure rules.

A *branch window* is rooted at the last committed token when it is made,
like any first window, but made while other windows of its sequence are in
flight: its main chain is the whole speculation (the rows of the windows in
flight verified again, then drafts beyond them) and its side branches are the
corrections drafted at those rows (speculators.corrections), so that it
holds the text that follows for the likely outcomes of the windows before
it, not only for "every draft accepted".

* Where it feeds from (``fed_agreement``): the stages' cells are what the
  windows submitted so far left there, each dropping its sequence's cells
  from its first position and writing its main chain (SequenceState.fed);
  a window feeds again from the first position where those differ from the
  committed text, so every row attends to the committed text's own cells,
  whatever the windows before it speculated.
* Whether it is still worth its result (``reaches``): once the windows
  before it have committed their tokens, the committed text after its root
  must be a path of its tree; the row at the end of that path predicts the
  next token, so its result gives at least one. Otherwise it is invalid,
  and so is every window after it that fed from a position after its first
  (those trusted its cells).
* What its result commits (SequenceState.verified): the walk from its root
  as for any window; the tokens for positions already committed must be
  those committed (the same logits, chosen the same way: batch-invariant
  stages, exact trees), and only the rest is new.

No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.decoding.windows import Window
from speculators.corrections import Corrections
from speculators.tree import DraftTree


def fed_agreement(fed: Sequence[int], committed: Sequence[int]) -> int:
    """How many leading positions of the stages' cells hold the committed text."""
    count = min(len(fed), len(committed))
    return next((position for position in range(count) if fed[position] != committed[position]), count)


def tree_rows(window: Window) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tokens, parents) of a decoding window's verified rows (a chain's parents made explicit)."""
    rows = window.inputs[window.refed:]
    return rows, window.parents if window.parents is not None else tuple(range(-1, len(rows) - 1))


def follow(window: Window, tokens: Sequence[int]) -> list[int]:
    """The rows of ``window``'s tree that ``tokens`` (the text after its root)
    reach, from the root down, as far as its rows hold them."""
    rows, parents = tree_rows(window)
    path, row = [], 0
    for token in tokens:
        row = next((child for child in range(row + 1, len(rows)) if parents[child] == row and rows[child] == token),
                   None)
        if row is None:
            break
        path.append(row)
    return path


def reaches(window: Window, committed: Sequence[int]) -> bool:
    """The committed text after the window's root is a path of its tree."""
    root = window.first + window.refed
    after = committed[root + 1:]
    return len(follow(window, after)) == len(after)


def branch_tree(root: int, chain: Sequence[int], corrections: Corrections, position: int,
                branches: int) -> DraftTree:
    """The chain after ``root`` (its first draft at ``position``) with, as side
    branches, the corrections at its drafts (a correction's token at rank 2,
    its continuation after it at rank 1), at most ``branches`` of them, the
    earliest first (an earlier fork is reached more often)."""
    tokens, parents, ranks = [root, *chain], list(range(-1, len(chain))), [0] + [1] * len(chain)
    forks = sorted((at, correction) for (at, token), correction in corrections.items()
                   if position <= at < position + len(chain) and correction and chain[at - position] != token)
    side_tokens, side_parents, side_ranks = [], [], []
    for at, correction in sorted(forks[:branches], key=lambda fork: -fork[0]):
        start = len(tokens) + len(side_tokens)
        side_tokens.extend(correction)
        side_parents.extend([at - position, *range(start, start + len(correction) - 1)])
        side_ranks.extend([2] + [1] * (len(correction) - 1))
    # preorder: the side branches after the whole main chain, the deepest fork's first
    return DraftTree(tokens + side_tokens, parents + side_parents, ranks + side_ranks)
