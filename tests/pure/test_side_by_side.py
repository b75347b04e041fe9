"""The repetition loop every probe shares (benchmarks.side_by_side): the order
rotates, every figure is kept per repetition, differing outputs stop the run."""

import pytest

from benchmarks.side_by_side import Outcome, side_by_side, spread


def test_each_repetition_starts_one_mode_later_and_keeps_every_figure():
    order = []

    def run(mode, repetition):
        order.append((repetition, mode))
        return Outcome({"seconds": repetition + (0.5 if mode == "b" else 0.0)}, output="same")

    samples = side_by_side(["a", "b", "c"], 4, run)
    assert [mode for _, mode in order] == list("abc" "bca" "cab" "abc")
    assert samples.of("b", "seconds") == [0.5, 1.5, 2.5, 3.5]  # in repetition order, whatever the turn
    assert samples.median("a", "seconds") == 1.5
    assert samples.spread("b", "seconds", scale=2, digits=1) == "4.0 (1.0-7.0)"
    assert samples.as_json()["a"]["seconds"] == {"median": 1.5, "min": 0, "max": 3, "values": [0, 1, 2, 3]}


def test_warm_up_runs_every_mode_once_before_the_repetitions():
    calls = []
    side_by_side(["a", "b"], 1, lambda mode, repetition: calls.append(mode) or Outcome({}),
                 warm_up=lambda mode: calls.append(f"warm {mode}"))
    assert calls == ["warm a", "warm b", "a", "b"]


def test_modes_whose_outputs_differ_stop_the_run_and_none_is_not_compared():
    outputs = {"a": [1, 2], "b": None, "c": [1, 3]}
    with pytest.raises(SystemExit, match="repetition 1: the modes produced different outputs"):
        side_by_side(["a", "b", "c"], 2, lambda mode, repetition: Outcome({}, outputs[mode]))
    agreeing = side_by_side(["a", "b"], 2, lambda mode, repetition: Outcome({"x": 1.0}, outputs["a"]))
    assert agreeing.repetitions == 2


def test_spread_is_the_median_and_the_range():
    assert spread([3.0, 1.0, 2.0]) == "2.00 (1.00-3.00)"
