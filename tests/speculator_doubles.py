"""Speculators that misbehave on purpose, for fault and rollback tests.

Ray pickles these by value (see test_speculation.py), so drafter actors need
not import this module."""

from __future__ import annotations

import time


class ScriptedSpeculator:
    """Drafts the known right continuation, except a wrong token at chosen absolute positions."""

    def __init__(self, truth: list[int], wrong_positions: set[int]):
        self.truth = truth
        self.wrong_positions = wrong_positions

    def extend(self, context):
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

    def extend(self, context):
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

    def extend(self, context):
        time.sleep(0.01)
        return super().extend(context)
