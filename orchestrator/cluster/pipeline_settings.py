"""The one record of a pipeline's settings: which stages (files, or a whole
model to cut and ship), how every stage runs, where they are placed, how the
chain is wired and how often a lost stage is restarted, and how the pipeline
speculates. ``orchestrate run`` (RunSettings.pipeline), ``orchestrate serve``
(ServeSettings.pipeline) and the profile each hold one; the CLI builds it once
from the options they share (orchestrator.cli_options.PipelineOptions), and
``start`` is the one place a Pipeline is started from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from orchestrator.cluster.kept_stages import KeptStages
from orchestrator.cluster.model_files import WholeModelSettings, local_draft
from orchestrator.cluster.pipeline import Pipeline, StageRestart
from orchestrator.cluster.shipping import ModelToShip
from orchestrator.config import MAX_RESTARTS
from orchestrator.decoding.drafting import SpeculationSettings
from stages.settings import StageSettings


@dataclass(frozen=True)
class PipelineSettings:
    """stage_paths: each stage's file on the node that runs it ([] with
    whole_model: its stages are cut here and shipped). stage: every stage's
    llama.cpp settings. address: the Ray cluster (None: a local Ray).
    place: stage index -> node id pins (--place). max_restarts: of each stage
    (and drafter) that dies. tls: the chain and the drafters' sockets in TLS
    (orchestrator.transport.tls). dashboard: Ray's, with a local Ray."""

    stage_paths: list[str]
    stage: StageSettings
    speculation: SpeculationSettings = SpeculationSettings()
    whole_model: WholeModelSettings | None = None
    address: str | None = None
    place: dict[int, str] | None = None
    wire_dtype: str = "f32"
    dashboard: bool = False
    max_restarts: int = MAX_RESTARTS
    tls: bool = False

    def with_local_draft(self, on_status: Callable[[str], None] | None) -> PipelineSettings:
        """The same with an hf: draft model fetched to this machine (before Ray starts)."""
        draft = local_draft(self.speculation.draft_path, on_status)
        return dataclasses.replace(self, speculation=dataclasses.replace(self.speculation, draft_path=draft))

    def start(self, stages: list[str] | ModelToShip | None = None, *, overlapping: bool = False,
              on_restart: Callable[[StageRestart], None] | None = None, stage: StageSettings | None = None,
              prefer: dict[int, str] | None = None, kept: KeptStages | None = None) -> Pipeline:
        """The Pipeline of these settings, over ``stages`` (None: stage_paths;
        a whole model to ship); overlapping: passes of one sequence may be in
        flight together (async speculation); stage: other stage settings than
        ``self.stage`` (a token tree's KV ids); prefer and kept: serve's (Pipeline)."""
        return Pipeline(self.stage_paths if stages is None else stages, stage or self.stage, wire_dtype=self.wire_dtype, place=self.place, prefer=prefer,
                        max_restarts=self.max_restarts, on_restart=on_restart, tls=self.tls,
                        overlapping=overlapping, kept=kept)
