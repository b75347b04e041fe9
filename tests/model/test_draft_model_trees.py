"""Token trees grown by a draft model (speculators.model_tree) and coupled
drafting, through the stage engines in this process and the drafters'
real sockets (DrafterServer and DrafterClient, without Ray): the output is
the whole model's, greedy and seeded alike, on 2 and 3 stages, sync and
async (drafting while passes run); coupling changes acceptance, never the text."""

import functools

import pytest

from orchestrator.cluster.drafters import DrafterClient
from orchestrator.config import DRAFT_TREE_BRANCHES
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.in_process import InProcessPipeline
from orchestrator.transport.handshake import connect_peer, drafter_role
from orchestrator.workers.drafter_server import DrafterServer
from speculators.model import ModelSpeculator
from speculators.sampling import SamplingSettings
from speculators.tree import MAX_TREE_ROWS
from stages.cost_curve import BatchCurve
from stages.settings import StageSettings

from conftest import FORKING, PROMPTS

SECRET = b"t" * 32
LEAVES = 8
FLAT = BatchCurve((1, 32, 64), (1.0, 1.0, 3.0))  # flat to 32 rows: the rule takes trees of about that many


@pytest.fixture(scope="module")
def is_end(reference):
    import llama_cpp

    return lambda token: bool(llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token))


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def tree_chain(request, splits):
    engines = InProcessPipeline(splits[request.param], StageSettings(n_ctx=1024, tree_sequences=LEAVES - 1))
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def drafters(realistic_draft):
    """Three drafters of the realistic draft (one beside each stage of the
    longest chain), each growing trees in its own engine."""
    make = functools.partial(ModelSpeculator, path=realistic_draft, n_ctx=1024 + MAX_TREE_ROWS,
                             tree_branches=DRAFT_TREE_BRANCHES)
    servers, clients = [], []
    for index in range(3):
        servers.append(DrafterServer(make, "127.0.0.1", secret=SECRET, draft_max=6, index=index, wait_seconds=30))
        clients.append(DrafterClient(index, connect_peer("127.0.0.1", servers[-1].port, SECRET, drafter_role(index),
                                                         10), draft_max=6))
    yield clients
    for client in clients:
        client.close()


def _drafting(clients, stage_count, schedule, leaves=LEAVES, coupled=True):
    return Drafting(clients[:stage_count], schedule, 6, call_cost=0.0, step=0.0, tree_leaves=leaves,
                    pass_curve=FLAT, coupled=coupled)


@pytest.mark.parametrize("schedule", [Schedule.SYNC, Schedule.ASYNC])
def test_draft_model_trees_give_the_whole_models_greedy_tokens(tree_chain, drafters, reference, is_end, schedule):
    stage_count = len(tree_chain.engines)
    side_accepted = tree_passes = 0
    for prompt in FORKING[:1] + PROMPTS[:1]:
        tokens = reference.tokenize(prompt)
        expected = reference.greedy(tokens, 32).tokens
        result = generate(tree_chain, tokens, 32, SamplingSettings(), is_end,
                          drafting=_drafting(drafters, stage_count, schedule))
        assert result.tokens == expected, prompt
        tree_passes += result.speculation.tree_passes
        side_accepted += result.speculation.side_accepted
    assert tree_passes > 0
    assert side_accepted > 0  # the target took the draft's second choices: what a chain could not offer


def test_seeded_sampling_is_the_same_with_draft_model_trees(tree_chain, drafters, reference):
    """Sync and async, coupled and top choices on 2 stages; async coupled,
    which takes every path the others do, on 3."""
    sampling = SamplingSettings(temperature=0.8, top_p=0.95, seed=5)
    stage_count = len(tree_chain.engines)
    tokens = reference.tokenize(FORKING[0])
    plain = generate(tree_chain, tokens, 24, sampling, lambda token: False).tokens
    variants = ((Schedule.SYNC, True), (Schedule.ASYNC, True), (Schedule.SYNC, False))
    for schedule, coupled in variants if stage_count == 2 else variants[1:2]:
        tree = generate(tree_chain, tokens, 24, sampling, lambda token: False,
                        drafting=_drafting(drafters, stage_count, schedule, coupled=coupled))
        assert tree.tokens == plain, (schedule, coupled)
        assert tree.speculation.tree_passes > 0


def _accepted_share(chain, drafters, reference, sampling, coupled):
    """Accepted drafts over drafted ones, chains in sync, over the chat prompts; and the texts."""
    drafted = accepted = 0
    texts = []
    for prompt in PROMPTS[:3]:
        tokens = reference.tokenize(prompt)
        result = generate(chain, tokens, 32, sampling, lambda token: False,
                          drafting=_drafting(drafters, len(chain.engines), Schedule.SYNC, leaves=1, coupled=coupled))
        drafted += result.speculation.drafted_tokens
        accepted += result.speculation.accepted_tokens
        texts.append(result.tokens)
    return accepted / drafted, texts


def test_coupled_drafts_are_accepted_more_and_change_no_text(tree_chain, drafters, reference, monkeypatch):
    """At temperature 1 the draft sampling with the target's own uniforms is
    accepted more often than its top choices; a draft drawing with the
    next position's uniform (the planted bug) is accepted less, and the text
    is the seeded run's in every case."""
    if len(tree_chain.engines) != 2:
        pytest.skip("measured once, on two stages")
    sampling = SamplingSettings(temperature=1.0, seed=3)
    plain = [generate(tree_chain, reference.tokenize(prompt), 32, sampling, lambda token: False).tokens
             for prompt in PROMPTS[:3]]
    coupled, coupled_texts = _accepted_share(tree_chain, drafters, reference, sampling, True)
    top, top_texts = _accepted_share(tree_chain, drafters, reference, sampling, False)
    import speculators.model as model
    from speculators.sampling import choose_token

    monkeypatch.setattr(model, "choose_token", lambda logits, position, settings: choose_token(logits, position + 1,
                                                                                                settings))
    shifted, shifted_texts = _accepted_share(tree_chain, drafters, reference, sampling, True)
    print(f"acceptance at temperature 1: coupled {coupled:.3f}, top choices {top:.3f}, another position's "
          f"uniform {shifted:.3f}")
    assert coupled_texts == top_texts == shifted_texts == plain
    assert coupled > top and coupled > shifted
