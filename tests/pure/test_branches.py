"""Branch windows (orchestrator.decoding.branches): rooted at the committed
text, made while windows before them are in flight, kept across the
rejections their side branches cover, fed from where the stages' cells
leave the committed text (SequenceState.branch_window, verified, fed)."""

from orchestrator.decoding.branches import branch_tree, fed_agreement, reaches
from orchestrator.decoding.schedule import Schedule, SequenceState
from orchestrator.decoding.speculation import Speculation
from orchestrator.decoding.windows import Window
from stages.tree_shape import check_preorder


def never_ends(token):
    return False


def branching(speculation=(4, 5, 6), stages=2):
    """Prompt 1 2, generated 3 (the stages hold 1 2); passes priced flat, trees of 3 leaves, 8 drafts at most."""
    return SequenceState(0, [1, 2, 3], 2, 50, Schedule.ASYNC, 8, speculation=Speculation(list(speculation)),
                         draft_limit=4, draft_step=0.0, branches=True, stages=stages, tree_leaves=3)


def test_a_branch_tree_hangs_each_correction_beside_the_chain_in_preorder():
    corrections = {(3, 40): [40, 41], (5, 60): [60, 61, 62], (4, 5): [5, 9]}  # 5 at 4 is the chain's own: no branch
    tree = branch_tree(3, [4, 5, 6], corrections, 3, branches=5)
    assert tree.tokens == [3, 4, 5, 6, 60, 61, 62, 40, 41]
    assert tree.parents == [-1, 0, 1, 2, 2, 4, 5, 0, 7]  # 60 follows 5 (position 4), 40 the root
    assert tree.ranks == [0, 1, 1, 1, 2, 1, 1, 2, 1]
    check_preorder(tree.parents)
    assert branch_tree(3, [4, 5, 6], corrections, 3, branches=1).tokens == [3, 4, 5, 6, 40, 41]  # the earliest fork


def test_the_fed_agreement_is_where_the_cells_leave_the_committed_text():
    assert fed_agreement([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 2
    assert fed_agreement([1, 2], [1, 2, 3]) == 2
    assert fed_agreement([1, 2, 3, 4], [1, 2]) == 2


def test_a_window_reaches_the_committed_text_only_along_its_rows():
    window = Window(0, 2, (3, 4, 5, 6, 50, 51), parents=(-1, 0, 1, 2, 1, 4))
    assert reaches(window, [1, 2, 3])
    assert reaches(window, [1, 2, 3, 4, 50, 51])
    assert not reaches(window, [1, 2, 3, 4, 60])
    assert not reaches(window, [1, 2, 3, 4, 5, 6, 7])  # beyond its rows: it gives nothing new


def _head_and_branch():
    """The head window 3 | 4 5 6 (positions 2-5) in flight; the drafter
    brought 7 8 and a correction 50 51 52 at position 4; the branch window
    feeds them all again from the root 3, with the correction beside 5."""
    state = branching()
    head = state.first_window()
    state.drafted([7, 8], {(4, 50): [50, 51, 52]})
    return state, head, state.branch_window()


def test_a_branch_window_verifies_the_windows_in_flight_again_with_their_corrections():
    state, head, branch = _head_and_branch()
    assert (head.first, head.inputs) == (2, (3, 4, 5, 6))
    assert (branch.first, branch.refed) == (2, 0)
    assert branch.inputs == (3, 4, 5, 6, 7, 8, 50, 51, 52)
    assert branch.parents == (-1, 0, 1, 2, 3, 4, 1, 6, 7)
    assert state.branch_window() is None  # two stages: two windows in flight at most


def test_a_branch_window_is_no_wider_than_the_pass_the_step_was_measured_at():
    state = branching(speculation=range(4, 20), stages=3)
    state.accepted_whole = True  # a chain goes only after a window that accepted all its drafts
    state.first_window()  # 3 | 4 5 6 7
    assert state.branch_window().inputs == (3, *range(4, 12))  # 9 rows (DRAFT_STEP_TOKENS + 1): 4 drafts new
    assert state.branch_window() is None  # no wider: it would reach no further


def test_a_rejection_its_correction_covers_keeps_the_branch_window_which_commits_only_what_is_new():
    state, head, branch = _head_and_branch()
    assert state.verified(head, [4, 50], never_ends) == [4, 50]  # 5 rejected, the target says 50
    assert list(state.in_flight) == [branch] and state.discards_pending == 0
    assert state.verified(branch, [4, 50, 51, 52, 99], never_ends) == [51, 52, 99]
    assert state.committed == [1, 2, 3, 4, 50, 51, 52, 99] and state.stats.mismatched_windows == 0
    # the stages keep the branch window's main chain (3 4 5 6 7 8 at 2-7): the next window feeds 50 51 52 again
    window = state.first_window()
    assert (window.first, window.refed, window.inputs[:4]) == (4, 3, (50, 51, 52, 99))


def test_a_rejection_no_branch_covers_discards_the_branch_window_and_the_next_feeds_from_its_first():
    state, head, branch = _head_and_branch()
    state.verified(head, [4, 70], never_ends)
    assert not state.in_flight and state.discards_pending == 1
    assert state.ready  # it need not wait for the discarded result: the next window feeds from before it
    state.speculation.tokens = [71]
    window = state.first_window()
    assert (window.first, window.refed, window.inputs) == (2, 2, (3, 4, 70, 71))


def test_a_branch_window_whose_committed_tokens_come_out_otherwise_commits_nothing():
    state, head, branch = _head_and_branch()
    state.verified(head, [4, 50], never_ends)
    assert state.verified(branch, [4, 60, 61], never_ends) == []  # not the tokens committed at 3 and 4
    assert state.committed == [1, 2, 3, 4, 50] and state.stats.mismatched_windows == 1
    assert state.stats.discarded_passes == 1
    window = state.first_window()  # its cells are not trusted: fed again from its first
    assert (window.first, window.refed) == (2, 2)


def test_without_branches_a_window_ahead_still_waits_for_a_window_that_accepted_all():
    state = SequenceState(0, [1, 2, 3], 2, 50, Schedule.ASYNC, 4, speculation=Speculation([4, 5, 6]), draft_limit=4,
                          draft_step=0.0, stages=2, tree_leaves=3)
    assert not state.branching
    state.first_window()
    state.drafted([7, 8], {(4, 50): [50, 51, 52]})
    assert state.window_ahead() is None


def test_a_branch_window_feeds_again_what_the_cells_of_the_windows_before_it_left_out():
    """Three stages. The head 3 | 4 5 6 and two branch windows from 3, the
    second with a longer correction 50 51 99 at position 4. The head commits
    4 50, the first branch window 51 99 through its side branch; the second
    still holds that path, so it stays, but the stages' cells are its main
    chain (4 5 6 ...): the next window feeds 50 51 again."""
    state = branching(stages=3)
    head = state.first_window()
    state.drafted([7], {(4, 50): [50, 51]})
    first_branch = state.branch_window()
    state.drafted([8], {(4, 50): [50, 51, 99]})
    second_branch = state.branch_window()
    assert second_branch.first == 2 and second_branch.inputs == (3, 4, 5, 6, 7, 8, 50, 51, 99)
    state.verified(head, [4, 50], never_ends)
    assert state.verified(first_branch, [4, 50, 51, 99], never_ends) == [51, 99]
    assert list(state.in_flight) == [second_branch]
    state.drafted([101, 102, 103], {(8, 77): [77]})
    window = state.branch_window()
    assert (window.first, window.refed) == (4, 2)
    assert window.inputs == (50, 51, 99, 101, 102, 103, 77)


def test_a_branch_window_with_its_corrections_is_no_wider_than_a_flat_pass():
    state = branching(speculation=range(4, 12))
    state.accepted_whole = True  # so that a chain may go
    state.first_window()
    state.drafted([], {(4, 50): [50, 51, 52, 53]})
    window = state.branch_window()  # the chain's 8 drafts fill the 9 rows: no room for the correction
    assert window.inputs == (3, *range(4, 12)) and window.parents is None


def test_a_chain_branch_window_waits_for_a_window_that_accepted_all_its_drafts():
    state = branching(speculation=range(4, 12))
    state.first_window()
    assert state.branch_window() is None  # no correction beside it: it would be right only if the head accepts all
    state.accepted_whole = True
    assert state.branch_window().inputs == (3, *range(4, 12))
