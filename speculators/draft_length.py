"""How many draft tokens the next pass should verify.

On a CPU, verifying k drafts costs a batch of k + 1 tokens (measured here by
benchmarks.batch_cost: 4 tokens cost 2.1x one, 8 cost 3.5x), so a long draft that is rejected early
wastes most of its pass. The rule: after a pass that accepted every draft,
allow twice as many next time; after a rejection, allow one more than were
accepted. Bounded by [1, maximum].
"""

from __future__ import annotations


def next_draft_limit(limit: int, drafted: int, accepted: int, maximum: int) -> int:
    if drafted == 0:
        return limit
    if accepted == drafted:
        return min(maximum, max(limit, drafted) * 2)
    return max(1, min(maximum, accepted + 1))
