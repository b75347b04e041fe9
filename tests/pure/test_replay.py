"""The ledger of what every stage caches, and the replay that rebuilds it (pure)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.transport.ledger import KvLedger, PassRecord


def record(sequence, keep, tokens, first=None, rows=None):
    first = keep if first is None else first
    positions = np.arange(first, first + len(tokens), dtype=np.int32)
    return PassRecord(sequence, keep, positions, np.asarray(tokens, np.int32),
                      np.asarray(rows if rows is not None else [len(tokens) - 1], np.int32))


class StageCache:
    """What a stage does with a pass (stages.engine): drop from keep on, then cache
    the tokens; a copy: the source's cells below keep."""

    def __init__(self):
        self.cells: dict[int, dict[int, int]] = {}

    def apply(self, pass_record: PassRecord) -> None:
        if pass_record.source is not None:
            copied = {position: token for position, token in self.cells.get(pass_record.source, {}).items()
                      if position < pass_record.keep}
            self.cells.pop(pass_record.sequence, None)
            if copied:
                self.cells[pass_record.sequence] = copied
            return
        cells = self.cells.setdefault(pass_record.sequence, {})
        for position in [position for position in cells if position >= pass_record.keep]:
            del cells[position]
        cells.update(zip(pass_record.positions.tolist(), pass_record.tokens.tolist()))
        if not cells:
            del self.cells[pass_record.sequence]


def test_a_window_rolls_back_what_it_replaces():
    ledger = KvLedger()
    ledger.settle(record(0, 0, [5, 6, 7, 8]), decoded=True)  # prompt
    ledger.settle(record(0, 3, [8, 9, 10, 11]), decoded=True)  # last committed + 3 drafts
    ledger.settle(record(0, 5, [10, 12]), decoded=True)  # one draft accepted, one rejected
    assert ledger.held(0) == ([0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 10, 12])


def test_a_release_drops_the_sequence_and_a_failed_pass_keeps_only_what_every_stage_agrees_on():
    ledger = KvLedger()
    ledger.settle(record(0, 0, [1, 2, 3]), decoded=True)
    ledger.settle(record(1, 0, [4, 5, 6, 7]), decoded=True)
    ledger.settle(PassRecord.release(0), decoded=True)
    assert ledger.sequences == [1]
    ledger.settle(record(1, 2, [9, 9, 9]), decoded=False)  # a stage refused it: positions >= 2 are undefined
    assert ledger.held(1) == ([0, 1], [4, 5])


def test_a_copy_holds_the_sources_tokens_below_keep_and_a_failed_copy_holds_nothing():
    ledger = KvLedger()
    ledger.settle(record(0, 0, [1, 2, 3, 4]), decoded=True)
    ledger.settle(record(1, 0, [9]), decoded=True)
    ledger.settle(PassRecord.copy(0, 1, 3), decoded=True)
    assert ledger.held(1) == ([0, 1, 2], [1, 2, 3])
    ledger.settle(record(1, 3, [7]), decoded=True)  # the copy's next pass goes on from it
    assert ledger.held(1) == ([0, 1, 2, 3], [1, 2, 3, 7]) and ledger.held(0) == ([0, 1, 2, 3], [1, 2, 3, 4])
    ledger.settle(PassRecord.copy(0, 2, 2), decoded=False)
    assert 2 not in ledger.sequences


def test_positions_that_do_not_follow_the_cache_are_a_bug_not_a_silent_gap():
    ledger = KvLedger()
    ledger.settle(record(0, 0, [1, 2, 3]), decoded=True)
    with pytest.raises(ValueError, match="do not follow"):
        ledger.settle(record(0, 3, [4], first=1), decoded=True)


def test_rebuild_chunks_each_sequence_by_n_batch_and_clears_first():
    ledger = KvLedger()
    ledger.settle(record(3, 0, list(range(100, 110))), decoded=True)
    ledger.settle(record(1, 0, [7, 8]), decoded=True)
    passes = ledger.rebuild(n_batch=4)
    assert [(p.sequence, p.keep, p.positions.tolist()) for p in passes] == [
        (1, 0, [0, 1]),
        (3, 0, [0, 1, 2, 3]), (3, 4, [4, 5, 6, 7]), (3, 8, [8, 9]),
    ]
    assert all(p.logit_rows.tolist() == [len(p.positions) - 1] for p in passes)
    assert passes[-1].tokens.tolist() == [108, 109]


@st.composite
def pass_histories(draw):
    """Passes of up to three sequences as the schedule makes them: each starts
    at or below the end of what its sequence sent before (a rollback), some
    are releases, some fail; ``settled`` of them have come back."""
    ends = {0: 0, 1: 0, 2: 0}
    history = []
    for _ in range(draw(st.integers(1, 25))):
        sequence = draw(st.sampled_from([0, 1, 2]))
        if draw(st.integers(0, 9)) == 1:  # a copy of another sequence's prefix (decoded: copies are not refused)
            source, keep = draw(st.sampled_from([0, 1, 2])), draw(st.integers(0, 8))
            history.append((PassRecord.copy(source, sequence, keep), True))
            ends[sequence] = min(keep, ends[source])
            continue
        if draw(st.integers(0, 9)) == 0:
            history.append((PassRecord.release(sequence), True))
            ends[sequence] = 0
            continue
        keep = draw(st.integers(0, ends[sequence]))
        tokens = draw(st.lists(st.integers(0, 49151), min_size=1, max_size=6))
        decoded = draw(st.integers(0, 14)) > 0
        history.append((record(sequence, keep, tokens), decoded))
        ends[sequence] = keep + len(tokens) if decoded else keep
    settled = draw(st.integers(0, len(history)))
    return history, settled


@settings(max_examples=400, deadline=None)
@given(pass_histories(), st.integers(1, 5))
def test_replay_into_a_fresh_chain_rebuilds_exactly_what_the_stages_hold(history_and_settled, n_batch):
    """A stage that ran every settled pass, and a fresh stage that ran the
    rebuild, hold the same cells; then the unanswered passes, sent again to
    both, leave both where the uninterrupted stage would be."""
    history, settled = history_and_settled
    survivor, ledger = StageCache(), KvLedger()
    for pass_record, decoded in history[:settled]:
        if decoded:
            survivor.apply(pass_record)
        else:  # a refused pass: this stage dropped from keep on (it may or may not have decoded; take the worst)
            survivor.apply(PassRecord(pass_record.sequence, pass_record.keep, *[np.empty(0, np.int32)] * 3))
        ledger.settle(pass_record, decoded)
    fresh = StageCache()
    for pass_record in ledger.rebuild(n_batch):
        assert 1 <= len(pass_record.positions) <= n_batch
        fresh.apply(pass_record)
    assert fresh.cells == survivor.cells
    uninterrupted = StageCache()
    uninterrupted.cells = {sequence: dict(cells) for sequence, cells in survivor.cells.items()}
    for pass_record, _ in history[settled:]:
        fresh.apply(pass_record)
        uninterrupted.apply(pass_record)
    assert fresh.cells == uninterrupted.cells
