"""Token trees through the Ray pipeline, on the real model: parents on the
wire, a tree walked beside the last stage, side branches dropped and fed
again. In a module of its own: the pipelines of test_speculation hold the
cluster's CPUs while that module runs."""

from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import generate
from orchestrator.cluster.pipeline import Pipeline
from orchestrator.decoding.schedule import Schedule
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings

GREEDY = SamplingSettings()
SAMPLING = SamplingSettings(temperature=0.8, top_p=0.95, seed=7)
MAX_TOKENS = 40

FORKING = (
    "Colors: the sky is blue, the grass is green, the sun is yellow, the sky is blue, the grass is",
    "the cat sat on the mat. the cat ate the fish. the cat sat on the mat. the cat ate the",
)


def test_token_trees_through_the_pipeline_are_exact(ray_cluster, splits, reference):
    """Greedy equals the whole model, seeded sampling the plain pipeline, in both schedules."""
    import llama_cpp

    from orchestrator.decoding.targets import InstantDrafter

    def is_end(token):
        return bool(llama_cpp.llama_vocab_is_eog(reference.llama._model.vocab, token))

    with Pipeline(splits[2], StageSettings(n_ctx=1024, tree_sequences=3)) as pipeline:
        drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=6))
        side_accepted = tree_passes = 0
        try:
            for prompt in FORKING:
                tokens = reference.tokenize(prompt)
                for sampling in (GREEDY, SAMPLING):
                    if sampling is GREEDY:
                        expected = reference.greedy(tokens, MAX_TOKENS).tokens
                    else:
                        expected = generate(pipeline, tokens, MAX_TOKENS, sampling, lambda token: False).tokens
                    for schedule in (Schedule.SYNC, Schedule.ASYNC):
                        # step 0: every candidate row pays, so the largest trees are verified
                        drafting = Drafting(drafters, schedule, 6, first=InstantDrafter(PromptLookupSpeculator(), 6),
                                            call_cost=0.0, step=0.0, tree_leaves=4)
                        result = generate(pipeline, tokens, MAX_TOKENS, sampling,
                                          is_end if sampling is GREEDY else (lambda token: False),
                                          drafting=drafting)
                        assert result.tokens == expected, (prompt, sampling, schedule)
                        tree_passes += result.speculation.tree_passes
                        side_accepted += result.speculation.side_accepted
        finally:
            stop_drafters(drafters)
    assert tree_passes > 0 and side_accepted > 0
