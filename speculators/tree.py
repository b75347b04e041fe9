"""Token trees: several drafted continuations verified in one target pass. Pure numpy.

A tree is given by its rows in *preorder* with ``parents`` (int32[n]: the
row each row follows; -1 for row 0, the root, which is the last committed
token). Row r predicts the token at ``first_position + depth(r)``.

The *main chain* is the rows 0..m-1 that each follow the row before them:
in preorder it is the first child of each row, down to a leaf. It is what a
chain drafter would have proposed; the other rows are *side branches*, each
an alternative the drafter ranked below the main chain's token.

Why the main chain matters (the KV cache, ``stages.engine``): every tree row
leaves a KV cell in every stage, laid out in batch order. After the pass
only the cells of the main chain's accepted prefix are kept: they sit right
after the committed ones, so the cache stays hole-free, in the same cells in
the same order as when the whole model decodes the text one token at a time
(a hole changes the order attention sums in, and with flash attention on a
pruned branch between kept cells shifted later logits by up to 0.72, measured).
When the target takes a side branch, its accepted tokens are committed but
their cells are dropped, and the next window feeds them again before its
own tokens (``SequenceState.refeed``): a little compute for an exact cache.

Attention within the batch (llama.cpp's speculative example): one KV sequence
id per leaf, the main chain's leaf taking the request's own sequence (0);
each row carries the ids of every leaf below it, and a row attends to the
cells of its first id: the committed text (copied to each id before the
pass) and its own ancestors, never a sibling's branch.

Which tree to verify (``choose_rows``, Sequoia's rule in greedy form): each
candidate row's value is the chance the target reaches and accepts it (the
draft policy's acceptance by position along a chain, the measured acceptance
by candidate rank at a fork); a child never scores above its parent, so the
rows in order of value always form a tree. The tree verified is the prefix
of that order that maximises expected committed tokens per unit of pass
cost (``PassCost``): the measured or emulated curve t(n) read at the width
of each prefix (Sequoia's point: the hardware decides), or without one
t(n) = 1 + step (n - 1) in one-token passes. Where a batch costs nearly n
single passes (a CPU), that is usually a chain; where a pass of hundreds of
rows costs about one (weights streamed from RAM), hundreds of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from speculators.sampling import SamplingSettings, choose_token
from speculators.verify import verify
from stages.cost_curve import BatchCurve
from stages.tree_shape import TreeError, check_preorder, main_chain_length


PassCost = Callable[[int], float]
"""Draft rows a pass verifies (beside its root) -> what the pass costs, in one-token passes."""


def linear_cost(step: float) -> PassCost:
    """t(n) = 1 + step (n - 1): every row beyond the first costs ``step`` passes."""
    return lambda rows: 1.0 + step * rows


def curve_cost(curve: BatchCurve, before: int = 0) -> PassCost:
    """The pass's cost read off a measured or emulated curve at its width
    (``before``: rows the pass carries ahead of the tree, a refeed),
    relative to a one-token pass."""
    one = curve.at(1)
    return lambda rows: curve.at(before + 1 + rows) / one


MAX_TREE_ROWS = 511  # a tree's draft rows: with its root, one llama.cpp batch (stages.settings.DEFAULT_BATCH)
TREE_COST_LIMIT = 2.0  # offered_rows: a drafter grows no more rows than a pass twice a one-token one's can verify


@dataclass(frozen=True)
class TreeAsk:
    """What a drafter is asked to grow: a tree of at most ``rows`` draft rows
    and ``leaves`` leaves; acceptance: the measured chance that the target
    takes the drafter's own choice at a node (speculators.model_tree weighs
    the rank-1 children by it)."""

    rows: int
    leaves: int
    acceptance: float = 0.5

    def __post_init__(self):
        if not 1 <= self.leaves <= self.rows <= MAX_TREE_ROWS:
            raise TreeError(f"tree: {self.rows} rows and {self.leaves} leaves "
                            f"(1 <= leaves <= rows <= {MAX_TREE_ROWS})")
        if not 0.0 <= self.acceptance <= 1.0:
            raise TreeError(f"acceptance: expected a share in [0, 1], got {self.acceptance!r:.40}")


def offered_rows(cost: PassCost, least: int, most: int = MAX_TREE_ROWS) -> int:
    """How many rows a drafter grows a tree to: the widest pass (at least
    ``least``, the chain's drafts; at most ``most``) that costs no more than
    TREE_COST_LIMIT one-token passes. Growing costs the draft time, so where
    rows are dear (this CPU: 2 or 3) the tree is small and the rule takes
    what pays; where a pass of hundreds costs about one, hundreds."""
    rows = least
    while rows < most and cost(rows + 1) <= TREE_COST_LIMIT:
        rows += 1
    return rows


def walk(tokens: Sequence[int], parents: Sequence[int], logits: np.ndarray, first_position: int,
         sampling: SamplingSettings) -> list[int]:
    """Tokens a tree pass commits (sample and match, speculators.verify):
    from the root, choose the target's token at each reached row as plain
    decoding would; descend into the child drafted with that token, if any.

    tokens: the rows' input tokens (row 0 the last committed); logits:
    float32[rows, n_vocab]; first_position: the position row 0 predicts.
    """
    if logits.shape[0] != len(tokens) or len(parents) != len(tokens):
        raise ValueError(f"{logits.shape[0]} logits rows and {len(parents)} parents for {len(tokens)} rows")
    children: dict[int, dict[int, int]] = {}
    for row in range(1, len(tokens)):
        children.setdefault(int(parents[row]), {}).setdefault(int(tokens[row]), row)
    committed: list[int] = []
    row = 0
    while True:
        token = choose_token(logits[row], first_position + len(committed), sampling)
        committed.append(token)
        following = children.get(row, {}).get(token)
        if following is None:
            return committed
        row = following


def verify_rows(drafts: Sequence[int], parents: Sequence[int] | None, logits: np.ndarray, first_position: int,
                sampling: SamplingSettings) -> list[int]:
    """What a window's rows commit: speculators.verify for a chain (parents
    None), the walk for a tree (drafts: its rows after the root)."""
    if parents is None:
        return verify(drafts, logits, first_position, sampling)
    return walk([0, *drafts], parents, logits, first_position, sampling)


def accepted_rows(tokens: Sequence[int], parents: Sequence[int] | None, committed: Sequence[int]) -> list[int]:
    """The rows the committed tokens' accepted drafts sit on, in order (the
    walk's path below the root; the last committed token is the target's own)."""
    path: list[int] = []
    row = 0
    for token in committed[:-1]:
        following = next((child for child in range(row + 1, len(tokens))
                          if (parents[child] if parents is not None else child - 1) == row
                          and int(tokens[child]) == int(token)), None)
        if following is None:
            break
        path.append(following)
        row = following
    return path


@dataclass
class DraftTree:
    """Candidate rows from a drafter, in preorder: tokens (row 0 the root, the
    last committed token), parents, and each row's rank among its siblings
    (1 for the drafter's first choice; 0 for the root)."""

    tokens: list[int]
    parents: list[int]
    ranks: list[int]

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> DraftTree:
        count = len(drafts) + 1
        return cls([root, *map(int, drafts)], list(range(-1, count - 1)), [0] + [1] * len(drafts))

    @property
    def drafts(self) -> list[int]:
        return self.tokens[1:]

    @property
    def is_chain(self) -> bool:
        return all(parent == row - 1 for row, parent in enumerate(self.parents))

    def subtree(self, rows: Sequence[int]) -> DraftTree:
        """The tree of the given rows (a connected set with the root), in preorder."""
        keep = sorted(set(rows) | {0})
        index = {row: position for position, row in enumerate(keep)}
        for row in keep[1:]:
            if self.parents[row] not in index:
                raise TreeError(f"row {row} is kept without its parent {self.parents[row]}")
        return DraftTree([self.tokens[row] for row in keep], [index[self.parents[row]] if row else -1 for row in keep],
                         [self.ranks[row] for row in keep])


def lookup_tree(speculator, context: Sequence[int], limit: int, budget: int, branches: int | None = None) -> DraftTree:
    """A prompt-lookup tree: the main chain is what ``extend`` proposes token
    after token (the chain drafter's own draft, up to ``limit``); at each row of
    it, the other tokens that followed an earlier occurrence of the same
    n-gram (``candidates``: ranked, most recent match first) start side
    branches, each continued by ``extend``. At most ``budget`` draft rows and
    ``branches`` side branches (None: no limit).

    speculator: a speculators.prompt_lookup.PromptLookupSpeculator (its
    ``extend`` and ``candidates``).
    """
    extend, candidates = speculator.extend, speculator.candidates
    text = list(context)
    tree = DraftTree([text[-1]], [-1], [0])
    main: list[int] = []
    while len(main) < limit:
        token = extend(text + main)
        if token is None:
            break
        main.append(token)
        tree.tokens.append(token)
        tree.parents.append(len(tree.tokens) - 2)
        tree.ranks.append(1)
    # a fork at main row r offers alternatives to main[r]; none past the limit's depth
    forks = [(row, text + main[:row]) for row in range(len(main))]
    side: list[tuple[int, int, list[int]]] = []  # (parent row in main, rank, branch tokens)
    room = budget - len(main)
    for row, prefix in forks:
        rank = 2
        for token in candidates(prefix):  # distinct tokens, the main chain's among them
            if room <= 0 or branches is not None and len(side) >= branches:
                break
            if token == main[row]:
                continue
            branch = [token]
            room -= 1
            while room > 0 and len(branch) < limit - row:
                following = extend(prefix + branch)
                if following is None:
                    break
                branch.append(following)
                room -= 1
            side.append((row, rank, branch))
            rank += 1
    if not side:
        return tree
    # preorder: the main chain first, then each side branch after it, in order
    # of its fork from the deepest main row up (every branch follows its fork
    # row's whole subtree up to here, as preorder requires).
    for row, rank, branch in sorted(side, key=lambda item: -item[0]):
        parent = row
        for position, token in enumerate(branch):
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.ranks.append(rank if position == 0 else 1)
            parent = len(tree.tokens) - 1
    check_preorder(tree.parents)
    return tree


FORGET = 0.95  # as speculators.draft_length: the weight older evidence keeps per verified window
PRIOR_RANK_ACCEPTANCE = 0.1  # a fork's second choice, before any evidence


@dataclass
class RankAcceptance:
    """Sequoia's acceptance by candidate rank at a fork, for ranks 2..: of the
    reached rows where the target did not take a better-ranked candidate and
    a rank-r one was offered, the share that took it (older evidence fading)."""

    offered: list[float] = field(default_factory=list)
    taken: list[float] = field(default_factory=list)

    def share(self, rank: int) -> float:
        index = rank - 2
        if index < len(self.offered):
            return (self.taken[index] + PRIOR_RANK_ACCEPTANCE) / (self.offered[index] + 1.0)
        return PRIOR_RANK_ACCEPTANCE

    def observe(self, tree: DraftTree, committed: Sequence[int]) -> None:
        """A verified tree pass committed these tokens."""
        for index in range(len(self.offered)):
            self.offered[index] *= FORGET
            self.taken[index] *= FORGET
        row = 0
        for token in committed:
            children = sorted((tree.ranks[child], child) for child in range(1, len(tree.tokens))
                              if tree.parents[child] == row)
            following = None
            for rank, child in children:
                if rank >= 2:
                    while len(self.offered) < rank - 1:
                        self.offered.append(0.0)
                        self.taken.append(0.0)
                    self.offered[rank - 2] += 1.0
                if tree.tokens[child] == token:
                    if rank >= 2:
                        self.taken[rank - 2] += 1.0
                    following = child
                    break
            if following is None:
                return
            row = following


def row_values(tree: DraftTree, chain_acceptance: Sequence[float], ranks: RankAcceptance) -> list[float]:
    """Each row's chance of being reached and accepted (the root: 1).

    A rank-1 child at branch depth d (d rows since its branch left the main
    chain, or its depth on the main chain) is accepted with the chain's
    acceptance at position d; a rank-r child of a fork with the rank
    acceptance, once every better-ranked sibling was declined."""
    values = [1.0] * len(tree.tokens)
    branch_depth = [0] * len(tree.tokens)
    declined: dict[int, float] = {}  # by parent row: the chance its better-ranked children were all declined
    for row in range(1, len(tree.tokens)):
        parent = tree.parents[row]
        rank = tree.ranks[row]
        if rank <= 1:
            branch_depth[row] = branch_depth[parent] + 1
            position = min(branch_depth[row], len(chain_acceptance)) - 1
            share = chain_acceptance[position] if chain_acceptance else 0.5
        else:
            branch_depth[row] = 1
            share = ranks.share(rank)
        remaining = declined.get(parent, 1.0)
        values[row] = values[parent] * remaining * share
        declined[parent] = remaining * (1.0 - share)
    return values


def choose_rows(tree: DraftTree, chain_acceptance: Sequence[float], ranks: RankAcceptance, cost: PassCost,
                forced: int = 0) -> DraftTree:
    """The subtree to verify: rows in order of value, as many as maximise
    (1 + sum of values) / cost(rows) (see the module text).
    forced: the first rows of the main chain are taken whatever they are worth
    (the draft policy chose that chain; the rule adds side rows to it)."""
    values = row_values(tree, chain_acceptance, ranks)
    # A row is ordered no higher than its better-ranked siblings, so a fork's
    # first choice always comes first: the verified tree's main chain (its
    # first children, which the cache keeps) is then the drafter's chain.
    ordering = list(values)
    best_sibling: dict[int, float] = {}
    for row in range(1, len(tree.tokens)):
        parent = tree.parents[row]
        ordering[row] = min(values[row], ordering[parent], best_sibling.get(parent, values[row]))
        best_sibling[parent] = ordering[row]
    forced = min(forced, main_chain_length(tree.parents) - 1)
    order = list(range(1, forced + 1)) + sorted(range(forced + 1, len(tree.tokens)),
                                                 key=lambda row: (-ordering[row], row))
    expected = 1.0 + sum(values[row] for row in order[:forced])
    best_count, best_rate = forced, expected / cost(forced)
    for count, row in enumerate(order[forced:], start=forced + 1):
        expected += values[row]
        rate = expected / cost(count)
        if rate > best_rate:
            best_count, best_rate = count, rate
    return tree.subtree(order[:best_count])
