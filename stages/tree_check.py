"""Whether this stage's token-tree rows are exact on this machine.

A tree's side row attends to ancestors whose cells lie apart in the cache
(the main chain's cells between them). With llama.cpp's CPU kernels on the
Intel AVX-512 hosts seen, attention over cells apart rounds as over cells
together, so every row's output is its path's decoded as a chain, bit for
bit; on AMD EPYC hosts (with AVX2 only, 2026-12-04 and 2026-12-07; with
AVX-512, 2026-12-08) a side row's logits were off by up to 0.3, and a token
chosen below a side branch could then differ from the whole model's.
Main-chain rows are exact either way.

``side_rows_exact`` asks the engine itself, once, before it serves: a small
tree after each committed prefix of 1 to ``PREFIXES`` cells, each side row
compared bit for bit with its path decoded as a chain; the cache is left
empty. Where the rounding differs, it differs only after some prefixes (on
one AVX2 host, 2026-12-07: after 12-22 % of the prefixes of 1 to 40 cells,
first after 4 to 16 of them, never after the 3 this check used to try), so
one shape proves nothing: the sweep finds such a machine at its first
differing prefix, and a machine whose sweep is exact has had every lane
offset of its vector width tried. It is a probe, not a proof. A stage that
answers False makes the coordinator draft chains instead of trees (the text
stays the whole model's). Inputs are made up (token ids, or random hidden
states for a later stage): exactness of the arithmetic does not depend on
them.
"""

from __future__ import annotations

import numpy as np

from stages.tree_shape import depths

PREFIXES = 32  # committed prefixes tried, 1..32 cells: every lane offset of 8-, 16- and 32-wide vectors
#   root - a - b            (main chain: rows 0..2)
#      \ x - y              (rows 3, 4: a side branch of two rows, apart from the root by a and b's cells)
PARENTS = np.array([-1, 0, 1, 0, 3], np.int32)
PATHS = {3: [0, 3], 4: [0, 3, 4]}  # each side row's path from the root


def side_rows_exact(engine) -> bool:
    """True when, after every prefix of 1 to PREFIXES cells, every side row of
    a small tree computes bit for bit what its path computes as a chain, in
    this engine (a stage.engine.StageEngine set up for trees, its cache
    empty); the cache is empty again afterwards."""
    prefix_inputs = _inputs(engine, PREFIXES, seed=7)
    tree_inputs = _inputs(engine, len(PARENTS), seed=8)
    try:
        engine.decode(np.zeros(1, np.int32), **_rows(prefix_inputs, [0]))
        for prefix in range(1, PREFIXES + 1):
            if not _tree_rows_exact(engine, prefix, tree_inputs):
                return False
            if prefix < PREFIXES:  # the next prefix: one more committed cell
                engine.remove(prefix)
                engine.decode(np.array([prefix], np.int32), **_rows(prefix_inputs, [prefix]))
        return True
    finally:
        engine.remove(0)


def _tree_rows_exact(engine, prefix: int, inputs: np.ndarray) -> bool:
    """The tree after ``prefix`` committed cells: each side row equal to its path as a chain."""
    tree = engine.decode((prefix + depths(PARENTS)).astype(np.int32), **_rows(inputs, range(len(PARENTS))),
                         logit_rows=np.arange(len(PARENTS), dtype=np.int32), parents=PARENTS)
    for row, path in PATHS.items():
        engine.remove(prefix)
        chain = engine.decode(np.arange(prefix, prefix + len(path), dtype=np.int32), **_rows(inputs, path),
                              logit_rows=np.arange(len(path), dtype=np.int32))
        if not np.array_equal(tree[row], chain[-1]):
            return False
    return True


def _inputs(engine, count: int, seed: int) -> np.ndarray:
    """One made-up input per row: token ids for a first stage, hidden states after it."""
    rng = np.random.default_rng(seed)
    if engine.is_first:
        return rng.integers(1, engine.n_vocab, size=count).astype(np.int32)
    return rng.standard_normal((count, engine.n_embd)).astype(np.float32)


def _rows(inputs: np.ndarray, rows) -> dict:
    chosen = inputs[list(rows)]
    return {"tokens": chosen} if chosen.ndim == 1 else {"hidden": np.ascontiguousarray(chosen)}
