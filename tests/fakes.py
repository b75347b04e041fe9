"""Every test double, in one place.

* Speculators that misbehave on purpose, for fault and rollback tests (Ray
  pickles them by value, see test_speculation.py, so drafter actors need not
  import this module).
* Drafters for the decoding loop without a drafter process: ``TraceDrafter``
  (replays a planner trace); a speculator called in this process is
  ``orchestrator.decoding.targets.InstantDrafter`` (the service drafts with it).
* Targets without Ray: ``orchestrator.decoding.targets.InstantTarget`` (shared with
  ``orchestrate profile``, re-exported here) and ``truth_target``; the real
  stage engines one after another in this process are product code
  (``orchestrator.in_process.InProcessPipeline``, which the device check runs on).
"""

from __future__ import annotations

import time

from orchestrator.decoding.targets import InPlaceDrafter, InstantTarget
from orchestrator.planning.simulation import DraftTrace


class ScriptedSpeculator:
    """Drafts the known right continuation, except a wrong token at chosen absolute positions."""

    def __init__(self, truth: list[int], wrong_positions: set[int]):
        self.truth = truth
        self.wrong_positions = wrong_positions

    def extend(self, context, sampling=None):
        position = len(context)
        if position >= len(self.truth):
            return None
        token = self.truth[position]
        return token + 1 if position in self.wrong_positions else token


class FailingSpeculator(ScriptedSpeculator):
    """Right for good_calls tokens, then fails on every call (see fail())."""

    def __init__(self, truth: list[int], good_calls: int):
        super().__init__(truth, set())
        self.calls = 0
        self.good_calls = good_calls

    def extend(self, context, sampling=None):
        self.calls += 1
        if self.calls > self.good_calls:
            self.fail()
        return super().extend(context)

    def fail(self) -> None:
        raise NotImplementedError


class RaisingSpeculator(FailingSpeculator):
    def fail(self) -> None:
        raise RuntimeError("drafter exploded on purpose")


class HangingSpeculator(FailingSpeculator):
    def fail(self) -> None:
        time.sleep(3600)


class SlowSpeculator(ScriptedSpeculator):
    """Right, but slow: a drafter that can be killed mid-generation."""

    def extend(self, context, sampling=None):
        time.sleep(0.01)
        return super().extend(context)


def truth_target(truths: list[list[int]]) -> InstantTarget:
    """A target that answers at once: row r of a window of sequence s at position p
    predicts truths[s][p + r + 1]."""
    vocab = 1 + max(max(truth) for truth in truths)
    return InstantTarget(vocab, lambda sequence, position: truths[sequence][position], stage_count=2)


class TraceDrafter(InPlaceDrafter):
    """Proposes what a planner trace (DraftTrace) says: the right token, a wrong
    one (WRONG), or nothing; after a wrong token, only wrong ones."""

    WRONG = 1

    def __init__(self, truth: list[int], prompt_length: int, trace: DraftTrace, draft_max: int):
        self.truth, self.prompt_length, self.trace, self.draft_max = truth, prompt_length, trace, draft_max

    def draft(self, context: list[int], limit: int) -> list[int]:
        right = context == self.truth[: len(context)]
        tokens: list[int] = []
        while len(tokens) < limit:
            position = len(context) + len(tokens) - self.prompt_length  # generated position
            proposal = False if not right else (self.trace.proposals[position] if position < self.trace.end else None)
            if proposal is None:
                break
            right = right and proposal
            tokens.append(self.truth[self.prompt_length + position] if proposal else self.WRONG)
        return tokens


class TraceLookup:
    """Prompt lookup as a trace (with forks) records it, over the real tokens
    of ``truth``: for speculators.tree.lookup_tree, as the simulation's own."""

    WRONG_OTHERS = 100_000  # other wrong candidates: ids no text holds

    def __init__(self, truth: list[int], prompt_length: int, trace: DraftTrace):
        self.truth, self.prompt_length, self.trace = truth, prompt_length, trace

    def _on_truth(self, context: list[int]) -> bool:
        return context == self.truth[: len(context)]

    def extend(self, context: list[int], sampling=None) -> int | None:
        if not self._on_truth(context):
            return TraceDrafter.WRONG
        position = len(context) - self.prompt_length
        proposal = self.trace.proposals[position] if position < self.trace.end else None
        return None if proposal is None else self.truth[len(context)] if proposal else TraceDrafter.WRONG

    def candidates(self, context: list[int]) -> list[int]:
        main = self.extend(context)
        if main is None or not self._on_truth(context):
            return [] if main is None else [main]
        position = len(context) - self.prompt_length
        count, right = self.trace.forks[position] if position < len(self.trace.forks) else (0, 0)
        return [main, *(self.truth[len(context)] if rank == right else self.WRONG_OTHERS + rank
                        for rank in range(1, count + 1))]


class TraceTreeDrafter(TraceDrafter):
    """A TraceDrafter that also drafts token trees from the trace's forks (InstantDrafter.collect_tree)."""

    def collect_tree(self, leaves: int):
        from speculators.tree import lookup_tree

        context, self.context = self.context, None
        limit = min(self.draft_max, self.most or self.draft_max)
        return lookup_tree(TraceLookup(self.truth, self.prompt_length, self.trace), context, limit, 2 * limit,
                           leaves - 1)


def flat_round_draft(path: str, **settings):
    """A draft model (speculators.model.ModelSpeculator on ``path``) whose
    correction rounds are taken as timed at one step at every width, as on a
    memory-bound machine: its corrections join the chain's rounds at once
    (speculators.corrections), where this CPU's own timings would keep them
    for the drafter's spare time. What it drafts is the real draft's."""
    from speculators.corrections import ROUND_WIDTHS
    from speculators.model import ModelSpeculator

    speculator = ModelSpeculator(path, **settings)
    speculator.round_seconds = {width: 1.0 for width in ROUND_WIDTHS}
    return speculator
