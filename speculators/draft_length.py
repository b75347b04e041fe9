"""How many draft tokens the next pass should verify: the length that gives
the most committed tokens per second, from what drafting has been worth so far.

A pass that verifies k drafts feeds k + 1 tokens and commits 1 + (the
accepted drafts). On a CPU a batch of n tokens costs nearly n single passes
(2 tokens 1.30x one, 4 2.06x, 8 3.51x on this 2-core CPU, 2026-11-30, by a
batch-cost script since folded into ``orchestrate profile``), so a draft
must be likely to be accepted to pay for its row.

``DraftPolicy`` keeps, with older evidence fading (``FORGET`` per verified
window):

* the acceptance by draft position (Sequoia's acceptance by rank, for a
  chain): of the windows whose draft j was reached (drafts 1..j-1
  accepted), the share that accepted it. Draft 1 of prompt lookup is often
  wrong while, once a copy starts, the later ones are nearly always right; a
  single rate could not see that.
and two costs in one-token passes of the target, given, not measured
online:

* ``step``, what each extra token of a batch adds (the cost curve t(n) / t(1)
  is close to 1 + step (n - 1) here). A run measures it once, before it
  starts (``step_from_timings`` over a few passes of 1 and of 8 tokens:
  ``Pipeline.draft_step``); the default is that 2026-11-30 figure's;
* ``prices`` (``DraftPrices``), what a draft token costs besides its row:
  ``awaited``, the loop's wait for it before a pass (a draft model's
  measured step over the measured one-token pass; prompt lookup: nothing),
  for every window in sync and, in async, a window drafted after a
  rejection (``limit(awaited=True)``); ``relayed``, what drafting while
  passes run slows them by (0 where every drafter has idle cores; on a
  machine whose cores the stages use, about the draft's step), for async's
  other windows. Both measured before a run (orchestrator.cluster.drafters.draft_prices);
* ``call_cost``, what asking a drafter costs before a pass, whether it
  proposes anything or not (a drafter actor's round trip; nothing in process),
  weighed with the share of asks that got a proposal (``availability``).

Measuring the costs pass by pass was tried and dropped: the decisions then
followed the timing noise of the machine, so the same text gave other passes
within a run, and the planner's simulation (orchestrator.planning) could no
longer make the decisions the real loop makes. Measured once before a run,
the step follows the machine from day to day (on this VM two tokens cost
1.30x one on 2026-11-30 and 1.71x on 2026-12-01) and the decisions of a run
stay a function of its text.

``limit()`` is the k in 0..maximum that maximises

    (1 - a + a * committed(k)) / (call_cost + 1 - a + a * cost(k))   for k >= 1, and 1 for k = 0,

    committed(k) = 1 + sum_{i<=k} prod_{j<=i} accept(j),   cost(k) = 1 + (step + price) * k,

with a the availability: a drafter that proposes nothing leaves a plain pass.

and 0 means "do not draft at all": the pass runs plain and the drafter is
not even asked. The evidence fades toward the prior, so a stretch without
drafting raises the estimates again until the next pass tries a draft: a
change of text (the user starts quoting) is found again within a few
passes, at the price of an occasional probe.

Pure: no I/O. The schedule (orchestrator.decoding.schedule) tells it every verified
window and asks it for the next window's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_STEP = 0.35  # each extra batch token costs this share of a one-token pass (8 tokens 3.51x, above)
FORGET = 0.95  # the weight older evidence keeps after each verified window
PRIOR_COUNT = 1.0  # pseudo-observations of each draft position at the prior (see acceptances)
# What asking a drafter actor costs before a pass (speculate, collect with wait), in
# passes of the default pipeline: 0.046 (0.71 ms of 15.6) by the where-the-time-goes
# probe (now `python -m benchmarks.probe where-time-goes`) here, 2026-12-01 (a bare round trip in `orchestrate
# profile` is 0.23 ms; beside a running pipeline the drafter wakes on an idle core).
DRAFTER_CALL_COST = 0.045


def ask_cost(speculator: str) -> float:
    """What asking the drafter before a window costs a run, in one-token
    passes: nothing for prompt lookup, which a run asks in the coordinator
    (orchestrator.run.make_drafting), a drafter actor's round trip else."""
    return 0.0 if speculator == "ngram" else DRAFTER_CALL_COST


@dataclass(frozen=True)
class DraftPrices:
    """What drafting one token costs the target, in one-token passes: awaited
    (the loop waits for it before a pass) and relayed (drafted while passes
    run: how much it slows them)."""

    awaited: float = 0.0
    relayed: float = 0.0


@dataclass
class DraftPolicy:
    """The draft length that maximises committed tokens per second (see the module text).

    maximum: the most drafts a pass may carry (--draft-max).
    step, prices: the costs of one more draft token (its row; its drafting), in one-token passes.
    call_cost: the cost of asking the drafter, in one-token passes.
    """

    maximum: int
    step: float = PRIOR_STEP
    prices: DraftPrices = DraftPrices()
    call_cost: float = 0.0
    reached: list[float] = field(default_factory=list)  # by draft position: windows that reached it
    accepted: list[float] = field(default_factory=list)  # ... and accepted it
    asked: float = 0.0  # drafters asked before a pass ...
    proposed: float = 0.0  # ... and those that proposed something

    def __post_init__(self):
        if self.maximum < 1:
            raise ValueError(f"the draft maximum must be at least 1, not {self.maximum}")
        self.reached = self.reached or [0.0] * self.maximum
        self.accepted = self.accepted or [0.0] * self.maximum

    def acceptances(self) -> list[float]:
        """By draft position 1..maximum: the chance it is accepted once reached.
        A position with little evidence leans on the one before it (the first
        on 1/2), so a chain that keeps being accepted is tried one longer."""
        shares, prior = [], 0.5
        for reached, accepted in zip(self.reached, self.accepted):
            prior = (accepted + PRIOR_COUNT * prior) / (reached + PRIOR_COUNT)
            shares.append(prior)
        return shares

    def observe_window(self, drafted: int, accepted: int) -> None:
        """A verified window carried ``drafted`` drafts, of which the first ``accepted`` were accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} accepted of {drafted} drafts")
        for index in range(self.maximum):
            self.reached[index] *= FORGET
            self.accepted[index] *= FORGET
        self.asked *= FORGET
        self.proposed *= FORGET
        for index in range(min(drafted, accepted + 1, self.maximum)):  # drafts 1..accepted, then the rejected one
            self.reached[index] += 1.0
            self.accepted[index] += index < accepted

    def observe_ask(self, proposed: bool) -> None:
        """The loop asked a drafter before a pass; it proposed something or nothing."""
        self.asked += 1.0
        self.proposed += proposed

    @property
    def availability(self) -> float:
        """The chance that an ask gets a proposal (1/2 with no evidence)."""
        return (self.proposed + PRIOR_COUNT / 2) / (self.asked + PRIOR_COUNT)

    def expected_committed(self, drafts: int) -> float:
        """Tokens a pass with ``drafts`` drafts is expected to commit."""
        expected, reach = 1.0, 1.0
        for share in self.acceptances()[:drafts]:
            reach *= share
            expected += reach
        return expected

    def cost(self, drafts: int, awaited: bool = True) -> float:
        """The pass's cost with ``drafts`` drafts, in one-token passes, with
        the wait for drafting them (awaited) or without (drafted while hidden)."""
        return 1.0 + (self.step + (self.prices.awaited if awaited else self.prices.relayed)) * drafts

    def rate(self, drafts: int, awaited: bool = True) -> float:
        """Expected committed tokens per one-token pass of cost, drafting up to ``drafts``."""
        if drafts == 0:
            return 1.0
        available = self.availability
        return ((1.0 - available + available * self.expected_committed(drafts))
                / (self.call_cost + 1.0 - available + available * self.cost(drafts, awaited)))

    def limit(self, awaited: bool = True) -> int:
        """The draft length with the most committed tokens per second (0: none),
        for drafts the loop waits for (awaited) or drafted while a pass runs.
        With no evidence at all it is at least 1: the prior alone (1/2) would
        never draft once a wider pass costs half a pass or more, and nothing
        else could ever be learnt."""
        rates = [self.rate(drafts, awaited) for drafts in range(self.maximum + 1)]
        best = max(range(self.maximum + 1), key=lambda drafts: (rates[drafts], -drafts))
        return max(best, 1) if self.asked == 0 and self.reached[0] == 0 else best


DRAFT_STEP_TOKENS = 8  # the step is the line through passes of 1 and of this many tokens (a window's usual width)


def curve_step(curve, batch_tokens: int = DRAFT_STEP_TOKENS) -> float:
    """step_from_timings's step from a pass measured at several widths
    (stages.cost_curve.BatchCurve, seconds): the line through 1 and ``batch_tokens``."""
    return step_from_timings([curve.at(1)], [curve.at(batch_tokens)], batch_tokens)


def step_from_timings(one_token_seconds: list[float], batch_seconds: list[float], batch_tokens: int) -> float:
    """The cost of each extra batch token, in one-token passes, from timed
    passes of one token and of ``batch_tokens`` (medians; within [0, 2])."""
    if batch_tokens < 2 or not one_token_seconds or not batch_seconds:
        raise ValueError("need timed passes of one token and of a batch of at least two")
    one = sorted(one_token_seconds)[len(one_token_seconds) // 2]
    batch = sorted(batch_seconds)[len(batch_seconds) // 2]
    if one <= 0:
        raise ValueError("a one-token pass took no time")
    return min(2.0, max(0.0, (batch / one - 1.0) / (batch_tokens - 1)))
