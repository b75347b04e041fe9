"""Drafting for the likely rejections while a window is verified: corrections.

While the target verifies a window [c, d1 .. dk], the drafter that drafted
d1 .. dk drafts on after dk (the speculation, for the case that every
draft is accepted) and, in the same draft passes, a *correction* at each
draft position p: one of the draft's runners-up there (its next best
tokens after d_p, kept when it drafted d_p: ModelSpeculator.runners_up)
and the draft's own continuation after it. Where the target rejects d_p
and its own token is that runner-up, the correction's continuation is the
next window's drafts at once (orchestrator.decoding.schedule:
SequenceState.verified), instead of the window waiting for the drafter to
draft from the new text.

Each round decodes one token of the main chain and one of every correction
in one draft pass (a KV id per correction, forked from the main chain's
cells below its position, as token trees grow: speculators.model_tree). A
round carries only the corrections the drafter has time for
(``affordable_corrections``, its rounds timed once on its machine): as
many as keep a round within CORRECTION_SLACK of the chain's own step, or,
where the pass being verified lasts longer than the chain's drafting
ahead (the tokens it may draft, up to a correction's length), as many as
still let the chain draft those within the pass (``Forks.rounds``). Where
a batch of a few tokens costs about one (a GPU, Apple silicon) that is all
of them, nearly free; where each row costs about a step (a compute-bound
CPU) only what the pass's idle time holds, since a wide round delays the
chain and the next window's drafting. The rounds stop
when the main chain has its tokens and every correction its length, or
when the coordinator collects (the drafter server stops between rounds).
Nothing drafted is trusted: every token is verified by the target as any
draft is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speculators.sampling import SamplingSettings, choose_token

CORRECTION_RANKS = 2  # corrections at a position: the draft's next best tokens there after its own
# A round carries as many corrections as keep it within this many of the chain's own steps (timed on the
# drafter's machine: round_costs): where a batch of rows costs about one (a memory-bound drafter) that is
# all of them; where each row costs about a step (a compute-bound CPU) none. A round cannot be cut short:
# one wider than that delays the chain's next token and the next window's drafting, which measured
# async at 0.86-0.88x the chain alone under the emulated @40 curve here (the draft's rounds computed by
# this CPU), whether the corrections joined at once or after the chain had the next window's drafts.
CORRECTION_SLACK = 1.25
ROUND_WIDTHS = (1, 2, 3, 5, 9, 17)  # the rounds timed once per draft engine: the chain alone, and 1-16 corrections
Corrections = dict[tuple[int, int], list[int]]
"""(position, the token there) -> the correction's tokens: that token, then the draft's continuation."""


@dataclass(frozen=True)
class Forks:
    """Where a drafter drafts corrections while a window is verified, and the time it has.

    first, count: the window's drafts are at positions first .. first + count - 1.
    rounds: how long the window's pass lasts, in the chain's own draft rounds
    (a one-row round each; the pass's cost on the draft policy's line over
    the awaited draft price: SequenceState.forks); 0: not known (the slack
    rule alone decides)."""

    first: int
    count: int
    rounds: float = 0.0

    def __post_init__(self):
        if self.first < 1 or self.count < 1 or not 0.0 <= self.rounds < float("inf"):
            raise ValueError(f"corrections asked at {self.first} for {self.count} drafts within {self.rounds} rounds")


class CorrectionGrowth:
    """The main chain after ``context`` and the corrections at the positions
    ``forks`` names, grown a round at a time (``round``) by ``speculator``
    (a ModelSpeculator with tree KV ids).

    most: main-chain tokens to draft; length: each correction's tokens (its
    runner-up included). ``extension`` and ``corrections`` are what the
    rounds so far drafted: a correction for each of the draft's runners-up
    at a position (CORRECTION_RANKS), the likeliest first (every position's
    runner-up, earliest first, then the next ranks), as many as the engine
    has KV ids for and its rounds can carry (``affordable_corrections``)."""

    def __init__(self, speculator, context: Sequence[int], forks: Forks, most: int, length: int,
                 sampling: SamplingSettings | None = None):
        self.speculator = speculator
        self.engine = speculator.engine
        self.sampling = sampling
        self.most = most
        self.length = length
        self.extension: list[int] = []
        self.corrections: Corrections = {}
        keep = speculator.roll_back(context)
        if keep < len(context) - 1:  # the main chain's cells up to its last token (the rounds decode that one)
            self._prefill(context[keep:-1], keep)
        speculator.cached = list(context[:-1])
        self._main = list(context)
        self._ended = most <= 0  # the main chain stops (most reached, or the draft declined: p_min)
        costs = self._round_costs(len(context) - 1)  # timed first: the timing forks and drops KV ids
        # the committed positions before the first fork are never corrected again
        runners_up = speculator.runners_up = {position: tokens for position, tokens in speculator.runners_up.items()
                                              if position >= forks.first}
        positions = range(forks.first, min(forks.first + forks.count, len(context)))
        asked = [(position, tokens[rank]) for rank in range(CORRECTION_RANKS) for position in positions
                 if len(tokens := runners_up.get(position, [])) > rank and tokens[rank] != context[position]]
        # the chain's need: all it may draft ahead (up to a correction's length). On this CPU (a round of two
        # rows 1.8 of one) that opened no correction in the probe across rejections (2026-12-08); with the
        # next window's drafts (forks.count) as the need instead they covered 0.42-0.45 of rejections, but the
        # chain drafted slower: async 1.03x the chain alone through 2 stages at @40, 0.95x through 4 at @20
        most_forks = min(self.engine.tree_sequences, affordable_corrections(costs, min(most, length), forks.rounds))
        self._branches = {fork: branch for branch, fork in enumerate(asked[:most_forks], start=1)}
        for (position, token), branch in self._branches.items():
            self.engine.fork(0, branch, position)
            self.corrections[position, token] = [token]
        self._open = {fork for fork in self.corrections if length > 1}

    def _round_costs(self, position: int) -> dict[int, float]:
        """A round's seconds by its rows on this drafter (timed once per
        speculator: ``round_costs``), each at least its emulated step."""
        if self.speculator.round_seconds is None:
            self.speculator.round_seconds = round_costs(self.engine, position, self.speculator.sequence)
        step = self.speculator.step_seconds
        return {width: max(seconds, step) for width, seconds in self.speculator.round_seconds.items()}

    def _prefill(self, tokens: Sequence[int], first: int) -> None:
        batch = self.engine.settings.n_batch
        for start in range(0, len(tokens), batch):
            chunk = np.asarray(tokens[start:start + batch], dtype=np.int32)
            self.engine.decode(np.arange(first + start, first + start + len(chunk), dtype=np.int32), tokens=chunk,
                               sequence=self.speculator.sequence)

    @property
    def done(self) -> bool:
        return self._ended and not self._open

    def round(self) -> None:
        """One draft pass: the next token of the main chain and of every open correction."""
        started = time.perf_counter()
        rows: list[tuple[tuple[int, int] | None, int, int, int]] = []  # (fork or None: main, branch, position, token)
        if not self._ended:
            rows.append((None, 0, len(self._main) - 1, self._main[-1]))
        for fork in sorted(self._open):
            tokens = self.corrections[fork]
            rows.append((fork, self._branches[fork], fork[0] + len(tokens) - 1, tokens[-1]))
        if not rows:
            return
        logits = self.engine.decode_branches(np.array([row[2] for row in rows], np.int32),
                                             np.array([row[3] for row in rows], np.int32),
                                             np.array([row[1] for row in rows], np.int32))
        for (correction, _, position, _), row in zip(rows, logits):
            token = self._choose(row, position + 1)
            if correction is None:
                self.speculator.cached.append(self._main[-1])
                self._grow_main(token, row, position + 1)
            elif token is None:
                self._open.discard(correction)
            else:
                self.corrections[correction].append(token)
                if len(self.corrections[correction]) >= self.length:
                    self._open.discard(correction)
        rest = self.speculator.step_seconds - (time.perf_counter() - started)  # an emulated draft pass
        if rest > 0:
            time.sleep(rest)

    def _grow_main(self, token: int | None, logits: np.ndarray, position: int) -> None:
        if token is None:
            self._ended = True
            return
        self.speculator.note_runner_up(position, token, logits, self.sampling)
        self._main.append(token)
        self.extension.append(token)
        self._ended = len(self.extension) >= self.most

    def _choose(self, logits: np.ndarray, position: int) -> int | None:
        """The draft's token at ``position``: its argmax, None below p_min, or its coupled draw."""
        token = int(np.argmax(logits))
        if self.speculator.p_min > 0.0:
            shifted = np.exp(logits.astype(np.float64) - float(logits[token]))
            if 1.0 / shifted.sum() < self.speculator.p_min:
                return None
        if self.sampling is not None and not self.sampling.greedy:
            token = choose_token(logits, position, self.sampling)
        return token


def round_costs(engine, position: int, sequence: int = 0) -> dict[int, float]:
    """Seconds of one round of each width of ROUND_WIDTHS the engine's KV ids
    allow, its rows at ``position`` after the cells branch 0 holds below it:
    the median of three, each round's rows dropped again."""
    costs = {}
    for width in (width for width in ROUND_WIDTHS if width <= 1 + engine.tree_sequences):
        times = []
        for _ in range(3):
            for branch in range(1, width):
                engine.fork(0, branch, position)
            started = time.perf_counter()
            engine.decode_branches(np.full(width, position, np.int32), np.zeros(width, np.int32),
                                   np.arange(width, dtype=np.int32))
            times.append(time.perf_counter() - started)
            engine.remove(position, sequence)
        costs[width] = sorted(times)[1]
    return costs


def affordable_corrections(costs: dict[int, float], need: int = 0, rounds: float = 0.0) -> int:
    """The most corrections a round may carry, less the chain's row: the
    widest round timed that costs at most CORRECTION_SLACK times the chain's
    own (width 1), or whose ``need`` rounds (the chain's tokens drafted
    ahead) still fit in ``rounds`` of the chain's own (the pass's length:
    Forks.rounds), the drafter idle otherwise."""
    def fits(width: int) -> bool:
        seconds = costs[width]
        return seconds <= CORRECTION_SLACK * costs[1] or (rounds > 0 and need * seconds <= rounds * costs[1])

    return max(width for width in costs if fits(width)) - 1
