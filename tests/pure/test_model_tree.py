"""A draft model's tree grown best-first (speculators.model_tree), against a
stand-in engine that checks every decoded row sees exactly its ancestors in
its KV branch: the tree is the most probable nodes, in preorder, within the
rows and leaves asked for; its main chain is the draft's own chain."""

import math

import numpy as np
import pytest

from speculators.model_tree import TOP_K, TreeGrowth, children_of
from speculators.sampling import SamplingSettings, choose_token
from stages.tree_shape import check_preorder, depths, main_chain_length

VOCAB = 40
CONTEXT = [3, 1, 4, 1, 5]


def next_logits(token: int) -> np.ndarray:
    """The stand-in draft: after token t, t + 1 is likeliest, then t + 2, t + 3 ... (mod VOCAB)."""
    logits = np.full(VOCAB, -8.0, np.float32)
    for offset, value in enumerate([3.0, 2.0, 1.2, 0.5, 0.1], start=1):
        logits[(token + offset) % VOCAB] = value
    return logits


class BranchEngine:
    """Holds each KV branch's tokens by position, as llama.cpp's sequence ids
    would: decode_branches checks each row's branch holds its path."""

    def __init__(self, tree_sequences: int = 16):
        self.tree_sequences = tree_sequences
        self.branches: dict[int, dict[int, int]] = {0: dict(enumerate(CONTEXT))}
        self.rounds = 0

    def fork(self, source: int, destination: int, end: int) -> None:
        assert 0 < destination <= self.tree_sequences
        self.branches[destination] = {position: token for position, token in self.branches[source].items()
                                      if position < end}

    def decode_branches(self, positions, tokens, branches):
        self.rounds += 1
        rows = []
        for position, token, branch in zip(positions.tolist(), tokens.tolist(), branches.tolist()):
            cells = self.branches[branch]
            assert sorted(cells) == list(range(position)), (branch, position, sorted(cells))  # no hole, nothing after
            cells[position] = token
            rows.append(next_logits(token))
        return np.stack(rows)


def grow(rows: int, leaves: int, depth: int = 6, sampling=None, branches: int = 16, acceptance: float = 0.5):
    engine = BranchEngine(branches)
    growth = TreeGrowth(engine, CONTEXT, next_logits(CONTEXT[-1]), sampling, depth, acceptance=acceptance)
    growth.grow(rows, deadline=math.inf)
    return growth, growth.tree(rows, leaves), engine


def priority(tree, row: int, acceptance: float) -> float:
    """A row's log priority, from its path: the acceptance for a rank-1 step, else the draft's probability (capped)."""
    total = 0.0
    while row > 0:
        parent = tree.parents[row]
        logits = next_logits(tree.tokens[parent]).astype(np.float64)
        probabilities = np.exp(logits - logits.max())
        probability = probabilities[tree.tokens[row]] / probabilities.sum()
        total += math.log(acceptance if tree.ranks[row] == 1 else min(probability, acceptance))
        row = parent
    return total


def test_the_tree_is_the_nodes_of_highest_priority_in_preorder_with_the_drafts_chain_first():
    growth, tree, engine = grow(rows=24, leaves=24)
    check_preorder(tree.parents)
    assert len(tree.drafts) == 24
    main = main_chain_length(tree.parents)
    assert tree.tokens[:main] == [CONTEXT[-1] + step for step in range(main)]  # the draft's argmax chain
    assert all(rank == 1 for rank in tree.ranks[1:main])
    # the kept nodes are the 24 of highest priority of all the growth saw (none left out ranks higher)
    kept = sorted(priority(tree, row, 0.5) for row in range(1, len(tree.tokens)))
    seen = sorted((node.logp for node in growth.nodes[1:]), reverse=True)
    assert len(seen) > 24 and kept[0] >= seen[23] - 1e-9
    assert engine.rounds < 24  # rounds decode several nodes at once


def test_leaves_depth_and_rows_bound_the_tree():
    _, narrow, _ = grow(rows=30, leaves=3)
    assert len(narrow.parents) - len(set(narrow.parents[1:])) <= 3
    _, shallow, _ = grow(rows=30, leaves=30, depth=2)
    assert int(depths(shallow.parents).max()) <= 2
    _, small, _ = grow(rows=3, leaves=3)
    assert len(small.drafts) == 3


def test_no_branch_id_left_stops_the_growth_cleanly():
    growth, tree, engine = grow(rows=40, leaves=40, branches=2)
    check_preorder(tree.parents)
    assert len(engine.branches) <= 3  # branch 0 and the two ids there are


def test_coupled_children_start_with_the_targets_draw_for_the_position():
    sampling = SamplingSettings(temperature=1.0, seed=4)
    logits = next_logits(7)
    for position in range(10, 40):
        children = children_of(logits, position, sampling)
        assert children[0][0] == choose_token(logits, position, sampling)
        assert len({token for token, _ in children}) == len(children) <= TOP_K
    # greedy: the draft's argmax, then its next most probable
    assert [token for token, _ in children_of(logits, 10, None)] == [8, 9, 10, 11]


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_round_decodes_no_more_nodes_than_a_quarter_of_the_rows(rows):
    class Counting(BranchEngine):
        widest = 0

        def decode_branches(self, positions, tokens, branches):
            Counting.widest = max(Counting.widest, len(positions))
            return super().decode_branches(positions, tokens, branches)

    engine = Counting(64)
    TreeGrowth(engine, CONTEXT, next_logits(CONTEXT[-1]), None, 8).grow(rows, deadline=math.inf)
    assert Counting.widest <= max(1, rows // TOP_K)


def test_a_draft_accepted_more_often_grows_a_deeper_main_chain():
    """The rank-1 children weigh the measured acceptance: at 0.9 the tree
    spends its rows on depth, at 0.3 on the draft's other choices near the root."""
    _, trusted, _ = grow(rows=16, leaves=16, depth=12, acceptance=0.9)
    _, doubted, _ = grow(rows=16, leaves=16, depth=12, acceptance=0.3)
    assert main_chain_length(trusted.parents) > main_chain_length(doubted.parents) + 2
