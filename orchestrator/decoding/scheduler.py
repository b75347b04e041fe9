"""Many sequences' windows in flight through one target: the Scheduler
(which passes go, which sequences draft and on which machine, which passes
a rejection made worthless) and continuous batching (Batching). The rules
each sequence follows are orchestrator.decoding.schedule's; its tuning
constants are orchestrator.config's."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.config import (PAYING_SHARE, UNUSED_DRAFTS_PAUSE, UNUSED_DRAFTS_PROBE, UNUSED_DRAFTS_PROBE_MOST,
                                 UNUSED_DRAFTS_STRETCH)
from orchestrator.decoding.schedule import SequenceState
from orchestrator.decoding.windows import TargetPass, Window
from stages.cost_curve import BatchCurve



@dataclass(frozen=True)
class Batching:
    """Continuous batching: which windows ready at one turn share a pass.

    stage_count: the stages every pass goes through; step: what each extra
    token of a pass costs, in one-token passes (a pass of n tokens costs
    c(n) = 1 + step (n - 1)); curve: instead, the pass measured at several
    widths (c(n) = curve(n) / curve(1), linear between them): a memory-bound
    machine's pass is flat up to a width and then grows, which no line
    through two widths shows. Both measured by the target, so it is this
    machine's curve, or an emulated one's. n_batch: the most tokens of a pass.

    Only decoding chains of one width and consecutive KV sequences can share
    a pass (stages.engine: llama.cpp would split any other batch, and a
    non-last stage hands on one graph's rows); prompt chunks and trees go
    alone. For k such windows of width w, with p passes already in flight,
    the k windows go in the g passes (1 <= g <= k) that cost a stage least
    for them, max(g, S - p) c(ceil(k / g) w): fewer than S - p passes leave
    stages idle, and every pass costs each stage c of its tokens (``plan``).
    Ties go to more passes: on a linear curve (step 1, a compute-bound CPU)
    that is a pass per window, today's interleaving; on a flat one
    (memory-bound) the windows fill S passes. Where sharing a pass pays at
    all (two windows of one token cost less than two passes, by
    PAYING_SHARE), a decoding window ready while S passes are in flight
    waits (``holds``) for others to share its pass: the stages are busy
    anyway, and windows come back one pass at a time, so without waiting
    they would never meet.
    """

    stage_count: int
    step: float
    n_batch: int
    curve: BatchCurve | None = None

    def cost(self, tokens: int) -> float:
        if self.curve is not None:
            return self.curve.at(tokens) / self.curve.at(1)
        return 1.0 + self.step * (tokens - 1)

    def holds(self, in_flight: int) -> bool:
        """Decoding windows ready now wait for others (class docstring)."""
        return in_flight >= self.stage_count and self.cost(2) < PAYING_SHARE * 2 * self.cost(1)

    def plan(self, windows: int, width: int, in_flight: int) -> tuple[int, float]:
        """(how many passes k windows of one width go in, what those cost a
        stage in one-token passes): the class docstring's rule."""
        idle = max(1, self.stage_count - in_flight)
        fewest = max(1, -(-windows * width // self.n_batch))
        costs = ((count, max(count, idle) * self.cost(-(-windows // count) * width))
                 for count in range(fewest, windows + 1))
        return min(costs, key=lambda option: (option[1], -option[0]))

    def passes(self, windows: Iterable[Window], in_flight: int) -> list[TargetPass]:
        """The passes for windows ready at once, ``in_flight`` passes already out."""
        alone, by_width = [], {}
        for window in windows:
            if window.prompt or window.parents is not None:
                alone.append(TargetPass((window,)))
            else:
                by_width.setdefault(len(window.inputs), []).append(window)
        passes = []
        for width, group in by_width.items():
            group.sort(key=lambda window: window.sequence)
            count = self.plan(len(group), width, in_flight + len(passes) + len(alone))[0]
            size = -(-len(group) // count)
            for run in _consecutive_runs(group):
                passes.extend(TargetPass(tuple(run[start:start + size])) for start in range(0, len(run), size))
        return alone + passes


def _consecutive_runs(windows: list[Window]) -> list[list[Window]]:
    """Windows sorted by sequence, cut where the sequence ids are not consecutive."""
    runs: list[list[Window]] = []
    for window in windows:
        if runs and runs[-1][-1].sequence + 1 == window.sequence:
            runs[-1].append(window)
        else:
            runs.append([window])
    return runs


class Scheduler:
    """The passes in flight over several sequences, in submission order.

    The loop around it asks, in turn: which sequences must be drafted for
    first (``drafting_first``), which passes to submit now (``next_passes``:
    one with every ready sequence's first window, one with the windows started
    ahead; or, with ``window_per_pass``, a pass for each window), which
    sequences draft while the oldest pass runs (``drafting_during``, on the
    machine ``drafter_of`` names),
    and hands the oldest pass's result back (``received``). A long-lived loop
    (orchestrator.decoding.service) also ``add``s sequences as they arrive and
    ``remove``s them once settled.

    window_per_pass: a pass carries one window, so a pipeline's stages work on
    different sequences at once; batching: instead, the ready windows share
    passes where the rule of ``Batching`` finds it pays (windows started
    ahead still go a pass each).
    """

    def __init__(self, sequences: Iterable[SequenceState] = (), *, window_per_pass: bool = False,
                 batching: Batching | None = None):
        self.sequences = {state.sequence: state for state in sequences}
        self.in_flight: deque[TargetPass] = deque()
        self.window_per_pass = window_per_pass or batching is not None
        self.batching = batching
        self._invalid: list[TargetPass] = []  # passes in flight already handed out by invalid_passes
        self._unused = 0  # shared passes in a row that took no drafts (shared_drafts)
        self._paused = 0  # passes since drafting paused for that (drafting_during)

    def add(self, state: SequenceState) -> None:
        if state.sequence in self.sequences:
            raise ValueError(f"sequence {state.sequence} is already scheduled")
        self.sequences[state.sequence] = state

    def remove(self, sequence: int) -> SequenceState:
        """Forget a settled sequence (its id may then be reused)."""
        state = self.sequences[sequence]
        if not state.settled:
            raise ValueError(f"sequence {sequence} still has windows in flight")
        return self.sequences.pop(sequence)

    @property
    def done(self) -> bool:
        return not self.in_flight and all(state.finished for state in self.sequences.values())

    def drafting_first(self) -> list[SequenceState]:
        """Sequences whose drafts the loop waits for before the next passes
        (SequenceState.drafts_first); none while windows wait to share a pass,
        and, while several sequences share passes, no async one: each would
        wait for its drafter in turn while every other window waits too (its
        drafter drafts for it during its next pass instead)."""
        if self._holding():
            return []
        crowded = self.crowded
        return [state for state in self.sequences.values()
                if state.drafts_first and not (crowded and state.schedule.asynchronous)]

    def drafting_early(self) -> list[SequenceState]:
        """Sequences whose drafter beside stage 0 may start drafting for their
        next window now (SequenceState.drafts_early), while the loop waits
        for their discarded passes: only while one sequence decodes (several
        share their drafters' machines, and another's may be drafting on the
        one beside stage 0)."""
        unfinished = [state for state in self.sequences.values() if not state.finished]
        return [state for state in unfinished if len(unfinished) == 1 and state.drafts_early]

    def _holding(self) -> bool:
        return self.batching is not None and self.batching.holds(len(self.in_flight))

    def next_passes(self) -> list[TargetPass]:
        passes = []
        # while windows wait to share a pass (Batching.holds), only prompt chunks go
        holding = self._holding()
        ready = [state for state in self.sequences.values() if state.ready and not (holding and state.prompt_from is None)]
        most = self.shared_drafts(ready)
        self._count_unused(most)
        firsts = tuple(state.first_window(most) for state in ready)
        crowded = self.crowded
        # a branch window waits until stage 0 is done with a first window made now (the loop's _branch_while_waiting)
        fresh = {state.sequence for state in ready}
        aheads = [state.windows_ahead(speculative=not crowded and not (state.branching and state.sequence in fresh))
                  for state in self.sequences.values()]
        # the k-th window started ahead of each sequence in the k-th pass: a pass holds one window of a sequence
        rounds = [tuple(windows[k] for windows in aheads if len(windows) > k)
                  for k in range(max(map(len, aheads), default=0))]
        if self.batching is not None:
            passes.extend(self.batching.passes(firsts, len(self.in_flight)))
            firsts = ()
        for windows in (firsts, *rounds):
            if self.window_per_pass:
                passes.extend(TargetPass((window,)) for window in windows)
            elif windows:
                passes.append(TargetPass(windows))
        self.in_flight.extend(passes)
        return passes

    def submit_alone(self, window: Window) -> TargetPass:
        """A window made between turns (a branch window: SequenceState.branch_window) in a pass of its own."""
        self.in_flight.append(TargetPass((window,)))
        return self.in_flight[-1]

    def shared_drafts(self, ready: list[SequenceState]) -> int | None:
        """With batching, how many drafts every decoding chain ready now
        carries, so that they are one width and share passes (Batching:
        windows of different widths take a pass each): its speculation's,
        then filler (Window.filler) where it has fewer. Of 0 up to the most
        any has speculated, the number whose passes commit the most tokens
        (each chain's expected from its own drafts, by its policy's
        acceptances; filler counted as nothing) per cost of those passes on
        the measured curve (Batching.plan): where the requests already fill
        the flat part of a pass, drafts would make it cost more than they
        commit. None: each as its policy says (alone, or no batching)."""
        chains = [state for state in ready if state.prompt_from is None and state.tree_leaves == 1]
        if self.batching is None or len(chains) < 2:
            return None
        own = [min(len(state.speculation.tokens), max(state.room, 0)) if state.schedule.speculative else 0
               for state in chains]
        in_flight = len(self.in_flight)

        def rate(drafts: int) -> float:
            committed = sum(state.policy.expected_committed(min(drafts, mine)) for state, mine in zip(chains, own))
            return committed / self.batching.plan(len(chains), 1 + drafts, in_flight)[1]

        return max(range(max(own) + 1), key=lambda drafts: (rate(drafts), -drafts))

    @property
    def crowded(self) -> bool:
        """With batching, two or more sequences decode: their windows share passes."""
        return self.batching is not None and sum(not state.finished for state in self.sequences.values()) > 1

    @staticmethod
    def drafter_of(state: SequenceState, machines: int, crowded: bool) -> int:
        """The one machine whose drafter drafts for ``state`` for the whole of
        each of its passes: alone, the drafter beside stage 0, which drafted
        the window's drafts and holds them in its cache; while crowded, the
        sequences spread over the machines. No relay from machine to machine:
        each hand-over had the next drafter decode the text again before
        drafting on, and measured slower (docs/measurements.md, "One drafter
        for the whole pass")."""
        return state.sequence % machines if crowded else 0

    def drafting_during(self) -> list[SequenceState]:
        """Sequences whose drafter drafts while the oldest pass runs: async ones
        whose next window to verify is in it, unless the draft policy takes no
        drafts now (the drafter's round trips would cost every pass for nothing;
        drafting resumes when the policy asks again, before a window). While
        several sequences share passes: none once UNUSED_DRAFTS_PAUSE shared
        passes in a row took no drafts (the requests fill the flat part of a
        pass, or the drafters cannot keep up), but a few passes now and then
        (_probing), so drafting resumes once drafts are taken again."""
        oldest = self.in_flight[0]
        if self.crowded and self._unused >= UNUSED_DRAFTS_PAUSE and not self._probing():
            return []
        return [state for window in oldest.windows if (state := self.sequences[window.sequence]).schedule.asynchronous
                and state.is_head(window) and not state.finished and state.draft_limit > 0]

    def _count_unused(self, shared: int | None) -> None:
        """After a shared pass's choice (shared_drafts): a pass that took drafts
        resumes drafting; one that took none counts towards the pause, whether
        the drafts did not fit the pass or the drafters had none ready."""
        if shared is not None:
            self._unused = 0 if shared else self._unused + 1
        self._paused = self._paused + 1 if self._unused >= UNUSED_DRAFTS_PAUSE else 0

    def _probing(self) -> bool:
        """While drafting pauses (drafting_during), whether this pass drafts anyway:
        UNUSED_DRAFTS_STRETCH passes in a row (the drafters catch up on what
        was committed meanwhile, then draft), UNUSED_DRAFTS_PROBE passes into
        the pause, then after gaps that double up to UNUSED_DRAFTS_PROBE_MOST."""
        start, gap = UNUSED_DRAFTS_PROBE, UNUSED_DRAFTS_PROBE
        while start + UNUSED_DRAFTS_STRETCH <= self._paused:
            gap = min(2 * gap, UNUSED_DRAFTS_PROBE_MOST)
            start += gap
        return start <= self._paused

    def invalid_passes(self) -> list[TargetPass]:
        """Passes in flight not handed out before whose every window is invalid
        (computed on a speculation that failed, or of a cancelled sequence):
        the target may cancel them, as their results will be discarded."""
        found = []
        for target_pass in self.in_flight:
            if not any(target_pass is handed for handed in self._invalid) and not any(
                    any(held is window for held in self.sequences[window.sequence].in_flight)
                    for window in target_pass.windows):
                self._invalid.append(target_pass)
                found.append(target_pass)
        return found

    def received(self) -> list[tuple[SequenceState, Window, slice | None]]:
        """The oldest pass has come back: for each of its windows, its sequence
        and its rows of the result's logits (None: the window was invalid and
        its result is discarded, counted here)."""
        target_pass = self.in_flight.popleft()
        self._invalid = [handed for handed in self._invalid if handed is not target_pass]
        outcome: list[tuple[SequenceState, Window, slice | None]] = []
        row = 0
        for window in target_pass.windows:
            state = self.sequences[window.sequence]
            rows = slice(row, row + len(window.logit_rows))
            row = rows.stop
            if state.is_head(window):
                outcome.append((state, window, rows))
            else:
                state.discarded()
                outcome.append((state, window, None))
        return outcome
