"""The decoding loop: plain, or with speculation.

Each target pass feeds [last committed token, draft_1, ..., draft_k] at
positions len(committed) - 1 onward; every stage first drops cached positions
from there on (rolling back whatever the previous pass speculated). The
logits are verified (speculators.verify) and the accepted drafts plus the
target's own token are committed. Plain decoding is the case k = 0.

Speculation schedules (``Speculation``):

* ``sync``: before each pass the drafter beside stage 0 drafts until it stops
  by itself (max tokens, or its confidence falls); then the pass runs.
* ``async``: drafting happens while the drafter's own machine is idle. While
  stage i runs, the drafter beside stage i+1 (mod n) extends the speculation;
  when the pass leaves stage i (a boundary notice), that drafter's tokens are
  collected and the drafter of the machine that just went idle continues from
  them. When the logits arrive the last drafter is collected, the pass is
  verified, and the speculation that still extends the committed text is kept
  for the next pass ("best effort": whatever was drafted by then). When none
  is left (at the start, or after a rejection) the drafter beside stage 0
  drafts before the pass, as in ``sync``: stage 0 is idle until the pass starts,
  and a pass without drafts would waste the target.
  The idle *target* machines are used too (PipeInfer's idea): while a pass is
  in flight, the next window of the speculation is submitted at once, so stage
  0 computes it while the later stages finish the first. It assumes the first
  pass commits its whole window (every draft accepted, and its own next token
  equal to the second window's first token); if not, its result is discarded
  and the next pass's rollback drops its cache entries. At most two passes are
  in flight, and a pass is started ahead only after a pass that accepted all
  its drafts: after a rejection the next window is likely wrong too, and a
  discarded pass still costs every stage its compute. A stage is then rarely idle, so drafters may run while their own
  stage computes: free for prompt lookup, a contention for a draft model.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from orchestrator.sampling import SamplingSettings
from speculators.draft_length import next_draft_limit
from speculators.verify import verify

SCHEDULES = ("sync", "async")


def _share(successes: int, failures: int) -> float:
    return successes / (successes + failures) if successes + failures else 0.0


@dataclass
class SpeculationStats:
    """drafted_tokens: draft tokens the target verified; accepted_tokens: those it accepted.
    accepted_lengths: passes by number of tokens they committed (1 = no draft accepted).
    input_lengths: passes by number of tokens fed to the target.
    collected_tokens: tokens the drafters delivered (verified or not).
    discarded_passes: passes started ahead on a speculation that then failed.
    rejected_passes: passes in which a draft token was rejected.
    drafted_passes, first_accepted_passes: passes with at least one draft, and
    those of them that accepted the first.
    waited_calls, waited_nonempty, waited_tokens, waited_stops: over the drafts
    awaited until the drafter stopped (sync, or async with nothing pending):
    how many, how many brought at least one token, the tokens, and how many
    stopped by themselves before --draft-max."""

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
    accepted_lengths: Counter = field(default_factory=Counter)
    input_lengths: Counter = field(default_factory=Counter)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_first(self) -> float:
        """Probability that a pass accepts its first draft token."""
        return self.first_accepted_passes / self.drafted_passes if self.drafted_passes else 0.0

    @property
    def acceptance_later(self) -> float:
        """Probability that a later draft token is accepted when every draft
        before it was: each such acceptance is a success, each rejection after
        the first token a failure. (With sync drafting every pass drafts afresh
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

    def __add__(self, other: SpeculationStats) -> SpeculationStats:
        """The counts of two generations together."""
        return SpeculationStats(**{item.name: getattr(self, item.name) + getattr(other, item.name)
                                   for item in fields(self)})

    @property
    def wasted_tokens(self) -> int:
        return max(0, self.collected_tokens - self.accepted_tokens)


@dataclass
class Generation:
    """What one generation produced and how long it took.

    tokens: generated ids (an end-of-generation token is not included).
    prefill_seconds: from start to the first generated token.
    decode_seconds: from the first generated token to the last.
    passes: target passes after the prompt; stage_seconds: each stage's busy seconds.
    """

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    passes: int = 0
    stage_seconds: list[float] = field(default_factory=list)
    stopped_by: str = "length"
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generation phase: tokens after the first over the time they took."""
        if len(self.tokens) < 2 or self.decode_seconds <= 0:
            return 0.0
        return (len(self.tokens) - 1) / self.decode_seconds


class Speculation:
    """Where a pass's drafts come from: a schedule over the drafters (one per stage)."""

    def __init__(self, drafters: list, schedule: str, max_drafts: int):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} (choose {', '.join(SCHEDULES)})")
        self.drafters = drafters
        self.schedule = schedule
        self.max_drafts = max_drafts
        self.draft_limit = max_drafts  # adapted after every pass (speculators.draft_length)
        self.stats = SpeculationStats()

    def _collect(self, index: int, wait: bool = False) -> list[int]:
        tokens = self.drafters[index].collect(wait)
        self.stats.collected_tokens += len(tokens)
        return tokens

    def before_pass(self, committed: list[int], pending: list[int]) -> list[int]:
        """The speculation beyond the committed text when a pass starts (its first
        max_drafts tokens become the pass's drafts).

        Synchronous, and asynchronous with nothing pending (at the start, or after
        a rejection): the drafter beside stage 0 drafts now, while its machine is
        idle anyway, until it stops by itself."""
        if self.schedule == "sync" or not pending:
            self.drafters[0].speculate(committed)
            tokens = self._collect(0, wait=True)
            self.stats.waited_calls += 1
            self.stats.waited_nonempty += bool(tokens)
            self.stats.waited_tokens += len(tokens)
            self.stats.waited_stops += len(tokens) < self.max_drafts
            return tokens
        return pending

    def while_running(self, target, committed: list[int], speculation: list[int]) -> list[int]:
        """Between submit and receive: hand drafting to each machine as it goes idle."""
        if self.schedule == "sync":
            return speculation
        count = len(self.drafters)
        self.drafters[1 % count].speculate(committed + speculation)
        for stage in range(count - 1):
            target.await_boundary(stage)
            speculation = speculation + self._collect((stage + 1) % count)
            self.drafters[(stage + 2) % count].speculate(committed + speculation)
        return speculation

    def after_result(self, speculation: list[int]) -> list[int]:
        if self.schedule == "sync":
            return speculation
        return speculation + self._collect(0)


def generate(
    target,
    prompt_tokens: list[int],
    max_tokens: int,
    sampling: SamplingSettings,
    is_end: Callable[[int], bool],
    *,
    on_token: Callable[[int], None] | None = None,
    on_pass: Callable[[Generation, int], None] | None = None,
    speculation: Speculation | None = None,
) -> Generation:
    """Decode up to max_tokens after the prompt through ``target`` (a Pipeline).

    on_token: called with each committed token; on_pass: called after each
    verified pass with the running Generation and the tokens that pass committed."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty")
    result = Generation(list(prompt_tokens))
    stats = speculation.stats if speculation is not None else result.speculation
    result.speculation = stats
    started = time.perf_counter()

    def account(stage_seconds: tuple[float, ...]) -> None:
        if not result.stage_seconds:
            result.stage_seconds = [0.0] * len(stage_seconds)
        for index, seconds in enumerate(stage_seconds):
            result.stage_seconds[index] += seconds

    def submit(first: int, inputs: list[int], rows: np.ndarray) -> _Pass:
        positions = np.arange(first, first + len(inputs), dtype=np.int32)
        target.submit(positions, np.asarray(inputs, np.int32), first, rows)
        return _Pass(first, inputs)

    def receive(committed: list[int], text: list[int]) -> tuple[np.ndarray, list[int]]:
        """The next result, with the drafters relayed while it runs.
        Returns (logits, the speculative text extended meanwhile)."""
        speculated = text[len(committed) :]
        if speculation is not None:
            speculated = speculation.while_running(target, committed, speculated)
        reply = target.receive()
        if speculation is not None:
            speculated = speculation.after_result(speculated)
        account(reply.stage_seconds)
        return reply.logits, committed + speculated

    # Prefill in chunks the stages accept in one batch. The last chunk's pass
    # already lets the drafters speculate past the prompt.
    batch_size = target.n_batch
    last_chunk = (len(prompt_tokens) - 1) // batch_size * batch_size
    for first in range(0, last_chunk, batch_size):
        chunk = prompt_tokens[first : first + batch_size]
        account(target.forward(np.arange(first, first + len(chunk), dtype=np.int32), np.asarray(chunk, np.int32), first).stage_seconds)
    committed = list(prompt_tokens)
    submit(last_chunk, committed[last_chunk:], np.array([len(committed) - last_chunk - 1], dtype=np.int32))
    logits, text = receive(committed, committed)
    new_tokens = verify([], logits, len(committed), sampling)
    # text: the committed tokens followed by the speculation, indexed by absolute
    # position. A pass is a window of it: inputs text[first : first + 1 + drafts].
    in_flight: deque[_Pass] = deque()
    pipelined = speculation is not None and speculation.schedule == "async"
    on_a_roll = False  # the last verified pass accepted all its drafts
    first_token_time = None
    while True:
        finished = False
        agreed = len(committed)  # text and committed agree up to here
        for token in new_tokens:
            if is_end(token):
                result.stopped_by, finished = "end", True
                break
            now = time.perf_counter()
            if first_token_time is None:
                first_token_time = now
                result.prefill_seconds = now - started
            result.decode_seconds = now - first_token_time
            committed.append(token)
            result.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if len(result.tokens) == max_tokens:
                finished = True
                break
        if text[agreed : len(committed)] != committed[agreed:]:
            text = list(committed)  # the speculation went wrong: drop it
        # A pass submitted ahead is valid only if the previous one committed its
        # whole window (so the new last token is that pass's first input).
        while in_flight and (finished or in_flight[0].first != len(committed) - 1 or in_flight[0].inputs[0] != committed[-1]):
            target.receive()  # computed on a speculation that failed: discard
            in_flight.popleft()
            result.passes += 1
            stats.discarded_passes += 1
        if finished:
            break

        room = max_tokens - len(result.tokens) - 1  # a pass commits up to drafts + 1 tokens
        if not in_flight:
            if speculation is not None:
                text = committed + speculation.before_pass(committed, text[len(committed) :])
            limit = min(speculation.draft_limit, room) if speculation is not None else 0
            inputs = text[len(committed) - 1 : len(committed) + limit]
            in_flight.append(submit(len(committed) - 1, inputs, np.arange(len(inputs), dtype=np.int32)))
        head = in_flight[0]
        if pipelined and on_a_roll and len(in_flight) == 1:
            # Start the next window now, on the assumption that the head commits
            # its whole window: stage 0 runs it while the later stages finish the head.
            first = head.first + len(head.inputs)
            ahead = first - (len(committed) - 1)  # tokens the head must commit first
            limit = min(speculation.draft_limit, room - ahead)  # type: ignore[union-attr]
            if len(text) > first and limit >= 0:
                inputs = text[first : first + 1 + limit]
                in_flight.append(submit(first, inputs, np.arange(len(inputs), dtype=np.int32)))
        logits, text = receive(committed, text)
        in_flight.popleft()
        result.passes += 1
        drafts = head.inputs[1:]
        new_tokens = verify(drafts, logits, len(committed), sampling)
        on_a_roll = bool(drafts) and len(new_tokens) == len(drafts) + 1
        stats.drafted_tokens += len(drafts)
        stats.accepted_tokens += len(new_tokens) - 1
        stats.rejected_passes += len(new_tokens) - 1 < len(drafts)
        stats.drafted_passes += bool(drafts)
        stats.first_accepted_passes += bool(drafts) and len(new_tokens) > 1
        if speculation is not None:
            speculation.draft_limit = next_draft_limit(
                speculation.draft_limit, len(drafts), len(new_tokens) - 1, speculation.max_drafts
            )
        stats.accepted_lengths[len(new_tokens)] += 1
        stats.input_lengths[len(head.inputs)] += 1
        if on_pass is not None:
            on_pass(result, len(new_tokens))
    return result


@dataclass(frozen=True)
class _Pass:
    """A submitted target pass: inputs at positions first, first + 1, ..."""

    first: int
    inputs: list[int]
