"""The decoding loop on the real model without Ray: the stage engines one after
another in this process (orchestrator.in_process.InProcessPipeline), drafters called in place.
Every schedule gives the whole model's tokens, greedy and sampled alike."""

import dataclasses

import pytest

from orchestrator.in_process import InProcessPipeline
from orchestrator.decoding.targets import InstantDrafter
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.transport.messages import Cancelled
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

from conftest import FORKING, PROMPTS

COPY = "Repeat this sentence exactly: the old keeper climbed the stairs every night and lit the lamp. " * 2


@pytest.fixture(scope="module")
def is_end(reference):
    import llama_cpp

    return lambda token: bool(llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token))


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def chain(request, splits):
    engines = InProcessPipeline(splits[request.param], StageSettings(n_ctx=1024))
    yield engines
    engines.close()


@pytest.mark.parametrize("schedule", [Schedule.SYNC, Schedule.ASYNC])
def test_every_schedule_gives_the_whole_models_greedy_tokens(chain, reference, is_end, schedule):
    stage_count = len(chain.engines)
    for prompt in (COPY, PROMPTS[1]):
        tokens = reference.tokenize(prompt)
        expected = reference.greedy(tokens, 32).tokens
        drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in range(stage_count)], schedule, 6)
        assert generate(chain, tokens, 32, SamplingSettings(), is_end, drafting=drafting).tokens == expected, prompt


def test_seeded_sampling_is_the_same_with_and_without_speculation(chain, reference):
    tokens = reference.tokenize(COPY)
    # a seed whose draw follows the copy for a while: drafts are accepted
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=6)
    plain = generate(chain, tokens, 32, sampling, lambda token: False).tokens
    drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in chain.engines], Schedule.ASYNC, 6)
    speculative = generate(chain, tokens, 32, sampling, lambda token: False, drafting=drafting)
    assert speculative.tokens == plain and speculative.speculation.accepted_tokens > 0
    greedy = reference.greedy(tokens, 32).tokens
    assert plain[:len(greedy)] != greedy  # the temperature really changed the draw


@pytest.mark.parametrize("stage_count", [2, 3, 4])
def test_windows_started_ahead_across_rejections_give_the_whole_models_tokens(splits, reference, is_end, stage_count):
    """Passes priced flat (step 0, as on memory-bound machines): async starts a
    window ahead of every window, also of one that rejects a draft, and
    discards it then; greedy and seeded tokens are the whole model's."""
    chain = InProcessPipeline(splits[stage_count], StageSettings(n_ctx=1024))
    try:
        for prompt in (COPY, *FORKING):
            tokens = reference.tokenize(prompt)
            drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 4) for _ in range(stage_count)],
                                Schedule.ASYNC, 4, call_cost=0.0, step=0.0)
            result = generate(chain, tokens, 48, SamplingSettings(), is_end, drafting=drafting)
            assert result.tokens == reference.greedy(tokens, 48).tokens, prompt
            assert result.speculation.discarded_passes > 0, prompt  # windows ahead went, and some were wrong
        sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=6)
        tokens = reference.tokenize(COPY)
        drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 4) for _ in range(stage_count)],
                            Schedule.ASYNC, 4, call_cost=0.0, step=0.0)
        speculative = generate(chain, tokens, 32, sampling, lambda token: False, drafting=drafting)
        assert speculative.tokens == generate(chain, tokens, 32, sampling, lambda token: False).tokens
    finally:
        chain.close()


LONG_PROMPT = COPY * 3 + PROMPTS[2]
SMALL_BATCH = 16


@pytest.fixture(scope="module")
def small_batch_chain(splits):
    """Two stages that take at most SMALL_BATCH tokens a pass: a long prompt is prefilled in chunks."""
    engines = InProcessPipeline(splits[2], StageSettings(n_ctx=1024, n_batch=SMALL_BATCH))
    yield engines
    engines.close()


@pytest.mark.parametrize("schedule", [None, Schedule.SYNC, Schedule.ASYNC], ids=["plain", "sync", "async"])
def test_a_prompt_of_several_batches_gives_the_whole_models_greedy_tokens(small_batch_chain, reference, is_end,
                                                                          schedule):
    tokens = reference.tokenize(LONG_PROMPT)
    assert len(tokens) > 5 * SMALL_BATCH  # chunked prefill: six chunks or more
    expected = reference.greedy(tokens, 24).tokens
    drafting = None if schedule is None else Drafting(
        [InstantDrafter(PromptLookupSpeculator(), 6) for _ in small_batch_chain.engines], schedule, 6,
        call_cost=0.0)  # drafters in this process: asking costs nothing, so the policy keeps asking
    result = generate(small_batch_chain, tokens, 24, SamplingSettings(), is_end, drafting=drafting)
    assert result.tokens == expected
    if schedule is not None:
        assert result.speculation.accepted_tokens > 0  # the drafts were verified against the chunked cache


def test_a_prompt_of_several_batches_samples_the_same_tokens_with_and_without_speculation(small_batch_chain, reference):
    tokens = reference.tokenize(LONG_PROMPT)
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=4)
    plain = generate(small_batch_chain, tokens, 24, sampling, lambda token: False).tokens
    drafting = Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in small_batch_chain.engines],
                        Schedule.ASYNC, 6)
    assert generate(small_batch_chain, tokens, 24, sampling, lambda token: False, drafting=drafting).tokens == plain


# Prompts whose n-grams recur with other continuations: prompt lookup forks there.
@pytest.fixture(scope="module")
def tree_chain(splits):
    """Two stages that verify token trees of up to four leaves."""
    engines = InProcessPipeline(splits[2], StageSettings(n_ctx=1024, tree_sequences=3))
    yield engines
    engines.close()


def _tree_drafting(schedule):
    # step 0: a row costs nothing, so the rule verifies every candidate row (the largest trees)
    return Drafting([InstantDrafter(PromptLookupSpeculator(), 6) for _ in range(2)], schedule, 6,
                    call_cost=0.0, step=0.0, tree_leaves=4)


@pytest.mark.parametrize("schedule", [Schedule.SYNC, Schedule.ASYNC])
def test_token_trees_give_the_whole_models_greedy_tokens(tree_chain, reference, is_end, schedule):
    side_accepted = 0
    for prompt in FORKING + [COPY]:
        tokens = reference.tokenize(prompt)
        expected = reference.greedy(tokens, 40).tokens
        result = generate(tree_chain, tokens, 40, SamplingSettings(), is_end, drafting=_tree_drafting(schedule))
        assert result.tokens == expected, prompt
        assert result.speculation.tree_passes > 0 or prompt == COPY  # a copy has nothing to fork on
        side_accepted += result.speculation.side_accepted
    # the target took side branches: their tokens were fed again, the cache kept hole-free
    assert side_accepted > 0


def test_seeded_sampling_is_the_same_with_token_trees(tree_chain, reference):
    sampling = SamplingSettings(temperature=0.7, top_p=0.95, seed=11)
    for prompt in FORKING:
        tokens = reference.tokenize(prompt)
        plain = generate(tree_chain, tokens, 32, sampling, lambda token: False).tokens
        for schedule in (Schedule.SYNC, Schedule.ASYNC):
            tree = generate(tree_chain, tokens, 32, sampling, lambda token: False, drafting=_tree_drafting(schedule))
            assert tree.tokens == plain, (prompt, schedule)
            assert tree.speculation.tree_passes > 0


class _NeverReady:
    """The chain as a pipeline whose results are never in before the loop
    asks (a pass's stage 0 takes a millisecond): a branching sequence makes a
    branch window at every chance, up to one per stage in flight. A pass runs
    when its result is asked for, and a cancelled one not at all, as when
    every stage dropped it before starting it."""

    def __init__(self, chain):
        self.chain = chain
        self.waiting: list[list] = []  # [pass, cancelled] in submission order

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def submit(self, target_pass) -> None:
        self.waiting.append([target_pass, False])

    def cancel(self, target_pass) -> None:
        next(entry for entry in self.waiting if entry[0] is target_pass)[1] = True

    def result_within(self, seconds: float) -> bool:
        return False

    def receive(self):
        target_pass, cancelled = self.waiting.pop(0)
        seconds = (0.001,) * self.chain.stage_count
        if cancelled:
            return Cancelled(0, 0, seconds)
        self.chain.submit(target_pass)
        return dataclasses.replace(self.chain.receive(), stage_seconds=seconds)


class _KnowingDrafter(InstantDrafter):
    """Prompt lookup's chain, and corrections that hold the expected text's
    next tokens where that chain leaves it at an even position (as a draft
    model whose runner-up is right half the time: speculators.corrections):
    branch windows then carry side branches that the target takes, and
    rejections they do not cover discard them."""

    def __init__(self, text: list[int]):
        super().__init__(PromptLookupSpeculator(), 4)
        self.text, self.forks, self.seen = text, None, []

    def speculate(self, context, most=None, sampling=None, tree=None, forks=None):
        super().speculate(context, most, sampling, tree)
        self.forks, self.seen = forks, list(context)

    def corrections(self):
        if self.forks is None:
            return {}
        text, seen, found = self.text, self.seen, {}
        for position in range(self.forks.first, min(self.forks.first + self.forks.count, len(seen), len(text))):
            if position % 2 == 0 and seen[:position] == text[:position] and seen[position] != text[position]:
                found[position, text[position]] = text[position:position + 4]
        return found


@pytest.mark.parametrize("stage_count", [2, 3, 4])
def test_branch_windows_give_the_whole_models_tokens(splits, reference, is_end, stage_count):
    """Branch windows (orchestrator.decoding.branches) through 2, 3 and 4
    stages that hold token trees, passes priced flat: up to a window per
    stage in flight, each rooted at the committed text, kept across the
    rejections its side branches cover, its rows for positions already
    committed verified again. Greedy and seeded tokens are the whole model's,
    and no window's tokens for committed positions differed."""
    chain = InProcessPipeline(splits[stage_count], StageSettings(n_ctx=1024, tree_sequences=3))
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=6)
    try:
        side_accepted = discarded = 0
        for prompt, chosen in [(COPY, SamplingSettings()), *((prompt, SamplingSettings()) for prompt in FORKING),
                               (COPY, sampling)]:
            tokens = reference.tokenize(prompt)
            expected = (reference.greedy(tokens, 40) if chosen.temperature == 0
                        else generate(chain, tokens, 40, chosen, is_end)).tokens
            drafters = [_KnowingDrafter(tokens + expected) for _ in range(stage_count)]
            drafting = Drafting(drafters, Schedule.ASYNC, 4, call_cost=0.0, step=0.0, tree_leaves=3, corrects=True,
                                branches=True)
            result = generate(_NeverReady(chain), tokens, 40, chosen, is_end, drafting=drafting)
            assert result.tokens == expected, prompt
            stats = result.speculation
            assert stats.mismatched_windows == 0, prompt
            side_accepted, discarded = side_accepted + stats.side_accepted, discarded + stats.discarded_passes
        assert side_accepted > 0 and discarded > 0  # side branches of corrections were taken, and some windows failed
        if chosen is sampling:
            assert expected != reference.greedy(tokens, 40).tokens  # the draw really differed
    finally:
        chain.close()
