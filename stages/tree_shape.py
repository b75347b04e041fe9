"""The geometry of a token tree, as both the stage engine (its KV sequence
ids and positions) and the speculators (drafting, walking, sizing trees)
need it. Pure Python and numpy: it sits at the bottom, so neither package
imports the other for it.

A tree is given by its rows in *preorder* with ``parents`` (int32[n]: the
row each row follows; -1 for row 0, the root). The *main chain* is the rows
0..m-1 that each follow the row before them (the first child of each row,
down to a leaf); speculators.tree says why it matters for the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TreeError(ValueError):
    """The parents do not describe a tree in preorder."""


def check_preorder(parents: Sequence[int]) -> None:
    """Raise TreeError unless parents describe one tree in preorder rooted at row 0."""
    if len(parents) == 0:
        raise TreeError("a tree has at least its root row")
    if int(parents[0]) != -1:
        raise TreeError(f"row 0 is the root (parent -1), not a child of {int(parents[0])}")
    path = [0]  # the rows from the root to the row before this one
    for row in range(1, len(parents)):
        parent = int(parents[row])
        while path and path[-1] != parent:
            path.pop()
        if not path:
            raise TreeError(f"row {row}'s parent {parent} is not on the path to row {row - 1} (not preorder)")
        path.append(row)


def depths(parents: Sequence[int]) -> np.ndarray:
    """int32[n]: each row's distance from the root (parents in preorder)."""
    result = np.zeros(len(parents), dtype=np.int32)
    for row in range(1, len(parents)):
        result[row] = result[int(parents[row])] + 1
    return result


def main_chain_length(parents: Sequence[int]) -> int:
    """Rows of the main chain: the leading rows that each follow the one before."""
    length = 1
    while length < len(parents) and int(parents[length]) == length - 1:
        length += 1
    return length


def branch_sequences(parents: Sequence[int]) -> list[list[int]]:
    """For each row, the KV sequence ids of the leaves below it, ascending:
    0 for the main chain's leaf, 1, 2, ... for the other leaves in preorder.
    A row attends with its first id (0 on the main chain)."""
    count = len(parents)
    has_child = [False] * count
    for row in range(1, count):
        has_child[int(parents[row])] = True
    main = main_chain_length(parents)
    sequences: list[list[int]] = [[] for _ in range(count)]
    next_id = 1
    for row in range(count):
        if has_child[row]:
            continue
        leaf_id = 0 if row == main - 1 else next_id
        next_id += leaf_id != 0
        node = row
        while node >= 0:
            sequences[node].append(leaf_id)
            node = int(parents[node])
    for ids in sequences:
        ids.sort()
    return sequences
