"""Token trees through real stages (llama.cpp, no Ray): every row's logits are
those of its own path decoded as a chain, and after a tree the cache keeps
only the main chain's prefix, hole-free, so later passes stay bit-identical."""

import numpy as np
import pytest

from stages.engine import StageEngine, StageError
from stages.settings import StageSettings
from stages.tree_check import side_rows_exact
from stages.tree_shape import depths, main_chain_length


#   root - a - b - c           (main chain: rows 0..3)
#          \ z                 (row 4, forks at a)
#   root - x - y               (rows 5, 6, fork at the root)
TOKENS = [None, 11, 22, 33, 66, 44, 55]
PARENTS = [-1, 0, 1, 2, 1, 0, 5]


def _intel_avx512() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        text = cpuinfo.read()
    return "GenuineIntel" in text and " avx512f" in text


# A side row's ancestors' cells lie apart in the cache (the main chain's
# rows between them). On the Intel AVX-512 hosts this was built on, attention
# over cells apart rounded as over cells together; on AMD EPYC hosts it did
# not: a side row's logits were off by up to 0.3 from its path's (README's
# limits), with AVX2 and no AVX-512 (2026-12-04; 2026-12-07, after some
# prefixes only) and with AVX-512 (2026-12-08).
# Observed, not explained, so the stages check it on their own machine
# (stages.tree_check.side_rows_exact) and these tests hold that check to it;
# where it was always exact, they also require it to say so.
EXACT_HERE = _intel_avx512()


def _assert_row_logits(tree_row, path_row, *, side: bool, exact: bool, row: int) -> None:
    """A main-chain row's logits are its path's bit for bit on every CPU; a
    side row's too where the stages' own check found them exact, else within
    1.0 and with the same argmax (what a near-tie could still flip)."""
    if not side or exact:
        assert np.array_equal(tree_row, path_row), f"row {row}"
    else:
        assert np.abs(tree_row - path_row).max() < 1.0, f"row {row}"
        assert np.argmax(tree_row) == np.argmax(path_row), f"row {row}"


def _through(engines, positions, tokens, parents=None):
    rows = np.arange(len(tokens), dtype=np.int32)
    parents = None if parents is None else np.array(parents, np.int32)
    hidden = None
    for engine in engines:
        if engine.is_first:
            hidden = engine.decode(positions, tokens=np.array(tokens, np.int32), logit_rows=rows, parents=parents)
        else:
            hidden = engine.decode(positions, hidden=hidden, logit_rows=rows, parents=parents)
    return hidden


def _chain(engines, first, tokens):
    for engine in engines:
        engine.remove(first)
    return _through(engines, np.arange(first, first + len(tokens), dtype=np.int32), tokens)


def _path(row):
    path = []
    while row >= 0:
        path.append(row)
        row = PARENTS[row]
    return path[::-1]


@pytest.mark.parametrize("stage_count", [1, 2])
def test_tree_rows_equal_their_paths_and_the_cache_keeps_the_main_chain(smollm2, splits, reference, stage_count):
    paths = [smollm2] if stage_count == 1 else splits[2]
    trees = [StageEngine(path, StageSettings(n_ctx=512, tree_sequences=4)) for path in paths]
    chains = [StageEngine(path, StageSettings(n_ctx=512)) for path in paths]
    try:
        exact = all(side_rows_exact(engine) for engine in trees)  # what run and serve would be told
        assert exact or not EXACT_HERE  # exact on every Intel AVX-512 host seen
        prompt = reference.tokenize("The capital of France is Paris. The capital of Germany is")
        tokens = [prompt[-1], *TOKENS[1:]]
        first = len(prompt) - 1
        for engines in (trees, chains):
            _chain(engines, 0, prompt[:-1])
        tree_logits = _through(trees, (first + depths(PARENTS)).astype(np.int32), tokens, PARENTS)
        for row in range(len(PARENTS)):
            path_logits = _chain(chains, first, [tokens[step] for step in _path(row)])
            _assert_row_logits(tree_logits[row], path_logits[-1], side=row >= main_chain_length(PARENTS), exact=exact,
                              row=row)
        # keep the main chain up to b (the next pass's keep drops every side branch)
        for engines in (trees, chains):
            for engine in engines:
                engine.remove(first + 3)
        _chain(chains, first, tokens[:3])
        assert [engine.cached_positions() for engine in trees] == [first + 3] * len(trees)
        assert [engine.cells_held() for engine in trees] == [first + 3] * len(trees)
        # the next passes, a chain and another tree, equal the plain engine's
        later = [int(np.argmax(tree_logits[2])), 7, 8]
        assert np.array_equal(_chain(trees, first + 3, later), _chain(chains, first + 3, later))
        again = _through(trees, (first + 6 + depths([-1, 0, 0])).astype(np.int32), [9, 10, 12], [-1, 0, 0])
        _assert_row_logits(again[2], _chain(chains, first + 6, [9, 12])[-1], side=True, exact=exact, row=2)
    finally:
        for engine in trees + chains:
            engine.close()


def test_tree_batches_are_checked(smollm2):
    engine = StageEngine(smollm2, StageSettings(n_ctx=64, tree_sequences=1))
    plain = StageEngine(smollm2, StageSettings(n_ctx=64))
    try:
        positions = np.array([0, 1, 1], np.int32)
        tokens = np.array([1, 2, 3], np.int32)
        with pytest.raises(StageError, match="not set up for token trees"):
            plain.decode(positions, tokens=tokens, parents=np.array([-1, 0, 0], np.int32))
        with pytest.raises(StageError, match="not preorder"):
            engine.decode(np.array([0, 1, 1, 2], np.int32), tokens=np.array([1, 2, 3, 4], np.int32),
                          parents=np.array([-1, 0, 0, 1], np.int32))
        with pytest.raises(StageError, match="depth"):
            engine.decode(np.array([0, 1, 2], np.int32), tokens=tokens, parents=np.array([-1, 0, 0], np.int32))
        with pytest.raises(StageError, match="3 leaves"):
            engine.decode(np.array([0, 1, 1, 1], np.int32), tokens=np.array([1, 2, 3, 4], np.int32),
                          parents=np.array([-1, 0, 0, 0], np.int32))
        with pytest.raises(StageError, match="one sequence"):
            StageEngine(smollm2, StageSettings(n_ctx=64, sequences=2, tree_sequences=1))
    finally:
        engine.close()
        plain.close()


@pytest.mark.parametrize("tree_sequences", [1, 4])
def test_each_stage_tells_whether_its_side_rows_are_exact_on_this_machine(splits, tree_sequences):
    """stages.tree_check.side_rows_exact on each stage of a split: exact on
    an Intel AVX-512 host (elsewhere the row-by-row test above holds the answer
    to its rows); the cache is left empty. A side row's output one ulp off
    is seen (a planted difference)."""
    for path in splits[2]:
        engine = StageEngine(path, StageSettings(n_ctx=64, tree_sequences=tree_sequences))
        try:
            assert side_rows_exact(engine) or not EXACT_HERE  # elsewhere the test above holds its answer to its rows
            assert engine.cached_positions() == 0
            decode = engine.decode

            def off_by_an_ulp(positions, parents=None, **inputs):
                rows = decode(positions, parents=parents, **inputs)
                if parents is not None:  # the side rows (after the main chain) one ulp off
                    side = slice(main_chain_length(parents), None)
                    rows[side] = np.nextafter(rows[side], np.inf)
                return rows

            engine.decode = off_by_an_ulp
            assert side_rows_exact(engine) is False
            assert engine.cached_positions() == 0  # emptied after the first difference too
        finally:
            engine.close()
