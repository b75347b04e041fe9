"""The Serve replica's health check (orchestrator.serving.deployment.Coordinator):
once the pipeline failed for good it removes the stages before it fails, so
that the replica Serve starts next loads fresh ones instead of taking over
these (they outlive a replica: orchestrator.cluster.kept_stages)."""

from __future__ import annotations

import pytest

from orchestrator.cluster.pipeline_settings import PipelineSettings
from orchestrator.serving.deployment import Coordinator, ServeSettings
from stages.settings import StageSettings


class Part:
    def __init__(self, failure: str = ""):
        self.failure = failure
        self.closed = 0

    def close(self, *_) -> None:
        self.closed += 1


def coordinator(failure: str) -> Coordinator:
    made = object.__new__(Coordinator)  # its parts, without Ray
    made.settings = ServeSettings(PipelineSettings(["stage-0.gguf"], StageSettings()), queue_limit=1)
    made.service, made.pipeline, made.drafters, made._closed = Part(failure), Part(), [], False
    return made


def test_a_failed_pipeline_s_stages_are_removed_before_the_health_check_fails():
    failed = coordinator("stage 1 does not answer within 10 s (hung or stopped)")
    with pytest.raises(RuntimeError, match="hung or stopped"):
        failed.check_health()
    assert failed.pipeline.closed == 1 and failed.service.closed == 1
    with pytest.raises(RuntimeError):
        failed.check_health()  # asked again: closed once
    assert failed.pipeline.closed == 1


def test_a_healthy_replica_keeps_its_stages():
    healthy = coordinator("")
    healthy.check_health()
    assert healthy.pipeline.closed == 0


def test_a_choice_cancel_sent_to_an_earlier_coordinator_is_ignored():
    """A new coordinator numbers its requests from 1 again: a cancel that an
    earlier one was sent, reaching this one late, would stop another request's choice."""
    made = coordinator("")
    made.incarnation = "this one"
    cancelled = []
    made.service.cancel_choice = lambda number, choice: cancelled.append((number, choice))
    made.cancel_choice(("an earlier one", 1), 0)
    made.cancel_choice(("this one", 1), 0)
    assert cancelled == [(1, 0)]


def test_serve_names_its_node_and_away_from_ray_s_head_says_that_losing_it_ends_the_service():
    from orchestrator.serving.deployment import HEAD_RESOURCE, where_serve_runs

    nodes = [{"NodeID": "h", "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2.0, HEAD_RESOURCE: 1.0}},
             {"NodeID": "w", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0}}]
    assert where_serve_runs(nodes, "h").endswith("on this node (10.0.0.1), Ray's head]")
    warning = where_serve_runs(nodes, "w")
    assert "(10.0.0.2) is not Ray's head" in warning and "losing it ends the service" in warning
