"""Many requests through one target: the decoding loop of ``orchestrate serve``.

A plain class, no Ray and no HTTP: the service (orchestrator.serving.deployment) builds
one over a ``Pipeline``, the tests over the stage engines in this process.
Requests arrive from any thread (``submit``); one thread turns the decoding
loop (orchestrator.decoding.loop, the same as ``orchestrate run``'s):

    admit queued requests while a KV sequence is free
    -> one turn of the loop (drafting, passes, verification)
    -> hand each request's committed tokens to its sink
    -> free the KV of every request that ended -> again

Each admitted request holds its own KV sequence (0 .. max_sequences - 1) in
every stage; its windows carry that id, so every stage keeps its positions
apart (stages.engine), and a request's tokens are what it would get alone.
A request asking for n choices is n such sequences, its prompt prefilled
once: the others copy it. Prompts share prefilled prefixes (with a prefix
cache): a request whose prompt begins as a finished request's did, or as
one's decoding now, copies that prefix into its own sequence and prefills
only the rest (orchestrator.decoding.prefix_cache); while a request
decoding now still prefills a prefix a queued one shares, the queued one
waits for it rather than computing it again.
Requests' windows share passes where it pays (continuous batching,
schedule.Batching, by the pass cost the target measured): on a flat cost
curve the ready windows fill one pass per stage; on this CPU's nearly
linear one a pass carries one window, so while stage 1 computes request A's
pass, stage 0 computes request B's. A request drafts as ``orchestrate run`` does: with
prompt lookup in this process, sync or async (a drafter drafts on while
a pass runs, and windows start ahead), chains or trees. A request ends by an end token, by its token limit, or
cancelled (client gone, stop string); its KV is then released in every stage,
in order with the passes around it, and its id goes back to the free list.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from orchestrator.config import RESUME_SECONDS, SERVICE_IDLE_WAKE_SECONDS
from orchestrator.decoding.drafting import Drafting, draft_cells

from orchestrator.decoding.loop import Decoding, DecodingLoop, Listener, sequence_state
from orchestrator.decoding.prefix_cache import PREFIX_BLOCK, PrefixCache, PrefixHit, common_prefix
from orchestrator.decoding.schedule import Schedule, SequenceState
from orchestrator.decoding.scheduler import Batching
from orchestrator.decoding.windows import Window
from orchestrator.decoding.targets import Drafter, InstantDrafter, Target, TargetWaiting
from speculators.draft_length import DRAFTER_CALL_COST, PRIOR_STEP, DraftPrices
from speculators.logprobs import TokenLogprobs
from speculators.sampling import SamplingSettings, choice_sampling
from stages.errors import SpecpipeError
from stages.cost_curve import BatchCurve


class ServiceError(SpecpipeError):
    """A request the service cannot take; the message is one line."""


class QueueFull(ServiceError):
    """Every KV sequence is busy and the queue is full: try again later."""


class ShuttingDown(ServiceError):
    """The service is stopping (or has failed) and takes no more requests."""


class Unavailable(ServiceError):
    """The target lost a part it cannot replace yet (``degraded`` says which):
    try again later; the service resumes by itself once it can."""


class RequestTooLong(ServiceError):
    """Prompt + tokens asked for do not fit one sequence's context."""


@dataclass(frozen=True)
class ServiceRequest:
    """prompt_tokens: the whole prompt (chat template applied); max_tokens: the
    most tokens to generate; sampling: how each token is chosen (choice i > 0
    draws with its own seed: speculators.sampling.choice_sampling); choices:
    how many continuations (OpenAI's n), each in its own KV sequence;
    logprobs: None, or each token's log-probability is wanted with this many
    likeliest alternatives (speculators.logprobs); grammar: None, or the
    tokens are chosen under this grammar (structured output, speculators.grammar)."""

    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingSettings
    choices: int = 1
    logprobs: int | None = None
    grammar: str | None = None


@dataclass(frozen=True)
class Progress:
    """What a request's sink receives for each of its choices, in order: the
    tokens each verified window committed, then once the end: ``finished`` is
    "end" (an end token), "length" (max_tokens), "cancelled", or "error"
    (with ``error``, one line). choice: which of the request's choices;
    logprobs: the tokens' logprobs, when the request asked."""

    tokens: tuple[int, ...] = ()
    finished: str | None = None
    error: str = ""
    choice: int = 0
    logprobs: TokenLogprobs | None = None


Sink = Callable[[Progress], None]
"""Called from the loop's thread; must not block (the HTTP layer hands events to its own event loop)."""


@dataclass(frozen=True)
class ServiceSettings:
    """max_sequences: requests decoded at once (each holds a KV sequence in every stage).
    queue_limit: requests waiting for a free sequence before new ones are refused.
    context: positions of one sequence (prompt + generated + a window of drafts).
    speculator: builds the speculator of a request from its KV sequence id,
    asked in this process (prompt lookup: microseconds a token, where asking
    an actor costs a round trip); drafters: or the drafters of a request, one
    beside each stage, from its KV sequence id (a draft model drafts in that
    sequence of each machine's engine); neither: no drafting.
    draft_prices: what drafting a token costs the target, awaited and
    while a pass runs (drafting.Drafting: a draft model's measured).
    draft_max: the most drafts a window carries.
    schedule: sync or async (orchestrator.decoding.schedule), with a speculator.
    stage_count: the target's stages, a drafter beside each.
    tree_leaves: above 1, the drafter (prompt lookup, or the draft model
    beside stage 0) drafts token trees (the stages hold tree_leaves - 1 more
    KV ids; one sequence only); side_row_step: what the
    tree rule prices a side row at (None: as any row; 0: every candidate).
    coupled: when a request samples, its drafters sample with its seeded uniforms.
    batch_step: what each extra token of a pass costs, in one-token passes,
    as the target measured it (Pipeline.draft_step): the draft policy prices
    longer windows by it, and several requests' windows share a pass where
    schedule.Batching finds it pays; None: a pass per window, the prior step.
    pass_curve: the pass measured at several widths (Pipeline.pass_curve),
    which batching then reads a pass's cost from instead of batch_step's line.
    prefix_sequences: KV sequences after the served ones (ids max_sequences
    on) that keep finished requests' prefixes; prefix_tokens: the most tokens
    they keep in all. Either 0: no prefix cache, and prompts share a
    prefix only among one request's choices."""

    max_sequences: int
    queue_limit: int
    context: int
    speculator: Callable[[int], object] | None = None
    drafters: Callable[[int], Sequence[Drafter]] | None = None
    draft_prices: DraftPrices = DraftPrices()
    draft_max: int = 8
    schedule: Schedule = Schedule.SYNC
    stage_count: int = 1
    tree_leaves: int = 1
    side_row_step: float | None = None
    batch_step: float | None = None
    pass_curve: BatchCurve | None = None
    prefix_sequences: int = 0
    prefix_tokens: int = 0
    coupled: bool = True

    def prefix_cache(self) -> PrefixCache | None:
        if not (self.prefix_sequences and self.prefix_tokens >= PREFIX_BLOCK):
            return None
        return PrefixCache(range(self.max_sequences, self.max_sequences + self.prefix_sequences), self.prefix_tokens)

    @property
    def drafts(self) -> bool:
        return self.speculator is not None or self.drafters is not None

    @property
    def draft_room(self) -> int:
        """KV cells a window of drafts may take beyond the generated tokens (drafting.draft_cells)."""
        return draft_cells(self.draft_max, self.tree_leaves) if self.drafts else 0

    def drafting(self, sequence: int) -> Drafting | None:
        """How the request in KV sequence ``sequence`` drafts: its drafters
        beside the stages, or its speculator asked in this process, before a
        window and (async) while its passes run."""
        step = PRIOR_STEP if self.batch_step is None else self.batch_step
        if self.drafters is not None:
            return Drafting(self.drafters(sequence), self.schedule, self.draft_max, call_cost=DRAFTER_CALL_COST,
                            step=step, draft_prices=self.draft_prices, tree_leaves=self.tree_leaves,
                            pass_curve=self.pass_curve, coupled=self.coupled)
        if self.speculator is None:
            return None
        speculator = self.speculator(sequence)
        first = InstantDrafter(speculator, self.draft_max)
        machines = [InstantDrafter(speculator, self.draft_max) for _ in range(self.stage_count)]
        return Drafting(machines, self.schedule, self.draft_max, first=first, call_cost=0.0,
                        step=step, tree_leaves=self.tree_leaves, side_row_step=self.side_row_step,
                        pass_curve=self.pass_curve)


class ServiceObserver:
    """What the service reports as it goes (orchestrator.cluster.metrics.ServiceMetrics
    records it as Ray metrics); these defaults record nothing."""

    def first_token(self, seconds: float) -> None:
        """A request's first token, seconds after it was submitted."""

    def tokens(self, seconds: float, count: int) -> None:
        """count tokens of a request delivered together, seconds after its previous ones."""

    def load(self, active: int, queued: int) -> None:
        """Requests decoding and waiting, after every change."""

    def prefix_query(self, prompt_tokens: int, reused: int) -> None:
        """A sequence began: its prompt's tokens, and those it copied (0: none found)."""


@dataclass
class _Ticket(Listener):
    """A request in the service: queued (state None), then decoding; the loop
    tells it of each verified window, and it hands the tokens to its sink."""

    number: int
    request: ServiceRequest
    sink: Sink
    observer: ServiceObserver
    choice: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    state: SequenceState | None = None
    last_delivery: float | None = None
    error: str = ""
    logprobs: TokenLogprobs | None = None  # of the tokens verified next (Listener.scored)

    def scored(self, logprobs: TokenLogprobs) -> None:
        self.logprobs = logprobs

    def verified(self, window: Window, tokens: list[int]) -> None:
        logprobs, self.logprobs = self.logprobs, None
        if not tokens:
            return
        now = time.perf_counter()
        if self.last_delivery is None:
            self.observer.first_token(now - self.submitted)
        else:
            self.observer.tokens(now - self.last_delivery, len(tokens))
        self.last_delivery = now
        self.send(Progress(tuple(tokens), choice=self.choice, logprobs=logprobs))

    def send(self, progress: Progress) -> None:
        try:
            self.sink(progress)
        except Exception:  # a sink that fails (its client's loop closed) must not stop the others
            pass


WAIT = PrefixHit(-1, -1)
"""Service._prefix_of: the request waits for a sequence decoding now to prefill the prefix it shares."""


class Service:
    """Decodes many requests at once through ``target`` (which must ``release`` and ``copy`` KV sequences)."""

    def __init__(self, target: Target, is_end: Callable[[int], bool], settings: ServiceSettings,
                 observer: ServiceObserver | None = None):
        if settings.max_sequences < 1 or settings.queue_limit < 0:
            raise ValueError("max_sequences must be at least 1 and queue_limit at least 0")
        self.target = target
        self.is_end = is_end
        self.settings = settings
        self.observer = observer or ServiceObserver()
        self.loop = self._new_loop()
        self.prefix_cache = settings.prefix_cache()  # None: prompts share prefixes only among a request's choices
        # free KV sequence ids, a heap: a request takes the lowest, so the requests decoding hold consecutive
        # ids, which is what lets their windows share a pass (schedule.Batching)
        self._free = list(range(settings.max_sequences))
        self._queue: collections.deque[_Ticket] = collections.deque()  # one ticket per choice
        self._active: dict[int, _Ticket] = {}  # by KV sequence id
        self._tickets: dict[int, list[_Ticket]] = {}  # by request number: its choices, queued or active
        self._cancelled: set[tuple[int, int | None]] = set()  # (request number, choice: None for every choice)
        self._numbers = itertools.count(1)
        self._wake = threading.Condition()
        self._closing = False
        self._deadline: float | None = None  # shutdown: active requests get an error after it
        self.failure = ""  # set when the target failed: the service takes nothing more
        self.degraded = ""  # set while the target waits to replace a lost part (TargetWaiting): 503s until then
        self._reported_load: tuple[int, int] | None = None  # (decoding, queued) last told to the observer
        self._thread = threading.Thread(target=self._run, name="specpipe-service", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------
    def submit(self, request: ServiceRequest, sink: Sink) -> int:
        """Queue a request; returns its number (for ``cancel``)."""
        self._check(request)
        with self._wake:
            if self._closing or self.failure:
                raise ShuttingDown(self.failure or "the server is shutting down")
            if self.degraded:
                raise Unavailable(self.degraded)
            if len(self._queue) + request.choices > self.settings.queue_limit + len(self._free):
                raise QueueFull(f"all {self.settings.max_sequences} sequences are busy and "
                                f"{max(0, len(self._queue) - len(self._free))} requests are waiting")
            number = next(self._numbers)
            self._tickets[number] = [
                _Ticket(number, replace(request, sampling=choice_sampling(request.sampling, choice)), sink,
                        self.observer, choice)
                for choice in range(request.choices)]
            self._queue.extend(self._tickets[number])
            self._wake.notify()
            return number

    def _check(self, request: ServiceRequest) -> None:
        needed = len(request.prompt_tokens) + request.max_tokens + self.settings.draft_room
        if not request.prompt_tokens:
            raise ServiceError("the prompt is empty")
        if request.max_tokens < 1:
            raise ServiceError("max_tokens must be at least 1")
        if not 1 <= request.choices <= self.settings.max_sequences + self.settings.queue_limit:
            raise ServiceError(f"{request.choices} choices: this server decodes at most "
                               f"{self.settings.max_sequences + self.settings.queue_limit} at once or queued")
        if needed > self.settings.context:
            raise RequestTooLong(
                f"the prompt ({len(request.prompt_tokens)} tokens) + max_tokens ({request.max_tokens})"
                f"{' + a window of drafts' if self.settings.drafts else ''} exceed the context of "
                f"{self.settings.context} tokens"
            )

    def cancel(self, number: int) -> None:
        """Stop a request, every choice of it (its client went away, or a stop
        string matched); its KV is freed within one pass. Unknown or ended requests are ignored."""
        with self._wake:
            if number in self._tickets:
                self._cancelled.add((number, None))
                self._wake.notify()

    def cancel_choice(self, number: int, choice: int) -> None:
        """Stop one choice of a request (its stop string matched)."""
        with self._wake:
            for ticket in self._tickets.get(number, []):
                if ticket.choice == choice:
                    self._cancelled.add((number, choice))
                    self._wake.notify()

    def counts(self) -> tuple[int, int]:
        """(sequences decoding, choices queued)."""
        with self._wake:
            return len(self._active), len(self._queue)

    def close(self, drain_seconds: float) -> None:
        """Take no more requests; queued ones get an error at once, decoding
        ones may finish for drain_seconds and then get an error; returns when
        the loop has stopped (the target's KV is then all released)."""
        with self._wake:
            self._closing = True
            self._deadline = time.perf_counter() + drain_seconds
            self._wake.notify()
        self._thread.join()

    # -- the loop's thread ------------------------------------------------------
    def _new_loop(self) -> DecodingLoop:
        settings = self.settings
        batching = None if settings.batch_step is None else Batching(self.target.stage_count, settings.batch_step,
                                                                      self.target.n_batch, settings.pass_curve)
        return DecodingLoop(self.target, self.is_end, window_per_pass=True, batching=batching)

    def _run(self) -> None:
        try:
            while True:
                try:
                    while self._step():
                        pass
                    return
                except TargetWaiting as lost:  # every request ends with it; the service waits, then goes on
                    if not self._wait_for_target(str(lost)):
                        return
        except Exception as error:  # the target failed (a stage died): every request ends with it
            self._fail(f"{type(error).__name__}: {error}" if not isinstance(error, SpecpipeError) else str(error))

    def _wait_for_target(self, reason: str) -> bool:
        """The target lost a part it cannot replace yet: end every request
        with the reason (a retryable error), refuse new ones (Unavailable),
        and ask the target to resume every RESUME_SECONDS until it does (True:
        serve again, holding nothing) or the service closes (False)."""
        with self._wake:
            self.degraded = f"{reason}; the service resumes by itself once it can"
            self._end_every_request(self.degraded)
            self._cancelled.clear()
            self._free = list(range(self.settings.max_sequences))
        self.loop = self._new_loop()  # the passes in flight are gone with the lost part
        self.prefix_cache = self.settings.prefix_cache()  # so are the prefixes its stages held
        while not self.target.resume():
            with self._wake:
                if self._closing:
                    return False
                self._wake.wait(timeout=RESUME_SECONDS)
        with self._wake:
            self.degraded = ""
        return True

    def _step(self) -> bool:
        """One turn of the loop; False once closed and drained."""
        self._take_orders()
        self.loop.cancel_invalid()  # the passes of the requests just cancelled
        self._settle()
        if self._closing and not self._active and not self._queue:
            return False
        if not self.loop.step():  # nothing in flight: wait for a request
            with self._wake:
                if not (self._queue and self._free) and not self._cancelled and not self._closing:
                    self._wake.wait(timeout=SERVICE_IDLE_WAKE_SECONDS)
        return True

    def _take_orders(self) -> None:
        """Cancellations, the shutdown deadline, and admissions, under the lock;
        then the admitted sequences' prefix copies, outside it (a copy is I/O on
        the chain, and may wait out a lost stage's restart), before their first passes."""
        with self._wake:
            cancelled, self._cancelled = self._cancelled, set()
            named = {id(ticket): ticket for order in cancelled for ticket in self._ordered(order)}
            for ticket in named.values():
                if ticket.state is None:
                    self._queue.remove(ticket)
                    self._end(ticket, "cancelled")
                else:
                    ticket.state.cancel()
            if self._closing:
                while self._queue:
                    self._end(self._queue.popleft(), "error", "the server is shutting down")
                if self._deadline is not None and time.perf_counter() > self._deadline:
                    for ticket in self._active.values():
                        ticket.error = ticket.error or "the server shut down before the request finished"
                        ticket.state.cancel()  # type: ignore[union-attr]
            copies = self._admit_queued()
            load = (len(self._active), len(self._queue))
            if load != self._reported_load:  # not every pass: the gauges change only with the load
                self.observer.load(*load)
                self._reported_load = load
        for source, destination, length in copies:
            self.target.copy(source, destination, length)

    def _ordered(self, order: tuple[int, int | None]) -> list[_Ticket]:
        """The tickets a cancel names: (request number, choice), every choice where choice is None."""
        number, choice = order
        return [ticket for ticket in self._tickets.get(number, []) if choice in (None, ticket.choice)]

    def _admit_queued(self) -> list[tuple[int, int, int]]:
        """Queued choices take free sequences in order; one whose prompt's
        prefix another is prefilling now waits for it (and lets later ones by).
        Returns the prefix copies (source, destination, length) to make."""
        waiting, copies = [], []
        while self._queue and self._free:
            ticket = self._queue.popleft()
            prefix = self._prefix_of(ticket)
            if prefix is WAIT:
                waiting.append(ticket)
                continue
            sequence = heapq.heappop(self._free)
            self._admit(ticket, sequence, prefix)
            if prefix is not None:
                copies.append((prefix.sequence, sequence, prefix.length))
        self._queue.extendleft(reversed(waiting))
        return copies

    def _prefix_of(self, ticket: _Ticket) -> PrefixHit | None:
        """Where the ticket's prompt prefix can be copied from: the prefix
        cache, or a sequence decoding now (another choice of its request; with
        a prefix cache, any request). WAIT while such a sequence is still
        prefilling at least a block more of it than can be had now. The
        prompt's last token is always fed (its logits give the first token)."""
        prompt = ticket.request.prompt_tokens
        best = (self.prefix_cache.lookup(prompt[:-1]) if self.prefix_cache else None) or PrefixHit(-1, 0)
        coming = 0
        for sequence, other in self._active.items():
            sibling = other.number == ticket.number
            if not (sibling or self.prefix_cache) or other.state is None:
                continue
            shared = common_prefix(other.request.prompt_tokens, prompt[:-1])
            if shared < (1 if sibling else PREFIX_BLOCK):
                continue
            ready = min(shared, other.state.cached)
            if ready > best.length and (sibling or ready >= PREFIX_BLOCK):
                best = PrefixHit(sequence, ready)
            if other.state.prefilling and shared > other.state.cached:
                # worth waiting for: a sibling's any token more; another request's a block more than had now
                coming = max(coming, shared if sibling else shared - PREFIX_BLOCK + 1)
        if coming > best.length:
            return WAIT
        return best if best.length > 0 else None

    def _admit(self, ticket: _Ticket, sequence: int, prefix: PrefixHit | None) -> None:
        """The ticket decodes in KV sequence ``sequence``, from its prompt's
        prefix's end (the caller has the prefix copied before its first pass)."""
        request = ticket.request
        reused = 0 if prefix is None else prefix.length
        self.observer.prefix_query(len(request.prompt_tokens), reused)
        drafting = self.settings.drafting(sequence)
        ticket.state = sequence_state(sequence, request.prompt_tokens, request.max_tokens, request.sampling, drafting,
                                      self.target, cached=reused, logprobs=request.logprobs, grammar=request.grammar)
        self._active[sequence] = ticket
        self.loop.add(Decoding(ticket.state, drafting, ticket))

    def _settle(self) -> None:
        """Free the KV of every request that ended (its prefix kept first,
        with a prefix cache) and tell its client."""
        for sequence, ticket in list(self._active.items()):
            state = ticket.state
            if state is None or not state.settled:
                continue
            self.loop.remove(sequence)
            self._keep_prefix(sequence, state)
            self.target.release(sequence)  # in order: the sequence's next user's passes come after it
            with self._wake:
                del self._active[sequence]
                heapq.heappush(self._free, sequence)
                self._end(ticket, "error" if ticket.error else state.stopped_by, ticket.error)

    def _keep_prefix(self, sequence: int, state: SequenceState) -> None:
        """With a prefix cache: copy what the ended sequence holds into the entry it gets (if any)."""
        if self.prefix_cache is None:
            return
        entry = self.prefix_cache.store(state.committed[:state.cached])
        if entry is not None:
            self.target.copy(sequence, entry, state.cached)

    def _end(self, ticket: _Ticket, finished: str, error: str = "") -> None:
        """Called under the lock."""
        siblings = self._tickets.get(ticket.number, [])
        if ticket in siblings:
            siblings.remove(ticket)
            if not siblings:
                del self._tickets[ticket.number]
        ticket.send(Progress(finished=finished, error=error, choice=ticket.choice))

    def _fail(self, reason: str) -> None:
        """The target failed: every request ends with the reason, nothing more is taken."""
        with self._wake:
            self.failure = reason or "the pipeline failed"
            self._end_every_request(self.failure)

    def _end_every_request(self, error: str) -> None:
        """Every request queued or decoding ends with ``error`` (called under the lock)."""
        for ticket in [*self._queue, *self._active.values()]:
            self._end(ticket, "error", error)
        self._queue.clear()
        self._active.clear()
        self.observer.load(0, 0)
