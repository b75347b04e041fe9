"""Where the time goes: a stage's recent busy fraction (BusyWindow), a
generation's busy fractions and discarded shares as the loop accounts them,
and the bench's timeline (benchmarks.timeline)."""

from __future__ import annotations

import pytest

from benchmarks import timeline
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import Generation, PassTimes, generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.targets import InstantTarget, InPlaceDrafter
from orchestrator.transport.messages import PassResult
from orchestrator.workers.busy import BusyWindow
from speculators.corrections import Forks
from speculators.sampling import SamplingSettings


def test_the_busy_fraction_counts_the_passes_of_the_last_window_and_the_part_of_one_begun_before_it():
    window = BusyWindow(seconds=10.0)
    window.add(ended=5.0, seconds=1.0)  # entirely before the window that ends at 20
    window.add(ended=11.0, seconds=2.0)  # began at 9: one second of it falls in [10, 20]
    window.add(ended=19.0, seconds=3.0)
    assert window.fraction(20.0) == pytest.approx(0.4)
    assert window.fraction(40.0) == 0.0  # idle since
    window.add(ended=41.0, seconds=30.0)  # longer than the window: all of it busy
    assert window.fraction(41.0) == 1.0


class _TimedTarget(InstantTarget):
    """An InstantTarget whose stages report 0.5 and 0.25 s a pass, begun at 100 and 101."""

    def receive(self) -> PassResult:
        return PassResult(0, self.pending.popleft(), (0.5, 0.25), stage_started=(100.0, 101.0))


class _OftenWrong(InPlaceDrafter):
    """Drafts the target's choice (0) except at every fifth position (3):
    some windows accept all their drafts and the window started ahead of
    the next one is discarded when that one rejects."""

    draft_max = 2

    def draft(self, context: list[int], limit: int) -> list[int]:
        return [3 if (len(context) + index) % 5 == 0 else 0 for index in range(limit)]


def test_a_generation_counts_each_stages_busy_seconds_and_those_on_discarded_passes():
    """Async starts windows ahead after windows that accepted all their
    drafts, and those ahead of a rejection are discarded; those passes are
    counted apart, and every pass is in the timeline."""
    target = _TimedTarget(vocab=8, stage_count=2)
    drafting = Drafting([_OftenWrong(), _OftenWrong()], Schedule.ASYNC, 2, call_cost=0.0, step=0.0)
    result = generate(target, [1, 2], 12, SamplingSettings(), lambda token: False, drafting=drafting)
    assert result.tokens == [0] * 12
    passes = len(target.submitted)
    discarded = result.speculation.discarded_passes
    assert discarded > 0 and len(result.timeline) == passes
    assert result.stage_seconds == pytest.approx([0.5 * passes, 0.25 * passes])
    assert result.discarded_seconds == pytest.approx([0.5 * discarded, 0.25 * discarded])
    assert result.discarded_shares == pytest.approx([discarded / passes] * 2)
    assert sum(times.discarded for times in result.timeline) == discarded
    assert result.timeline[0].stage_started == (100.0, 101.0)


def test_busy_fractions_are_busy_seconds_over_the_wall_time():
    generation = Generation([1], decode_seconds=2.0)
    generation.account(PassTimes((0.5, 1.0)))
    generation.account(PassTimes((0.5, 0.0), discarded=True))
    assert generation.busy_fractions == [0.5, 0.5]
    assert generation.discarded_shares == [0.5, 0.0]


class _Client:
    busy_seconds = 0.0


class _ActorDrafter:
    """A drafter behind an actor: its client reports the seconds drafted so far."""

    def __init__(self):
        self.client = _Client()

    def speculate(self, context, most=None, sampling=None, tree=None, forks=None):
        self.forks = forks

    def ask(self):
        pass

    def collect(self, wait=False):
        self.client.busy_seconds += 0.125
        return [4]

    def peek(self):
        return [4]

    def corrections(self):
        return {(3, 9): [9, 5]}


def test_a_timed_drafter_notes_the_drafting_seconds_its_actor_reports_from_the_speculate():
    drafting, times = timeline.timed(Drafting([_ActorDrafter()], Schedule.ASYNC, 2))
    drafter = drafting.drafters[0]
    drafter.speculate([1, 2], 2)
    assert drafter.collect() == [4]
    assert drafter.collect() == [4]  # no speculate before it: nothing drafted for it is noted
    [(machine, start, seconds)] = times.intervals
    assert machine == 0 and seconds == pytest.approx(0.125) and start > 0


def test_a_timed_drafter_of_corrections_passes_their_forks_on_and_hands_them_back():
    """The bench times a draft model's drafters that draft corrections in
    async (Drafting.corrects): the loop gives them forks, peeks and asks for
    the corrections, through the timed drafter as through the drafter."""
    inner = _ActorDrafter()
    drafting, _ = timeline.timed(Drafting([inner], Schedule.ASYNC, 2))
    drafter = drafting.drafters[0]
    forks = Forks(3, 2, 4.0)
    drafter.speculate([1, 2, 3], 2, forks=forks)
    assert inner.forks is forks
    assert drafter.peek() == [4] and drafter.collect() == [4]
    assert drafter.corrections() == {(3, 9): [9, 5]}


def test_an_async_generation_with_corrections_runs_through_timed_drafters():
    inner = _ActorDrafter()
    drafting, times = timeline.timed(Drafting([inner], Schedule.ASYNC, 2, corrects=True))
    generation = generate(InstantTarget(16), [1, 2, 3], 6, SamplingSettings(), lambda token: False, drafting=drafting)
    assert len(generation.tokens) == 6 and isinstance(inner.forks, Forks) and times.intervals


def test_the_timeline_is_recorded_from_the_stages_start_times_and_drawn(tmp_path):
    generation = Generation([1], decode_seconds=1.0)
    generation.account(PassTimes((0.25, 0.25), (10.0, 10.25)))
    generation.account(PassTimes((0.25, 0.0), (10.5, 10.75), discarded=True))
    drafts = timeline.DraftTimes([(1, 10.0, 0.2), (-1, 10.6, 0.01)])
    recorded = timeline.record(generation, 10.0, drafts)
    assert recorded == {"seconds": 1.0, "passes": [[0, 0.0, 0.25, False], [1, 0.25, 0.25, False], [0, 0.5, 0.25, True]],
                        "drafting": [[1, 0.0, 0.2], [-1, 0.6, 0.01]]}
    assert timeline.record(Generation([1]), 10.0, drafts) is None  # no pass timed: nothing to draw
    results = {"scenarios": [{"scenario": "chat", "stages": 2, "modes": [
        {"mode": "spec-async-model", "tokens_per_second": {"median": 9.0}, "timeline": recorded},
        {"mode": "whole", "tokens_per_second": {"median": 5.0}, "timeline": None}]}]}
    timeline.draw(results, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
