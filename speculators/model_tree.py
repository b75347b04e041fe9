"""A draft model's token tree, grown best-first (SpecExec): the draft's
likeliest accepted continuations, not one chain.

The tree starts at the last token of the context (its root) and grows by
rounds. Each round takes the unexpanded nodes of highest priority, decodes
a batch of them in one draft pass, and adds each one's ``TOP_K`` most
probable next tokens as its children. A node's priority is the product
along its path of each step's weight: for a rank-1 child (the draft's own
choice) the measured chance that the target takes it (``acceptance``, the
draft policy's); for the others the draft's probability of the token, at
most its rank-1 sibling's weight. (A priority from the draft's
probabilities alone, SpecExec's, spent the rows on width: on the bench's
chat the trees' main chains were shorter than the chains the policy
drafts, and at temperature 1, where the draft's top probability lies far
below the acceptance of its coupled draw, trees committed fewer tokens a
pass than chains: benchmarks/results/draft-trees/*-cumulative.) The batch
is a quarter of the rows asked for, 1 to ``EXPAND_BATCH``: a small tree
expands few nodes a round, since where the draft computes on a CPU a batch
costs nearly its rows one at a time. It stops when the tree holds ``rows``
nodes that no unexpanded node can beat (a child never weighs more than its
parent), at ``depth``, at the deadline, or when the draft engine has no KV
id left for a new branch. The tree handed on is the ``rows`` nodes of
highest priority with at most ``leaves`` leaves, in the preorder the
stages verify, children by rank: the first children (rank 1) form the main
chain, the draft's own chain.

Coupled drafting (``sampling`` not greedy): each node's rank-1 child is the
token the draft *samples* at that position with the same seeded noise the
target will draw with there (speculators.sampling: Gumbel-max, noise seeded
by (seed, position)), so where the draft's distribution is close to the
target's the two draw the same token. The other children are the
draft's most probable other tokens. Verification is unchanged (sample and match),
so the committed text is the seeded run's whatever is drafted.

KV: the draft engine holds ``tree_sequences`` extra ids (stages.engine):
branch 0 is the context's own sequence and takes the first child decoded
below each of its rows; any other child decoded opens a branch forked from
its parent's below its position. The next context's ``remove`` drops every
branch but 0, whose cells after the context are the main chain decoded.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speculators.sampling import SamplingSettings, choose_token, token_probabilities
from speculators.tree import DraftTree

TOP_K = 4  # children offered per expanded node: the draft's most probable tokens there
EXPAND_BATCH = 16  # nodes decoded together in one draft pass while a tree grows


@dataclass
class _Node:
    token: int
    parent: int
    logp: float  # the log of its priority: its path's weights (module text; the root: 0)
    depth: int
    rank: int  # among its siblings: 1 the draft's choice (argmax, or its coupled draw)
    branch: int = -1  # the KV id holding it and its ancestors, once decoded


def children_of(logits: np.ndarray, position: int, sampling: SamplingSettings | None,
                top_k: int = TOP_K) -> list[tuple[int, float]]:
    """(token, probability used to rank it) of a node's children, rank 1
    first: the draft's choice at ``position`` (argmax, or the coupled draw),
    then its most probable other tokens."""
    coupled = sampling is not None and not sampling.greedy
    if coupled:
        probabilities = token_probabilities(logits, sampling)
    else:
        shifted = np.exp(logits.astype(np.float64) - float(logits.max()))
        probabilities = shifted / shifted.sum()
    count = min(top_k + 1, len(probabilities))
    best = np.argpartition(-probabilities, count - 1)[:count]
    best = best[np.argsort(-probabilities[best], kind="stable")]
    first = choose_token(logits, position, sampling) if coupled else int(best[0])
    chosen = [(first, float(probabilities[best[0]]))]
    chosen += [(int(token), float(probabilities[token])) for token in best if int(token) != first]
    return [(token, probability) for token, probability in chosen[:top_k] if probability > 0.0]


class TreeGrowth:
    """One tree being grown in a draft engine (the module text): ``root_logits``
    the draft's logits after the context, already decoded in branch 0."""

    def __init__(self, engine, context: Sequence[int], root_logits: np.ndarray, sampling: SamplingSettings | None,
                 depth: int, step_seconds: float = 0.0, acceptance: float = 0.5):
        self.engine = engine
        self.sampling = sampling
        self.acceptance = min(max(acceptance, 0.01), 1.0)
        self.depth = depth
        self.step_seconds = step_seconds
        self.base = len(context) - 1  # the root's position
        self.nodes = [_Node(int(context[-1]), -1, 0.0, 0, 0, branch=0)]
        self.path_end = {0: 0}  # branch -> the deepest decoded node on it
        self.free = list(range(engine.tree_sequences, 0, -1))
        self.frontier: list[tuple[float, int]] = []  # (-logp, node) not yet expanded
        self._expand(0, root_logits)

    def grow(self, rows: int, deadline: float) -> None:
        """Rounds until ``rows`` nodes are settled, the depth or the KV ids run out, or the deadline."""
        while self.frontier and time.perf_counter() < deadline:
            batch = self._next_batch(rows)
            if not batch:
                return
            started = time.perf_counter()
            nodes = [self.nodes[index] for index in batch]
            logits = self.engine.decode_branches(
                np.array([self.base + node.depth for node in nodes], np.int32),
                np.array([node.token for node in nodes], np.int32), np.array([node.branch for node in nodes], np.int32))
            rest = self.step_seconds - (time.perf_counter() - started)  # an emulated draft pass (stages.cost_curve)
            if rest > 0:
                time.sleep(rest)
            for index, row in zip(batch, logits):
                self._expand(index, row)

    def _cut(self, rows: int) -> float:
        """The log priority a node must beat to be among the ``rows`` best (-inf: fewer nodes than rows)."""
        if len(self.nodes) - 1 < rows:
            return -math.inf
        return heapq.nlargest(rows, (node.logp for node in self.nodes[1:]))[-1]

    def _next_batch(self, rows: int) -> list[int]:
        """The unexpanded nodes of highest priority that can still matter, each given its KV branch."""
        cut = self._cut(rows)
        batch: list[int] = []
        size = min(EXPAND_BATCH, max(1, rows // TOP_K))
        while self.frontier and len(batch) < size:
            negative, index = self.frontier[0]
            if -negative <= cut:
                break  # its children cannot beat the nodes already there
            heapq.heappop(self.frontier)
            if self._place(index):
                batch.append(index)
        return batch

    def _place(self, index: int) -> bool:
        """Give a node its KV branch: its parent's, if the parent ends that
        branch; else a new one forked below it (False: no id left)."""
        node = self.nodes[index]
        parent = self.nodes[node.parent]
        if self.path_end[parent.branch] == node.parent:
            node.branch = parent.branch
        elif self.free:
            node.branch = self.free.pop()
            self.engine.fork(parent.branch, node.branch, self.base + parent.depth + 1)
        else:
            return False
        self.path_end[node.branch] = index
        return True

    def _expand(self, index: int, logits: np.ndarray) -> None:
        node = self.nodes[index]
        if node.depth >= self.depth:
            return
        position = self.base + node.depth + 1
        for rank, (token, probability) in enumerate(children_of(logits, position, self.sampling), start=1):
            weight = self.acceptance if rank == 1 else min(probability, self.acceptance)
            child = _Node(token, index, node.logp + math.log(weight), node.depth + 1, rank)
            self.nodes.append(child)
            if child.depth < self.depth:
                heapq.heappush(self.frontier, (-child.logp, len(self.nodes) - 1))

    def main_tokens(self) -> list[int]:
        """The tokens branch 0 holds after the root (the decoded part of the main chain)."""
        path, index = [], self.path_end[0]
        while index > 0:
            path.append(self.nodes[index].token)
            index = self.nodes[index].parent
        return path[::-1]

    def tree(self, rows: int, leaves: int) -> DraftTree:
        """The ``rows`` nodes of highest priority with at most ``leaves`` leaves, in preorder, children by rank."""
        chosen = {0}
        children: dict[int, list[int]] = {0: []}
        leaf_count = 1
        for index in sorted(range(1, len(self.nodes)), key=lambda index: (-self.nodes[index].logp, index)):
            if len(chosen) > rows:
                break
            parent = self.nodes[index].parent
            if parent not in chosen:
                continue
            opens = bool(children[parent])  # a second child makes a new leaf
            if opens and leaf_count >= leaves:
                continue
            leaf_count += opens
            chosen.add(index)
            children[parent].append(index)
            children[index] = []
        tree = DraftTree([], [], [])
        stack = [(0, -1)]
        while stack:
            index, parent_row = stack.pop()
            node = self.nodes[index]
            tree.tokens.append(node.token)
            tree.parents.append(parent_row)
            tree.ranks.append(node.rank)
            row = len(tree.tokens) - 1
            for child in sorted(children[index], key=lambda child: -self.nodes[child].rank):
                stack.append((child, row))
        return tree
