"""What speculation did for a sequence: drafts verified and accepted, windows
by length, trees, waits (the bench's, the planner's and run --json's figures)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields


def _share(successes: int, failures: int) -> float:
    return successes / (successes + failures) if successes + failures else 0.0


@dataclass
class SpeculationStats:
    """drafted_tokens: draft tokens the target verified; accepted_tokens: those it accepted.
    accepted_lengths: verified windows by number of tokens they committed (1 = no draft accepted).
    input_lengths: verified windows by number of tokens fed to the target.
    tree_passes: verified windows that were token trees; side_rows: their rows
    off the main chain; side_accepted: tokens accepted off it; refed_tokens:
    committed tokens fed again because their cells were not kept.
    collected_tokens: tokens the drafters delivered (verified or not).
    discarded_passes: windows started ahead on a speculation that then failed.
    rejected_passes: windows in which a draft token was rejected.
    drafted_passes, first_accepted_passes: windows with at least one draft, and
    those of them that accepted the first.
    waited_calls, waited_nonempty, waited_tokens, waited_stops: over the drafts
    awaited until the drafter stopped (``drafts_first``): how many, how many
    brought at least one token, the tokens, and how many stopped by themselves
    before draft_max.
    corrected_windows: rejections after which a correction drafted during the
    pass (speculators.corrections) held the target's token, so its drafts
    went at once.
    mismatched_windows: branch windows whose tokens for positions already
    committed differed from them (orchestrator.decoding.branches): discarded."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    collected_tokens: int = 0
    discarded_passes: int = 0
    rejected_passes: int = 0
    drafted_passes: int = 0
    first_accepted_passes: int = 0
    waited_calls: int = 0
    waited_nonempty: int = 0
    waited_tokens: int = 0
    waited_stops: int = 0
    tree_passes: int = 0
    side_rows: int = 0
    side_accepted: int = 0
    refed_tokens: int = 0
    corrected_windows: int = 0
    mismatched_windows: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)
    input_lengths: Counter = field(default_factory=Counter)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_first(self) -> float:
        """Probability that a window accepts its first draft token."""
        return self.first_accepted_passes / self.drafted_passes if self.drafted_passes else 0.0

    @property
    def acceptance_later(self) -> float:
        """Probability that a later draft token is accepted when every draft
        before it was: each such acceptance is a success, each rejection after
        the first token a failure. (With sync drafting every window drafts afresh
        from the committed text; the planner takes these as a workload's figures.)"""
        later_rejected = self.rejected_passes - (self.drafted_passes - self.first_accepted_passes)
        return _share(self.accepted_tokens - self.first_accepted_passes, later_rejected)

    @property
    def draft_availability(self) -> float:
        """Probability that drafting from the committed text proposes anything
        (prompt lookup finds no n-gram at some positions; a draft model always proposes)."""
        return self.waited_nonempty / self.waited_calls if self.waited_calls else 0.0

    @property
    def draft_continuation(self) -> float:
        """Probability that the drafter proposes one more token after one it proposed."""
        later_stops = self.waited_stops - (self.waited_calls - self.waited_nonempty)
        return _share(self.waited_tokens - self.waited_nonempty, later_stops)

    @property
    def committed_per_window(self) -> float:
        """Tokens a verified decoding window committed, on average (chain against tree: the bench)."""
        windows = sum(self.accepted_lengths.values())
        return sum(length * count for length, count in self.accepted_lengths.items()) / windows if windows else 0.0

    @property
    def wasted_tokens(self) -> int:
        return max(0, self.collected_tokens - self.accepted_tokens)

    def awaited(self, tokens: int, draft_max: int) -> None:
        """The drafter beside stage 0 was awaited and brought ``tokens`` (``drafts_first``)."""
        self.waited_calls += 1
        self.waited_nonempty += tokens > 0
        self.waited_tokens += tokens
        self.waited_stops += tokens < draft_max
        self.collected_tokens += tokens

    def verified(self, drafts: int, accepted: int, committed: int, inputs: int, refed: int,
                 side_rows: int | None = None, side_accepted: int = 0) -> None:
        """A decoding window was verified: ``drafts`` drafts on its main chain
        (filler left out), ``accepted`` of them accepted, ``committed`` tokens
        given (accepted drafts, side rows and the target's own), ``inputs``
        rows fed, ``refed`` of them fed again; a tree's ``side_rows`` off its
        main chain (None: a chain), ``side_accepted`` of them accepted."""
        self.drafted_tokens += drafts
        self.accepted_tokens += accepted
        self.rejected_passes += accepted < drafts
        self.drafted_passes += drafts > 0
        self.first_accepted_passes += drafts > 0 and accepted > 0
        self.accepted_lengths[committed] += 1
        self.input_lengths[inputs] += 1
        self.refed_tokens += refed
        if side_rows is not None:
            self.tree_passes += 1
            self.side_rows += side_rows
            self.side_accepted += side_accepted

    def __add__(self, other: SpeculationStats) -> SpeculationStats:
        """The counts of two generations together."""
        return SpeculationStats(**{item.name: getattr(self, item.name) + getattr(other, item.name)
                                   for item in fields(self)})
