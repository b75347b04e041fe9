"""The exactness contract, as three properties of one recorded run (docs/backends.md).

A decoding run through the stages (the real loop: async prompt lookup and
token trees, stages in this process: tests/fakes.py EngineChain) records every
pass: its rows (tokens, positions, tree parents, logit rows) and the logits its
last stage returned. Then:

* split-exact: the same passes, with the same cache roll-backs, through the
  whole model in one process give the same logits, bit for bit;
* lossless verification: every verified window committed the target's own
  choices (speculators.sampling.choose_token: the argmax, or the draw seeded by
  (seed, position)) from that pass's logits, walked here without the product's
  verifier;
* batch-invariant (this CPU build): every row of a chain pass has the logits
  of feeding its tokens one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conftest import FORKING
from fakes import EngineChain
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import Decoding, DecodingLoop, Listener, sequence_state
from orchestrator.decoding.schedule import Schedule, Window
from orchestrator.decoding.targets import InstantDrafter
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings, choose_token
from speculators.tree import depths
from stages.engine import StageEngine
from stages.settings import StageSettings

SETTINGS = StageSettings(n_ctx=1024, tree_sequences=3)
MAX_TOKENS = 40


@dataclass
class RecordedPass:
    """One pass: its window's rows and the logits float32[len(rows), n_vocab] of its logit rows."""

    window: Window
    tokens: np.ndarray  # int32[n_rows]
    positions: np.ndarray  # int32[n_rows]
    parents: np.ndarray | None  # int32[n_rows]: a tree's; None: a chain
    rows: np.ndarray  # int32[n_logit_rows]
    logits: np.ndarray


class RecordingChain(EngineChain):
    """EngineChain that keeps what each pass fed and got, and every release, in order."""

    def __init__(self, paths, settings):
        super().__init__(paths, settings)
        self.events: list[RecordedPass | int] = []  # a pass, or a released sequence

    def submit(self, target_pass) -> None:
        super().submit(target_pass)
        (window,) = target_pass.windows
        parents = None if window.parents is None else np.asarray(window.batch_parents, np.int32)
        positions = (np.arange(window.first, window.first + len(window.inputs), dtype=np.int32) if parents is None
                     else (window.first + depths(parents)).astype(np.int32))
        self.events.append(RecordedPass(window, np.asarray(window.inputs, np.int32), positions, parents,
                                        np.asarray(window.logit_rows, np.int32), self.pending[-1].logits.copy()))

    def release(self, sequence: int) -> None:
        super().release(sequence)
        self.events.append(sequence)


class Verified(Listener):
    def __init__(self):
        self.windows: list[tuple[Window, list[int]]] = []

    def verified(self, window: Window, tokens: list[int]) -> None:
        self.windows.append((window, tokens))


def record_run(chain: RecordingChain, prompt_tokens: list[int], sampling: SamplingSettings) -> tuple[list, Verified]:
    """Decode through ``chain`` with async prompt lookup and trees of up to 4 leaves; (committed text, windows)."""
    drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in chain.engines], Schedule.ASYNC, 6,
                        call_cost=0.0, step=0.0, tree_leaves=4)
    loop = DecodingLoop(chain, lambda token: False)
    state = sequence_state(0, prompt_tokens, MAX_TOKENS, sampling, drafting, chain.n_batch)
    listener = Verified()
    loop.add(Decoding(state, drafting, listener))
    loop.run()
    return state.committed, listener


def replay_through_the_whole_model(whole: StageEngine, events) -> list[tuple[int, np.ndarray]]:
    """Every recorded pass fed again to the whole model, with the same roll-backs; (pass index, its logits)."""
    replayed = []
    for index, event in enumerate(events):
        if isinstance(event, int):
            whole.remove(0, event)
            continue
        whole.remove(event.window.first, event.window.sequence)
        replayed.append((index, whole.decode(event.positions, tokens=event.tokens, sequence=event.window.sequence,
                                             logit_rows=event.rows, parents=event.parents)))
    return replayed


def first_difference(events, replayed) -> str | None:
    for index, logits in replayed:
        recorded = events[index].logits
        if not np.array_equal(recorded.view(np.uint32), logits.view(np.uint32)):
            row, column = np.argwhere(recorded.view(np.uint32) != logits.view(np.uint32))[0]
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


@pytest.fixture(scope="module")
def stages(splits):
    chain = RecordingChain(splits[2], SETTINGS)
    yield chain
    chain.close()


@pytest.fixture(scope="module")
def whole(smollm2):
    engine = StageEngine(smollm2, SETTINGS)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["greedy", "seeded"])
def recorded(request, stages, reference):
    """A run on the first forking prompt, greedy or seeded: (sampling, events, committed, verified windows)."""
    sampling = SamplingSettings() if request.param == "greedy" else SamplingSettings(temperature=0.8, top_p=0.95,
                                                                                      seed=5)
    stages.events = []
    committed, verified = record_run(stages, reference.tokenize(FORKING[0]), sampling)
    stages.release(0)
    return sampling, list(stages.events), committed, verified


def test_the_run_had_trees_chains_and_discarded_passes(recorded):
    sampling, events, committed, verified = recorded
    passes = [event for event in events if not isinstance(event, int)]
    assert any(event.parents is not None for event in passes)  # token trees
    assert any(event.parents is None and len(event.rows) > 1 for event in passes)  # speculated chains
    if sampling == SamplingSettings():  # greedy: async passes started ahead were thrown away
        assert len(passes) > len(verified.windows)
    assert len(committed) > MAX_TOKENS


def test_split_exact_the_whole_model_gives_every_recorded_pass_the_same_logits_bit_for_bit(recorded, whole):
    _, events, _, _ = recorded
    replayed = replay_through_the_whole_model(whole, events)
    assert len(replayed) == sum(not isinstance(event, int) for event in events)
    assert first_difference(events, replayed) is None


@pytest.mark.parametrize("stage, what", [(1, "one logit by one ulp"),
                                         (0, "the hidden states of the pass's last row by 2**-14 relative")])
def test_the_replay_finds_a_stage_output_changed_in_one_pass(stages, whole, reference, stage, what):
    """A bug that moves a stage's output in one pass is found: the last stage's logits by one
    ulp, directly. The first stage's hidden states reach the logits through 15 more blocks of
    quantized products, which absorb the smallest changes: measured here, every value of a row
    moved by one ulp, or by 2**-20 relative, leaves every logit bit-identical (so no comparison
    of logits could see it); 2**-14 relative changes them."""
    engine, plain_decode = stages.engines[stage], stages.engines[stage].decode
    calls = 0

    def off_by_one_ulp(*args, **kwargs):
        nonlocal calls
        output = plain_decode(*args, **kwargs)
        calls += 1
        if calls == 5:
            if stage == 0:
                output[-1] *= np.float32(1 + 2**-14)
            else:
                output[-1, 7] = np.nextafter(output[-1, 7], np.float32(np.inf))
        return output

    engine.decode = off_by_one_ulp
    try:
        stages.events = []
        record_run(stages, reference.tokenize(FORKING[1]), SamplingSettings())
        stages.release(0)
    finally:
        del engine.decode
    difference = first_difference(stages.events, replay_through_the_whole_model(whole, stages.events))
    assert difference is not None and difference.startswith("pass 4 "), (what, difference)


def test_lossless_every_verified_window_committed_the_targets_own_choices(recorded):
    sampling, events, committed, verified = recorded
    by_window = {id(event.window): event for event in events if not isinstance(event, int)}
    generated = []
    for window, tokens in verified.windows:
        choices = target_choices(by_window[id(window)], sampling)
        assert tokens == choices[:len(tokens)], (window.first, tokens, choices)
        generated += tokens
    prompt_length = len(committed) - len(generated)
    assert committed[prompt_length:] == generated and len(generated) == MAX_TOKENS


def test_batch_invariant_every_chain_row_has_the_logits_of_one_token_decoding(recorded, whole):
    """On this CPU build: each speculated chain pass fed again one token at a time (after the same
    roll-backs), row by row, gives the same logits bit for bit."""
    _, events, _, _ = recorded
    checked = 0
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
                assert np.array_equal(one[0].view(np.uint32), event.logits[rows.index(row)].view(np.uint32)), \
                    (event.window.first, row)
                checked += 1
    assert checked >= 5
