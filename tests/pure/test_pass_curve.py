"""Pipeline.pass_curve and speculation_costs: which passes a run times at
its start, without Ray (a pipeline whose forward only advances a clock)."""

from __future__ import annotations

import pytest

from orchestrator.cluster import pipeline as pipeline_module
from orchestrator.cluster.pipeline import Pipeline
from orchestrator.config import PASS_CURVE_SIZES, TREE_CURVE_SIZES


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_pipeline(monkeypatch, seconds_at) -> tuple[Pipeline, list[int], list[int]]:
    """A Pipeline whose passes take seconds_at(width) on a fake clock; the
    widths it was sent, and the sequences it released."""
    clock, widths, released = Clock(), [], []
    monkeypatch.setattr(pipeline_module.time, "perf_counter", clock)
    made = object.__new__(Pipeline)
    made.n_batch = 512

    def forward(positions, tokens, keep, sequence=0):
        widths.append(len(tokens))
        clock.now += seconds_at(len(tokens))

    made.forward, made.release = forward, released.append
    return made, widths, released


def test_each_width_is_timed_after_one_warm_up_and_the_median_kept(monkeypatch):
    made, widths, released = timed_pipeline(monkeypatch, lambda width: 0.01 * width)
    curve = made.pass_curve(repetitions=2, sequence=3)
    assert widths == [1] + [width for width in PASS_CURVE_SIZES for _ in range(2)]
    assert curve.sizes == PASS_CURVE_SIZES and curve.seconds == pytest.approx([0.01 * w for w in PASS_CURVE_SIZES])
    assert released == [3]


def test_a_tree_run_times_no_width_past_the_first_that_no_tree_grows_to(monkeypatch):
    """Compute-bound (each token dear): the widths stop at 16, the first past
    8 dearer than two one-token passes; the step still reads 1 and 8."""
    made, widths, _ = timed_pipeline(monkeypatch, lambda width: 0.1 + 0.05 * width)
    one, step, curve = made.speculation_costs(trees=True)
    assert curve.sizes == (1, 2, 4, 8, 16) and max(widths) == 16
    assert one == pytest.approx(0.15) and step == pytest.approx((0.5 / 0.15 - 1) / 7)


def test_a_flat_curve_is_timed_at_every_width_a_tree_may_take(monkeypatch):
    made, widths, _ = timed_pipeline(monkeypatch, lambda width: 1.0)
    assert made.speculation_costs(trees=True)[2].sizes == TREE_CURVE_SIZES
