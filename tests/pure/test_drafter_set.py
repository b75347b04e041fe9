"""start_speculation (orchestrator.cluster.drafter_set): run's and serve's
one step from a pipeline's SpeculationSettings to drafters started and
priced; a failed pricing leaves no drafter running. Ray's side is stood in
for here (the drafters' module functions); tests/ray/test_cli_runs.py and
test_serve_drafters.py run it on Ray."""

import types

import pytest

from orchestrator.cluster import drafter_set as module
from orchestrator.decoding.drafting import SpeculationSettings
from speculators.draft_length import DraftPrices
from stages.settings import StageSettings


@pytest.fixture
def started(monkeypatch):
    """What start_drafters was asked, and the clients it stopped."""
    seen = types.SimpleNamespace(settings=None, kind=None, stopped=None, prices_after=None)

    def start_drafters(pipeline, make, settings, *, on_restart, kind, progress):
        seen.settings, seen.kind = settings, kind
        return ["drafter 0", "drafter 1"]

    monkeypatch.setattr(module, "start_drafters", start_drafters)
    monkeypatch.setattr(module, "stop_drafters", lambda drafters: setattr(seen, "stopped", drafters))
    return seen


PIPELINE = types.SimpleNamespace(settings=StageSettings(n_ctx=256))


def test_the_drafters_settings_come_from_the_speculation_and_the_prices_are_measured(started, monkeypatch):
    def prices(kind, pipeline, drafters, context, pass_seconds):
        started.prices_after = (kind, context, pass_seconds)
        return DraftPrices(awaited=0.2, relayed=0.01)

    monkeypatch.setattr(module, "draft_prices", prices)
    speculation = SpeculationSettings("ngram", draft_max=5)
    drafters = module.start_speculation(PIPELINE, speculation, object, [1, 2, 3], 0.04, max_restarts=2, sequences=3)
    assert drafters.kind == "ngram" and drafters.drafters == ["drafter 0", "drafter 1"]
    assert (started.settings.draft_max, started.settings.max_restarts, started.settings.sequences) == (5, 2, 3)
    assert started.kind == ""  # one set beside the pipeline: actors named without the kind
    assert started.prices_after == ("ngram", [1, 2, 3], 0.04)
    assert drafters.prices == DraftPrices(awaited=0.2, relayed=0.01) and started.stopped is None


def test_a_pricing_that_fails_stops_the_drafters(started, monkeypatch):
    def fails(*args):
        raise RuntimeError("drafter 0 did not answer")

    monkeypatch.setattr(module, "draft_prices", fails)
    with pytest.raises(RuntimeError, match="did not answer"):
        module.start_speculation(PIPELINE, SpeculationSettings("ngram"), object, [1], 0.04, max_restarts=1)
    assert started.stopped == ["drafter 0", "drafter 1"]

    def stop_fails(drafters):  # Ray going down beside it: still the pricing's failure is told
        raise RuntimeError("Ray is shutting down")

    monkeypatch.setattr(module, "stop_drafters", stop_fails)
    with pytest.raises(RuntimeError, match="did not answer"):
        module.start_speculation(PIPELINE, SpeculationSettings("ngram"), object, [1], 0.04, max_restarts=1)


def test_a_draft_models_drafters_are_sized_by_the_pipelines_stage_settings(started, monkeypatch):
    """Serve's sequences and the stages' context (Pipeline.settings, the
    settings the stages run with) size each drafter's draft model."""
    from orchestrator.cluster import model_files

    sized = []
    monkeypatch.setattr(model_files, "draft_memory_bytes", lambda path, positions: sized.append((path, positions)) or 7)
    monkeypatch.setattr(module, "draft_prices", lambda *args: DraftPrices())
    speculation = SpeculationSettings("model", "draft.gguf", draft_max=4)
    module.start_speculation(PIPELINE, speculation, object, [1], 0.04, max_restarts=1, sequences=3)
    assert sized == [("draft.gguf", (256 + 4) * 3)] and started.settings.memory_bytes == 7
    assert started.settings.draft_path == "draft.gguf"
