"""Edges of speculators.tree the main tests pass by: messages, limits, ranks, the rule's order."""

from __future__ import annotations

import numpy as np
import pytest

from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from speculators.tree import (
    FORGET,
    DraftTree,
    RankAcceptance,
    TreeError,
    check_preorder,
    choose_rows,
    lookup_tree,
    depths,
    main_chain_length,
    row_values,
    walk,
)

pytestmark = pytest.mark.pure


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
    chosen = choose_rows(tree, [0.5, 0.2], ranks, step=0.3, forced=1)
    assert chosen.tokens == [0, 1, 3] and chosen.parents == [-1, 0, 0]
    # forced rows count for what they are worth: a side row that does not pay is left out
    weak = RankAcceptance([100.0], [25.0])
    assert choose_rows(DraftTree([0, 1, 3], [-1, 0, 0], [0, 1, 2]), [0.9], weak, step=0.3, forced=1).tokens == [0, 1]


def test_forced_rows_are_the_main_chain_only():
    tree = DraftTree([0, 1, 2, 3], [-1, 0, 1, 0], [0, 1, 1, 2])
    chosen = choose_rows(tree, [0.5, 0.5], RankAcceptance(), step=50.0, forced=10)
    assert chosen.tokens == [0, 1, 2]


def test_a_row_that_adds_nothing_is_not_taken():
    assert choose_rows(DraftTree.chain(0, [5]), [0.0], RankAcceptance(), step=0.0).tokens == [0]


def test_a_side_rows_child_is_ordered_no_higher_than_the_side_row():
    """The side row is held below its main sibling; its child must be held
    there too, or the child could be chosen without its parent."""
    #   0 - 1            main: 0.1
    #    \- 2 - 3        side (0.9 x 0.9 = 0.81 before the hold), its child 0.81 x 0.9
    tree = DraftTree([0, 1, 2, 3], [-1, 0, 0, 2], [0, 1, 2, 1])
    ranks = RankAcceptance([1000.0], [999.9])
    chosen = choose_rows(tree, [0.1, 0.9], ranks, step=0.4)
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
    chosen = choose_rows(tree, [0.5, 0.4], ranks, step=0.3)
    assert chosen.tokens == [0, 1, 3] and chosen.parents == [-1, 0, 0]


def test_prompt_lookup_offers_at_most_eight_candidates_by_default():
    lookup = PromptLookupSpeculator(max_ngram=1, min_ngram=1)
    context = [token for follower in range(10, 20) for token in (1, follower)] + [1]  # 1 followed by ten tokens
    assert lookup.candidates(context) == list(range(19, 11, -1))
    assert lookup.candidates(context, most=2) == [19, 18]
