"""Whether this stage's token-tree rows are exact on this machine.

A tree's side row attends to ancestors whose cells lie apart in the cache
(the main chain's cells between them). With llama.cpp's CPU kernels on
AVX-512 hosts attention over cells apart rounds as over cells together, so
every row's output is its path's decoded as a chain, bit for bit; on an
AVX2 host without AVX-512 (2026-12-04) a side row's logits were off by up to
0.3, and a token chosen below a side branch could then differ from the whole
model's. Main-chain rows are exact either way.

``side_rows_exact`` asks the engine itself, once, before it serves: a short
prefix, then a small tree, then each side row's path as a chain, every
output compared bit for bit; the cache is left empty. A stage that answers
False makes the coordinator draft chains instead of trees (the text stays
the whole model's). Inputs are made up (token ids, or random hidden states
for a later stage): exactness of the arithmetic does not depend on them.
"""

from __future__ import annotations

import numpy as np

from stages.tree_shape import depths

PREFIX = 3  # committed positions before the tree's root
#   root - a - b            (main chain: rows 0..2)
#      \ x - y              (rows 3, 4: a side branch of two rows, apart from the root by a and b's cells)
PARENTS = np.array([-1, 0, 1, 0, 3], np.int32)
PATHS = {3: [0, 3], 4: [0, 3, 4]}  # each side row's path from the root


def side_rows_exact(engine) -> bool:
    """True when every side row of a small tree computes bit for bit what its
    path computes as a chain, in this engine (a stage.engine.StageEngine set up
    for trees, its cache empty); the cache is empty again afterwards."""
    inputs = _inputs(engine, PREFIX + len(PARENTS))
    try:
        engine.decode(np.arange(PREFIX, dtype=np.int32), **_rows(inputs, range(PREFIX)))
        positions = (PREFIX + depths(PARENTS)).astype(np.int32)
        tree = engine.decode(positions, **_rows(inputs, PREFIX + np.arange(len(PARENTS))),
                             logit_rows=np.arange(len(PARENTS), dtype=np.int32), parents=PARENTS)
        for row, path in PATHS.items():
            engine.remove(PREFIX)
            chain = engine.decode(np.arange(PREFIX, PREFIX + len(path), dtype=np.int32),
                                  **_rows(inputs, [PREFIX + node for node in path]),
                                  logit_rows=np.arange(len(path), dtype=np.int32))
            if not np.array_equal(tree[row], chain[-1]):
                return False
        return True
    finally:
        engine.remove(0)


def _inputs(engine, count: int) -> np.ndarray:
    """One made-up input per row: token ids for a first stage, hidden states after it."""
    rng = np.random.default_rng(7)
    if engine.is_first:
        return rng.integers(1, engine.n_vocab, size=count).astype(np.int32)
    return rng.standard_normal((count, engine.n_embd)).astype(np.float32)


def _rows(inputs: np.ndarray, rows) -> dict:
    chosen = inputs[list(rows)]
    return {"tokens": chosen} if chosen.ndim == 1 else {"hidden": np.ascontiguousarray(chosen)}

