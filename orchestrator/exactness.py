"""The exactness contract, checked on one recorded run (docs/backends.md).

A decoding run through an ``InProcessPipeline`` of stage files (the real loop, with
whatever drafting it is given) is recorded pass by pass: each pass's rows
(tokens, positions, tree parents, logit rows) and the logits float32[len(rows),
n_vocab] its last stage returned, and every released sequence. Then:

* split-exact (every backend): the same passes, with the same cache
  roll-backs, through the whole model give the same logits, bit for bit
  (``first_split_difference``);
* lossless verification (every backend): every verified window committed the
  target's own choices (the argmax, or the draw seeded by (seed, position))
  from that pass's logits, walked here without the product's verifier
  (``first_lossless_violation``);
* batch-invariant (promised on the CPU build only): each row of a speculated
  chain has the logits of feeding its tokens one at a time
  (``first_batch_difference``). Where it is not promised, ``agreement`` says how
  often whole outputs still equal one-token decoding, and where they part.

Each check returns None when it holds, else one line naming the pass, row and value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import Decoding, DecodingLoop, Listener, sequence_state
from orchestrator.decoding.windows import Window
from orchestrator.in_process import InProcessPipeline, window_positions
from speculators.sampling import SamplingSettings, choose_token


@dataclass
class RecordedPass:
    """One pass: its window's rows and the logits float32[len(rows), n_vocab] of its logit rows."""

    window: Window
    tokens: np.ndarray  # int32[n_rows]
    positions: np.ndarray  # int32[n_rows]
    parents: np.ndarray | None  # int32[n_rows]: a tree's; None: a chain
    rows: np.ndarray  # int32[n_logit_rows]
    logits: np.ndarray


class RecordingChain(InProcessPipeline):
    """InProcessPipeline that keeps what each pass fed and got, and every release, in order."""

    def __init__(self, paths, settings):
        super().__init__(paths, settings)
        self.events: list[RecordedPass | int] = []  # a pass, or a released sequence

    def submit(self, target_pass) -> None:
        super().submit(target_pass)
        (window,) = target_pass.windows
        positions, parents = window_positions(window)
        self.events.append(RecordedPass(window, np.asarray(window.inputs, np.int32), positions, parents,
                                        np.asarray(window.logit_rows, np.int32), self.pending[-1].logits.copy()))

    def release(self, sequence: int) -> None:
        super().release(sequence)
        self.events.append(sequence)


@dataclass
class RecordedRun:
    """committed: prompt and generated tokens; verified: each verified window and the tokens it
    committed; events: the chain's passes and releases while it ran (its sequence released last)."""

    sampling: SamplingSettings
    committed: list[int]
    verified: list[tuple[Window, list[int]]] = field(default_factory=list)
    events: list[RecordedPass | int] = field(default_factory=list)

    @property
    def passes(self) -> list[RecordedPass]:
        return [event for event in self.events if not isinstance(event, int)]


class _Verified(Listener):
    def __init__(self, into: list):
        self.into = into

    def verified(self, window: Window, tokens: list[int]) -> None:
        self.into.append((window, tokens))


def record_run(chain: RecordingChain, prompt_tokens: list[int], max_tokens: int, sampling: SamplingSettings,
               drafting: Drafting | None, sequence: int = 0) -> RecordedRun:
    """Decode ``prompt_tokens`` through ``chain`` in KV sequence ``sequence``, recording it; released after."""
    chain.events = []
    loop = DecodingLoop(chain, lambda token: False)
    state = sequence_state(sequence, prompt_tokens, max_tokens, sampling, drafting, chain)
    run = RecordedRun(sampling, state.committed)
    loop.add(Decoding(state, drafting, _Verified(run.verified)))
    loop.run()
    chain.release(sequence)
    run.events = list(chain.events)
    return run


def replay(whole, events) -> list[tuple[int, np.ndarray]]:
    """Every recorded pass fed again to ``whole`` (a StageEngine of the whole model), with the
    same roll-backs; (event index, its logits)."""
    replayed = []
    for index, event in enumerate(events):
        if isinstance(event, int):
            whole.remove(0, event)
            continue
        whole.remove(event.window.first, event.window.sequence)
        replayed.append((index, whole.decode(event.positions, tokens=event.tokens, sequence=event.window.sequence,
                                             logit_rows=event.rows, parents=event.parents)))
    return replayed


def _first_bit_difference(recorded: np.ndarray, other: np.ndarray) -> tuple[int, int] | None:
    differ = recorded.view(np.uint32) != other.view(np.uint32)
    return None if not differ.any() else tuple(int(index) for index in np.argwhere(differ)[0])


def first_split_difference(events, replayed) -> str | None:
    """Split-exact: the first logit where the stages' pass and the whole model's replay differ."""
    for index, logits in replayed:
        recorded = events[index].logits
        found = _first_bit_difference(recorded, logits)
        if found is not None:
            row, column = found
            return f"pass {index} row {row} logit {column}: {recorded[row, column]!r} split, {logits[row, column]!r} whole"
    return None


def target_choices(recorded: RecordedPass, sampling: SamplingSettings) -> list[int]:
    """What the target chooses along its window from the pass's logits: at each row its own token
    (choose_token at that row's next position), then on to the child row that drafted that token."""
    tokens, rows = recorded.tokens, recorded.rows.tolist()
    parents = recorded.parents if recorded.parents is not None else np.arange(-1, len(tokens) - 1)
    row, chosen = rows[0], []
    while True:
        choice = choose_token(recorded.logits[rows.index(row)], int(recorded.positions[row]) + 1, sampling)
        chosen.append(choice)
        child = next((child for child in range(row + 1, len(tokens))
                      if parents[child] == row and tokens[child] == choice and child in rows), None)
        if child is None:
            return chosen
        row = child


def first_lossless_violation(run: RecordedRun) -> str | None:
    """Lossless verification: the first verified window that committed other than the target's choices."""
    by_window = {id(event.window): event for event in run.passes}
    generated = []
    for window, tokens in run.verified:
        choices = target_choices(by_window[id(window)], run.sampling)
        if tokens != choices[:len(tokens)]:
            return f"window at {window.first} committed {tokens}, the target chose {choices}"
        generated += tokens
    if run.committed[len(run.committed) - len(generated):] != generated:
        return "the committed text is not the verified windows' tokens"
    return None


def first_batch_difference(whole, events) -> tuple[str | None, int]:
    """Batch-invariant: each speculated chain pass fed again to ``whole`` one token at a time (after
    the same roll-backs); (the first row whose logits differ, or None; rows compared)."""
    compared = 0
    for event in events:
        if isinstance(event, int):
            whole.remove(0, event)
            continue
        sequence = event.window.sequence
        whole.remove(event.window.first, sequence)
        if event.parents is not None or len(event.rows) < 2:
            whole.decode(event.positions, tokens=event.tokens, sequence=sequence, logit_rows=event.rows,
                         parents=event.parents)
            continue
        rows = event.rows.tolist()
        for row in range(len(event.tokens)):
            one = whole.decode(event.positions[row:row + 1], tokens=event.tokens[row:row + 1], sequence=sequence)
            if row in rows:
                found = _first_bit_difference(event.logits[rows.index(row):rows.index(row) + 1], one)
                if found is not None:
                    return f"pass at {event.window.first} row {row} logit {found[1]}", compared
                compared += 1
    return None, compared


@dataclass(frozen=True)
class Agreement:
    """How often runs gave exactly the reference's tokens (one-token decoding), and where each
    other run first parted from it (a position in the generated text, counted from 0)."""

    runs: int
    identical: int
    first_divergence: tuple[int | None, ...]

    @property
    def fraction(self) -> float:
        return self.identical / self.runs if self.runs else 1.0


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where two generations differ (one ending early counts), or None."""
    for position, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return position
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def agreement(pairs: list[tuple[list[int], list[int]]]) -> Agreement:
    """pairs: (a run's generated tokens, one-token decoding's) for each run."""
    divergences = tuple(first_divergence(tokens, reference) for tokens, reference in pairs)
    return Agreement(len(pairs), sum(divergence is None for divergence in divergences), divergences)
