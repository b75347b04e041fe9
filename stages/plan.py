"""Where to cut a model into stages: a pure function of per-block costs.

A plan is the list of first blocks of each stage (``starts``; stage i holds the
half-open block range [starts[i], starts[i+1]), the last stage ends at the
block count). The default balances bytes: a stage's cost is the bytes of its
blocks, and the plan minimises the largest stage cost over the allowed
boundaries.

The output head is deliberately not counted. On the CPU backend its cost per
byte is far below a block's (SmolLM2: the 30 MB Q8_0 head costs ~1.0 ms, the
33 MB of 15 Q4_1 blocks ~2.9 ms, measured on these machines); counting
it by bytes split SmolLM2 22 + 8 blocks and left the last of three stages a
single block. For the large models this project targets the head is ~1 %
of the bytes, so leaving it out changes nothing there. Tune with --boundaries.
"""

from __future__ import annotations

from collections.abc import Callable


def stage_ranges(starts: list[int], block_count: int) -> list[tuple[int, int]]:
    """[(first, end), ...] half-open block ranges from stage starts."""
    ends = starts[1:] + [block_count]
    return list(zip(starts, ends))


def balanced_starts(block_costs: list[int], stage_count: int, allowed: list[int], *,
                    speeds: list[float] | None = None, fits: Callable[[int, int, int], bool] | None = None) -> list[int]:
    """Stage starts minimising the slowest stage.

    block_costs: bytes of each block, in order.
    allowed: the boundaries that split exactly (see layer_rules).
    speeds: stage i's node reads speeds[i] bytes per unit of time (None: all alike).
    fits(stage, first, end): whether blocks [first, end) fit stage's node (None: any).
    Raises ValueError when fewer than stage_count - 1 boundaries are allowed
    or when no split fits.
    """
    block_count = len(block_costs)
    if stage_count < 1:
        raise ValueError("at least one stage is needed")
    speeds = speeds or [1.0] * stage_count
    fits = fits or (lambda stage, first, end: True)
    if stage_count == 1:
        if not fits(0, 0, block_count):
            raise ValueError("the model does not fit its one node")
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
    # best[k][j]: least max time covering blocks [0, points[j]) with k stages;
    # choice[k][j]: the point where the k-th of those stages starts.
    best = [[infinity] * len(points) for _ in range(stage_count + 1)]
    choice = [[-1] * len(points) for _ in range(stage_count + 1)]
    for j in range(1, len(points)):
        if fits(0, 0, points[j]):
            best[1][j] = prefix[points[j]] / speeds[0]
    for k in range(2, stage_count + 1):
        for j in range(k, len(points)):
            for i in range(k - 1, j):  # the k-th stage covers [points[i], points[j])
                if best[k - 1][i] == infinity or not fits(k - 1, points[i], points[j]):
                    continue
                cost = max(best[k - 1][i], (prefix[points[j]] - prefix[points[i]]) / speeds[k - 1])
                if cost < best[k][j]:
                    best[k][j], choice[k][j] = cost, i
    if best[stage_count][len(points) - 1] == infinity:
        raise ValueError(f"no split into {stage_count} stages fits their nodes")
    # Walk back from the end point, collecting where each stage starts.
    starts: list[int] = []
    j = len(points) - 1
    for k in range(stage_count, 1, -1):
        j = choice[k][j]
        starts.append(points[j])
    return [0] + sorted(starts)
