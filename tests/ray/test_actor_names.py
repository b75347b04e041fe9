"""What the Ray dashboard's Actors page shows of a pipeline: each stage and
drafter actor named by its role, index and pipeline
(orchestrator.cluster.connect.actor_name), with its own class name
(readable_class_name); two pipelines side by side and a restarted actor
(its predecessor's name may still be held) are named apart."""

import functools
import re

import pytest

import fakes
from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
from orchestrator.cluster.pipeline import Pipeline
from stages.settings import StageSettings

SETTINGS = StageSettings(n_ctx=256)
# drafts token ids beyond SmolLM2's vocabulary: its drafter is dropped while its actor still lives
OUT_OF_VOCABULARY = functools.partial(fakes.ScriptedSpeculator, [10**6] * 8, set())


@pytest.fixture(scope="module", autouse=True)
def pickle_doubles_by_value():
    """The drafters' workers cannot import tests/fakes.py: it travels with the call."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(fakes)


def alive_named_actors() -> dict[str, str]:
    """Name -> class name of every live named actor, from Ray's actor table (the
    dashboard's source; ray.util.state needs a dashboard, which this cluster has not)."""
    from ray._private.state import actors

    return {actor["Name"]: actor["ActorClassName"] for actor in actors().values()
            if actor["Name"] and actor["State"] == "ALIVE"}


def expected(role: str, tag: str, count: int, actor_class: str) -> dict[str, str]:
    return {f"specpipe-{role}-{index}.{tag}": actor_class for index in range(count)}


def test_stage_and_drafter_actors_are_named_per_pipeline_and_anew_on_a_restart(ray_cluster, splits):
    import ray

    # two pipelines side by side in one Ray namespace (this driver's), as a test or Serve's replicas run them
    with Pipeline(splits[2], SETTINGS) as first, Pipeline(splits[2], SETTINGS) as second:
        tag, other = first.actors.tag, second.actors.tag
        assert re.fullmatch("[0-9a-f]{4}", tag) and tag != other
        drafters = start_drafters(first, OUT_OF_VOCABULARY, DrafterSettings(draft_max=4))
        try:
            alive = alive_named_actors()
            for names in (expected("stage", tag, 2, "StageActor"), expected("stage", other, 2, "StageActor"),
                          expected("drafter", tag, 2, "DrafterActor")):
                assert names.items() <= alive.items(), (names, alive)
            # the names lead to the actors the pipeline drives
            assert ray.get(ray.get_actor(f"specpipe-stage-1.{tag}").describe.remote()) == first.stages[1]

            # a restart kills the old actor (alive here), whose name Ray frees only milliseconds
            # later: the new one takes another name
            first.restart_stage(1)
            drafters[0].speculate([1, 2, 3])
            assert drafters[0].collect(wait=True) == [] and "outside the vocabulary" in drafters[0].lost_reason
            assert drafters[0].replacement_ready.wait(120), drafters[0].lost_reason
            alive = alive_named_actors()
            assert alive[f"specpipe-stage-1.{tag}.r1"] == "StageActor"
            assert alive[f"specpipe-drafter-0.{tag}.r1"] == "DrafterActor"
            assert f"specpipe-stage-1.{tag}" not in alive and f"specpipe-drafter-0.{tag}" not in alive
        finally:
            stop_drafters(drafters)


def test_the_bench_starts_a_set_of_drafters_per_speculator_kind_beside_one_pipeline(ray_cluster, splits):
    """Two kinds in a scenario (speculators = ["model", "ngram"]) failed with
    ActorAlreadyExistsError: both sets were named specpipe-drafter-<i>.<tag>."""
    from benchmarks.suite import start_kinds
    from speculators.prompt_lookup import PromptLookupSpeculator

    with Pipeline(splits[2], SETTINGS) as pipeline:
        kinds = start_kinds(pipeline, {"model": OUT_OF_VOCABULARY, "ngram": PromptLookupSpeculator})
        try:
            assert all(client.alive for kind in kinds.values() for client in kind.drafters), kinds
            alive = alive_named_actors()
            for kind in ("model", "ngram"):
                assert expected(f"drafter-{kind}", pipeline.actors.tag, 2, "DrafterActor").items() <= alive.items()
        finally:
            for kind in kinds.values():
                kind.stop()
