"""Where to cut a model into stages: a pure function of per-block costs.

A plan is the list of first blocks of each stage (``starts``; stage i holds the
half-open block range [starts[i], starts[i+1]), the last stage ends at the
block count). The default balances bytes: a stage's cost is the bytes of its
blocks, and the plan minimises the largest stage cost over the allowed
boundaries.

The output head is deliberately not counted. On the CPU backend its cost per
byte is far below a block's (SmolLM2: the 30 MB Q8_0 head costs ~1.0 ms, the
33 MB of 15 Q4_1 blocks ~2.9 ms, per shared/design/stage-split.md); counting
it by bytes split SmolLM2 22 + 8 blocks and left the last of three stages a
single block. For the large models this project targets the head is ~1 %
of the bytes, so leaving it out changes nothing there. Tune with --boundaries.
"""

from __future__ import annotations


def stage_ranges(starts: list[int], block_count: int) -> list[tuple[int, int]]:
    """[(first, end), ...] half-open block ranges from stage starts."""
    ends = starts[1:] + [block_count]
    return list(zip(starts, ends))


def balanced_starts(block_costs: list[int], stage_count: int, allowed: list[int]) -> list[int]:
    """Stage starts minimising the most expensive stage.

    block_costs: bytes of each block, in order.
    allowed: the boundaries that split exactly (see layer_rules).
    Raises ValueError when fewer than stage_count - 1 boundaries are allowed.
    """
    block_count = len(block_costs)
    if stage_count < 1:
        raise ValueError("at least one stage is needed")
    if stage_count == 1:
        return [0]
    candidates = sorted(set(allowed) & set(range(1, block_count)))
    if len(candidates) < stage_count - 1:
        raise ValueError(
            f"{stage_count} stages need {stage_count - 1} boundaries, but only "
            f"{len(candidates)} exact boundaries exist: {candidates}"
        )
    prefix = [0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)

    points = [0] + candidates + [block_count]  # possible stage starts, then the end
    infinity = float("inf")
    # best[k][j]: least max cost covering blocks [0, points[j]) with k stages;
    # choice[k][j]: the point where the k-th of those stages starts.
    best = [[infinity] * len(points) for _ in range(stage_count + 1)]
    choice = [[-1] * len(points) for _ in range(stage_count + 1)]
    for j in range(1, len(points)):
        best[1][j] = prefix[points[j]]
    for k in range(2, stage_count + 1):
        for j in range(k, len(points)):
            for i in range(k - 1, j):  # the k-th stage covers [points[i], points[j])
                cost = max(best[k - 1][i], prefix[points[j]] - prefix[points[i]])
                if cost < best[k][j]:
                    best[k][j], choice[k][j] = cost, i
    # Walk back from the end point, collecting where each stage starts.
    starts: list[int] = []
    j = len(points) - 1
    for k in range(stage_count, 1, -1):
        j = choice[k][j]
        starts.append(points[j])
    return [0] + sorted(starts)
