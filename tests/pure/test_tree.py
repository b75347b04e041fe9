"""Token trees (speculators.tree): shape, verification, prompt-lookup trees, the rule that sizes them."""

from __future__ import annotations

import numpy as np
import pytest

from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings, choose_token
from speculators.tree import (
    FORGET,
    DraftTree,
    RankAcceptance,
    accepted_rows,
    choose_rows,
    curve_cost,
    linear_cost,
    lookup_tree,
    row_values,
    walk,
)
from stages.tree_shape import TreeError, branch_sequences, check_preorder, depths, main_chain_length
from speculators.verify import verify
from stages.cost_curve import BatchCurve


#        0
#      /   \
#     1     4
#    / \     \
#   2   3     5
PARENTS = [-1, 0, 1, 1, 0, 4]


def test_preorder_is_checked():
    check_preorder(PARENTS)
    check_preorder([-1])
    with pytest.raises(TreeError, match="root"):
        check_preorder([0, 0])
    with pytest.raises(TreeError, match="not preorder"):
        check_preorder([-1, 0, 0, 1])  # row 3 under row 1 after row 2 left it
    with pytest.raises(TreeError, match="not preorder"):
        check_preorder([-1, 0, 5])
    with pytest.raises(TreeError):
        check_preorder([])


def test_shape_of_a_tree():
    assert depths(PARENTS).tolist() == [0, 1, 2, 2, 1, 2]
    assert main_chain_length(PARENTS) == 3
    # leaves 2 (main chain: the request's own sequence 0), 3 and 5 take 1 and 2
    assert branch_sequences(PARENTS) == [[0, 1, 2], [0, 1], [0], [1], [2], [2]]
    assert branch_sequences([-1, 0, 1]) == [[0], [0], [0]]


def _plain_logits(path: tuple[int, ...], n_vocab: int = 7) -> np.ndarray:
    """The target's logits after the given path below the root: a fixed random function of it."""
    seed = abs(hash(path)) % (2**32)
    return np.random.default_rng(seed).normal(size=n_vocab).astype(np.float32)


def _plain_decode(count: int, first_position: int, sampling: SamplingSettings) -> list[int]:
    path: tuple[int, ...] = ()
    for _ in range(count):
        path += (choose_token(_plain_logits(path), first_position + len(path), sampling),)
    return list(path)


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(temperature=0.8, top_p=0.9, seed=5)])
def test_walk_commits_what_plain_decoding_would_for_any_tree(sampling):
    """Sample and match through a tree: for random trees, some holding the
    target's own tokens, the committed tokens are plain decoding's."""
    generator = np.random.default_rng(1)
    taken_side = 0
    for _ in range(300):
        plain = _plain_decode(6, 40, sampling)
        tokens, parents, paths = [3], [-1], [()]
        for row in range(1, int(generator.integers(1, 9))):
            parent = int(generator.integers(0, row))
            # preorder: only a row on the path to the last row may take a child
            chain = [row - 1]
            while parents[chain[-1]] >= 0:
                chain.append(parents[chain[-1]])
            parent = chain[int(generator.integers(0, len(chain)))]
            depth = len(paths[parent])
            token = plain[depth] if generator.random() < 0.6 else int(generator.integers(0, 7))
            tokens.append(token)
            parents.append(parent)
            paths.append(paths[parent] + (token,))
        check_preorder(parents)
        logits = np.stack([_plain_logits(path) for path in paths])
        committed = walk(tokens, parents, logits, 40, sampling)
        assert committed == plain[: len(committed)]
        rows = accepted_rows(tokens, parents, committed)
        assert len(rows) == len(committed) - 1
        taken_side += any(row >= main_chain_length(parents) for row in rows)
    assert taken_side > 10  # the walk left the main chain often enough to test it


def test_walk_of_a_chain_is_verify():
    logits = np.random.default_rng(3).normal(size=(4, 9)).astype(np.float32)
    drafts = [int(np.argmax(logits[0])), int(np.argmax(logits[1])), 0]
    chain = DraftTree.chain(5, drafts)
    assert walk(chain.tokens, chain.parents, logits, 10, SamplingSettings()) == verify(
        drafts, logits, 10, SamplingSettings())
    with pytest.raises(ValueError, match="rows"):
        walk(chain.tokens, chain.parents, logits[:2], 10, SamplingSettings())


def test_lookup_tree_keeps_the_chain_and_forks_on_other_matches():
    speculator = PromptLookupSpeculator(max_ngram=2, min_ngram=1)
    #          a  b  c  d  |  a  b  e  f  |  a  b
    context = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]
    assert speculator.candidates(context) == [5, 3]  # most recent match first
    tree = lookup_tree(speculator, context, limit=3, budget=10)
    check_preorder(tree.parents)
    main = main_chain_length(tree.parents)
    chain = []
    while len(chain) < 3 and (token := speculator.extend(context + chain)) is not None:
        chain.append(token)
    assert tree.tokens[1:main] == chain == [5, 6, 9]
    assert tree.ranks[:main] == [0, 1, 1, 1]
    # the other continuation of "a b" forks at the root, copied on by extend
    side = tree.tokens[main:]
    assert side[0] == 3 and tree.parents[main] == 0 and tree.ranks[main] == 2
    assert side[:3] == [3, 4, 9]
    assert len(tree.tokens) - 1 <= 10
    small = lookup_tree(speculator, context, limit=3, budget=3)
    assert small.is_chain and small.drafts == chain
    assert lookup_tree(speculator, [1, 2, 3], limit=3, budget=5).drafts == []


def test_rank_acceptance_counts_forks_offered_and_taken():
    tree = DraftTree([0, 5, 6, 7, 8], [-1, 0, 1, 0, 0], [0, 1, 1, 2, 3])
    ranks = RankAcceptance()
    ranks.observe(tree, [7, 1])  # the root declined 5, took its rank-2 child 7
    assert ranks.offered == [1.0] and ranks.taken == [1.0]
    ranks.observe(tree, [9])  # declined every candidate: ranks 2 and 3 offered, none taken
    assert ranks.offered == pytest.approx([1.95, 1.0])
    assert ranks.taken == pytest.approx([0.95, 0.0])
    assert ranks.share(2) == pytest.approx((0.95 + 0.1) / 2.95)
    assert ranks.share(9) == 0.1


def test_values_follow_the_chain_acceptance_and_the_ranks():
    tree = DraftTree([0, 5, 6, 7, 8], [-1, 0, 1, 0, 3], [0, 1, 1, 2, 1])
    ranks = RankAcceptance([10.0], [4.0])  # rank 2: (4 + 0.1) / 11
    values = row_values(tree, [0.5, 0.9], ranks)
    rank_two = 4.1 / 11
    assert values == pytest.approx([1.0, 0.5, 0.45, 0.5 * rank_two, 0.5 * rank_two * 0.9])


def test_the_rule_grows_a_tree_only_where_rows_are_cheap():
    speculator = PromptLookupSpeculator(max_ngram=2, min_ngram=1)
    context = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]
    tree = lookup_tree(speculator, context, limit=3, budget=10)
    ranks = RankAcceptance([10.0], [5.0])
    chain_acceptance = [0.8, 0.95, 0.95]
    # a CPU: each row costs half a pass, and only the likely chain pays
    costly = choose_rows(tree, chain_acceptance, ranks, linear_cost(0.5))
    assert costly.is_chain and costly.drafts == [5, 6, 9]
    # nothing pays at all when every row costs a whole pass
    assert choose_rows(tree, chain_acceptance, ranks, linear_cost(1.0)).drafts == []
    # cheap rows (a GPU, a network-bound pipeline): the other match joins as a side branch
    cheap = choose_rows(tree, chain_acceptance, ranks, linear_cost(0.02))
    check_preorder(cheap.parents)
    assert not cheap.is_chain
    assert cheap.tokens[:4] == [2, 5, 6, 9]  # its main chain is still the drafter's chain
    assert 3 in cheap.tokens[4:]


def test_a_side_branch_never_displaces_its_main_sibling():
    """Even when the fork's second choice scores higher, the first choice comes
    first, so the verified tree's first children are the drafter's chain."""
    tree = DraftTree([0, 5, 7], [-1, 0, 0], [0, 1, 2])
    ranks = RankAcceptance([10.0], [9.9])
    values = row_values(tree, [0.1], ranks)
    assert values[2] > values[1]
    chosen = choose_rows(tree, [0.1], ranks, linear_cost(0.001))
    assert chosen.tokens == [0, 5, 7] and chosen.parents == [-1, 0, 0]
    # the side branch alone would pay for its row; without its main sibling it is not verified
    assert (1.0 + values[2]) / 1.8 > 1.0
    assert choose_rows(tree, [0.1], ranks, linear_cost(0.8)).tokens == [0]
    with pytest.raises(TreeError, match="without its parent"):
        DraftTree([0, 5, 6], [-1, 0, 1], [0, 1, 1]).subtree([2])


# -- messages, limits, ranks, the rule's order

def test_preorder_errors_name_the_rows():
    with pytest.raises(TreeError, match=r"^a tree has at least its root row$"):
        check_preorder([])
    with pytest.raises(TreeError, match=r"not a child of 5$"):
        check_preorder([5, 0])
    with pytest.raises(TreeError, match=r"^row 3's parent 1 is not on the path to row 2 \(not preorder\)$"):
        check_preorder([-1, 0, 0, 1])


def test_a_lone_root_is_a_main_chain_of_one():
    assert main_chain_length([-1]) == 1
    assert main_chain_length([-1, 0, 0]) == 2


def test_walk_names_the_rows_it_was_given():
    with pytest.raises(ValueError, match=r"^2 logits rows and 4 parents for 4 rows$"):
        walk([0, 1, 2, 3], [-1, 0, 1, 2], np.zeros((2, 9), np.float32), 0, SamplingSettings())


def test_a_chain_ranks_every_draft_first():
    assert DraftTree.chain(5, [1, 2]).ranks == [0, 1, 1]
    assert DraftTree.chain(5, []).ranks == [0]


#           a  b  c  .  a  b  d  .  a  b  e  .  a  b
FORKS = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2]


def test_lookup_tree_ranks_every_other_candidate_and_continues_each():
    lookup = PromptLookupSpeculator(max_ngram=2, min_ngram=1)
    assert lookup.candidates(FORKS) == [5, 4, 3]
    tree = lookup_tree(lookup, FORKS, limit=2, budget=10)
    # main chain 5 9; at the root 4 (rank 2) and 3 (rank 3), each continued by lookup
    assert tree.tokens == [2, 5, 9, 4, 9, 3, 9]
    assert tree.parents == [-1, 0, 1, 0, 3, 0, 5]
    assert tree.ranks == [0, 1, 1, 2, 1, 3, 1]
    check_preorder(tree.parents)


def test_lookup_tree_stops_at_its_budget_and_its_branches():
    lookup = PromptLookupSpeculator(max_ngram=2, min_ngram=1)
    assert lookup_tree(lookup, FORKS, limit=2, budget=3).tokens == [2, 5, 9, 4]  # one row left: the fork's first
    assert lookup_tree(lookup, FORKS, limit=2, budget=4).tokens == [2, 5, 9, 4, 9]
    assert lookup_tree(lookup, FORKS, limit=2, budget=5).tokens == [2, 5, 9, 4, 9, 3]
    assert lookup_tree(lookup, FORKS, limit=2, budget=10, branches=1).tokens == [2, 5, 9, 4, 9]
    assert lookup_tree(lookup, FORKS, limit=2, budget=10, branches=0).tokens == [2, 5, 9]
    # a branch is no deeper than the limit: forked at the root, two rows at most
    deep = lookup_tree(lookup, FORKS, limit=1, budget=10)
    assert deep.tokens == [2, 5, 4, 3] and deep.parents == [-1, 0, 0, 0]


def test_lookup_tree_places_a_deeper_fork_before_a_shallower_one():
    """Preorder: the branch forked at a deeper main row comes right after the
    main chain, the root's last; no branch reaches deeper than the limit."""
    lookup = PromptLookupSpeculator(max_ngram=2, min_ngram=2)
    #          x  y  s  .  x  y  p  q  .  x  y  p  r  .  x  y
    context = [7, 8, 6, 9, 7, 8, 1, 2, 9, 7, 8, 1, 3, 9, 7, 8]
    tree = lookup_tree(lookup, context, limit=4, budget=12)
    # main chain 1 3 9 7; after "x y p": q beside r (forked at row 1); after "x y": s beside p (the root)
    assert tree.tokens == [8, 1, 3, 9, 7, 2, 9, 7, 6, 9, 7, 8]
    assert tree.parents == [-1, 0, 1, 2, 3, 1, 5, 6, 0, 8, 9, 10]
    assert tree.ranks == [0, 1, 1, 1, 1, 2, 1, 1, 2, 1, 1, 1]
    assert max(depths(tree.parents)) == 4


def test_rank_acceptance_forgets_and_follows_the_path_down():
    #   0 - 5 - 6        the target takes 7 (rank 2), then 8 below it (rank 1), then declines 9's siblings
    #    \- 7 - 8
    #    \- 4
    tree = DraftTree([0, 5, 6, 7, 8, 4], [-1, 0, 1, 0, 3, 0], [0, 1, 1, 2, 1, 3])
    ranks = RankAcceptance([2.0, 2.0], [1.0, 1.0])
    ranks.observe(tree, [7, 8, 1])
    # the old evidence fades once; at the root ranks 2 was offered and taken, rank 3 not reached
    assert ranks.offered == pytest.approx([2.0 * FORGET + 1.0, 2.0 * FORGET])
    assert ranks.taken == pytest.approx([1.0 * FORGET + 1.0, 1.0 * FORGET])
    ranks.observe(tree, [4])  # the root's rank 3: ranks 2 and 3 offered, rank 3 taken
    assert ranks.taken[1] == pytest.approx(1.0 * FORGET * FORGET + 1.0)
    assert ranks.offered[1] == pytest.approx(2.0 * FORGET * FORGET + 1.0)
    # a path that goes on below a taken side row counts the forks down there too
    deeper = DraftTree([0, 7, 8, 3], [-1, 0, 1, 1], [0, 1, 1, 2])
    fresh = RankAcceptance()
    fresh.observe(deeper, [7, 3, 2])
    assert fresh.offered == [1.0] and fresh.taken == [1.0]


def test_values_without_chain_evidence_and_down_a_side_branch():
    tree = DraftTree([0, 5, 7, 8, 9], [-1, 0, 0, 2, 3], [0, 1, 2, 1, 1])
    ranks = RankAcceptance([9.0], [4.4])  # rank 2: 4.5 / 10
    assert row_values(DraftTree.chain(0, [5]), [], ranks) == [1.0, 0.5]
    values = row_values(tree, [0.5, 0.8, 0.6], ranks)
    side = 0.5 * 0.45
    # the side branch's own rows take the chain's acceptance at their depth in it: 2, then 3
    assert values == pytest.approx([1.0, 0.5, side, side * 0.8, side * 0.8 * 0.6])


def test_the_rule_orders_a_side_row_by_value_after_the_forced_chain():
    #   0 - 1 - 2        main chain: 0.5, then 0.5 * 0.2
    #    \- 3            the root's second choice: 0.5 * 0.9 (below its main sibling's 0.5)
    tree = DraftTree([0, 1, 2, 3], [-1, 0, 1, 0], [0, 1, 1, 2])
    ranks = RankAcceptance([100.0], [90.0])
    chosen = choose_rows(tree, [0.5, 0.2], ranks, linear_cost(0.3), forced=1)
    assert chosen.tokens == [0, 1, 3] and chosen.parents == [-1, 0, 0]
    # forced rows count for what they are worth: a side row that does not pay is left out
    weak = RankAcceptance([100.0], [25.0])
    assert choose_rows(DraftTree([0, 1, 3], [-1, 0, 0], [0, 1, 2]), [0.9], weak, linear_cost(0.3), forced=1).tokens == [0, 1]


def test_forced_rows_are_the_main_chain_only():
    tree = DraftTree([0, 1, 2, 3], [-1, 0, 1, 0], [0, 1, 1, 2])
    chosen = choose_rows(tree, [0.5, 0.5], RankAcceptance(), linear_cost(50.0), forced=10)
    assert chosen.tokens == [0, 1, 2]


def test_a_row_that_adds_nothing_is_not_taken():
    assert choose_rows(DraftTree.chain(0, [5]), [0.0], RankAcceptance(), linear_cost(0.0)).tokens == [0]


def test_a_side_rows_child_is_ordered_no_higher_than_the_side_row():
    """The side row is held below its main sibling; its child must be held
    there too, or the child could be chosen without its parent."""
    #   0 - 1            main: 0.1
    #    \- 2 - 3        side (0.9 x 0.9 = 0.81 before the hold), its child 0.81 x 0.9
    tree = DraftTree([0, 1, 2, 3], [-1, 0, 0, 2], [0, 1, 2, 1])
    ranks = RankAcceptance([1000.0], [999.9])
    chosen = choose_rows(tree, [0.1, 0.9], ranks, linear_cost(0.4))
    # ordered by value alone the child would come first and be chosen alone, without its parent
    assert chosen.tokens == [0, 1, 2, 3] and chosen.parents == [-1, 0, 0, 2]


def test_the_root_holds_no_row_below_its_own_value():
    """Only rows below the root are ordered; the root is worth 1. Were it held
    to another row's value, every row would tie and go by index instead."""
    #   0 - 1 - 2        main: 0.5, then 0.5 x 0.4
    #    \- 3 - 4        rank 2 at the root: 0.5 x ~0.89, then x 0.4
    #    \- 5            rank 3: ~0.0005
    tree = DraftTree([0, 1, 2, 3, 4, 5], [-1, 0, 1, 0, 3, 0], [0, 1, 1, 2, 1, 3])
    ranks = RankAcceptance([100.0, 100.0], [90.0, 0.0])
    chosen = choose_rows(tree, [0.5, 0.4], ranks, linear_cost(0.3))
    assert chosen.tokens == [0, 1, 3] and chosen.parents == [-1, 0, 0]


def test_prompt_lookup_offers_at_most_eight_candidates_by_default():
    lookup = PromptLookupSpeculator(max_ngram=1, min_ngram=1)
    context = [token for follower in range(10, 20) for token in (1, follower)] + [1]  # 1 followed by ten tokens
    assert lookup.candidates(context) == list(range(19, 11, -1))
    assert lookup.candidates(context, most=2) == [19, 18]


def _wide_tree(depth: int, width: int) -> DraftTree:
    """A main chain of ``depth`` rows, each with ``width`` - 1 side children (rank 2..): preorder."""
    tree = DraftTree([0], [-1], [0])
    main = [0]
    for _ in range(depth):  # the chain first
        tree.tokens.append(len(tree.tokens))
        tree.parents.append(main[-1])
        tree.ranks.append(1)
        main.append(len(tree.tokens) - 1)
    for parent in reversed(main[:-1]):  # each fork's side children after its whole subtree so far
        for rank in range(2, width + 1):
            tree.tokens.append(len(tree.tokens))
            tree.parents.append(parent)
            tree.ranks.append(rank)
    check_preorder(tree.parents)
    return tree


def test_the_rule_reads_the_curve_at_every_width():
    """Sequoia's point: the hardware decides the tree. On a roofline flat up to
    64 rows the rule verifies far more rows than on a CPU-like line, and a
    kink in the curve (flat to 8 rows, then steep) stops it near the kink,
    which a line through widths 1 and 8 cannot see."""
    tree = _wide_tree(depth=8, width=8)  # 8 + 8 * 7 = 64 draft rows
    ranks = RankAcceptance([20.0] * 7, [6.0, 3.0, 2.0, 1.0, 1.0, 0.5, 0.5])
    chain_acceptance = [0.7] * 8
    flat = BatchCurve((1, 64, 128), (1.0, 1.05, 2.1))
    line = linear_cost(0.5)  # this CPU: a pass of 8 tokens costs 4.5 one-token passes
    on_flat = choose_rows(tree, chain_acceptance, ranks, curve_cost(flat))
    on_line = choose_rows(tree, chain_acceptance, ranks, line)
    assert len(on_flat.drafts) >= 40 and len(on_line.drafts) <= 4
    kinked = BatchCurve((1, 8, 16, 64), (1.0, 1.0, 2.0, 8.0))  # flat to 8 tokens, then linear
    on_kink = choose_rows(tree, chain_acceptance, ranks, curve_cost(kinked))
    assert 5 <= len(on_kink.drafts) <= 9
    # the line through widths 1 and 8 of the same curve sees no cost at all and takes every row
    assert len(choose_rows(tree, chain_acceptance, ranks, linear_cost(0.0)).drafts) == 64
    # rows fed again before the tree (a refeed) take part of the flat region
    assert len(choose_rows(tree, chain_acceptance, ranks, curve_cost(kinked, before=4)).drafts) < len(on_kink.drafts)
