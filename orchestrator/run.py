"""One ``orchestrate run``: connect Ray, start the pipeline (and drafters), generate, report."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.cluster.connect import ray_session
from orchestrator.cluster.drafter_set import start_speculation
from orchestrator.cluster.drafters import drafter_compute, drafter_nodes, speculator_factory
from orchestrator.cluster.metrics import GenerationMetrics, RestartMetrics
from orchestrator.cluster.model_files import (RunError, check_same_model, local_vocabulary_file, transfer_progress,
                                              whole_model_stages)
from orchestrator.cluster.pipeline import ChainRelink, Pipeline, StageReport, StageRestart
from orchestrator.cluster.pipeline_settings import PipelineSettings
from orchestrator.cluster.shipping import Shipment
from orchestrator.decoding.drafting import exact_trees, tree_stage_settings
from orchestrator.decoding.loop import Generation, generate
from speculators.model import draft_gpu_layers
from speculators.sampling import SamplingSettings
from stages.stage_files import check_stage_files
from stages.tokenizer import Tokenizer

MIB = 1024**2


@dataclass(frozen=True)
class RunSettings:
    """Everything ``orchestrate run`` was asked to do: the pipeline's settings, and the prompt's."""

    pipeline: PipelineSettings
    prompt: str
    chat: bool | None  # the prompt in the model's chat template; None: where the model has one (--chat/--raw)
    max_tokens: int
    sampling: SamplingSettings


@dataclass(frozen=True)
class SpeculatorReport:
    """lost: why the drafter was last lost ("" if never); restarts: replacements that rejoined;
    compute: where its draft model computes (DrafterServer.compute; None: prompt lookup, or no answer);
    error: its speculator's last failure while drafting ("" if none: a failing one drafts nothing)."""

    index: int
    node_id: str
    busy_seconds: float
    lost: str
    restarts: int = 0
    compute: dict | None = None
    error: str = ""

    def trouble(self) -> str:
        """What went wrong with it, for the summary line ("" if nothing)."""
        parts = []
        if self.lost:
            parts.append(f"lost: {self.lost}")
        if self.error:
            parts.append(f"failed: {self.error}")
        return f"drafter {self.index} {'; '.join(parts)}" if parts else ""


@dataclass(frozen=True)
class RunOutcome:
    text: str
    generation: Generation
    stages: list[StageReport]
    speculators: list[SpeculatorReport]
    hop_seconds: float
    restarts: list[StageRestart]
    shipments: list[Shipment] = dataclasses.field(default_factory=list)
    cost_curve: str | None = None  # the emulated cost curve's name (--cost-curve): every time is emulated
    relinks: list[ChainRelink] = dataclasses.field(default_factory=list)  # the chain wired anew, no stage lost

    def as_json(self) -> dict:
        generation = self.generation
        stats = generation.speculation
        busy = dict(enumerate(zip(generation.busy_fractions, generation.discarded_shares)))
        return {
            "text": self.text,
            "tokens": generation.tokens,
            "prompt_tokens": len(generation.prompt_tokens),
            "tokens_per_second": generation.tokens_per_second,
            "seconds": generation.seconds,
            "stopped_by": generation.stopped_by,
            "hop_seconds": self.hop_seconds,
            "target_passes": generation.passes,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "accepted_length_histogram": {str(length): count for length, count in sorted(stats.accepted_lengths.items())},
            "target_input_length_histogram": {str(length): count for length, count in sorted(stats.input_lengths.items())},
            "draft_tokens_wasted": stats.wasted_tokens,
            "target_passes_discarded": stats.discarded_passes,
            "committed_tokens_per_pass": stats.committed_per_window,
            "tree_passes": stats.tree_passes,
            "tree_side_rows": stats.side_rows,
            "tree_side_accepted": stats.side_accepted,
            "refed_tokens": stats.refed_tokens,
            "cost_curve": self.cost_curve,
            "backend": ",".join(sorted({stage.compute.backend for stage in self.stages if stage.compute})) or None,
            "stages": [
                {
                    "layers": [stage.first_block, stage.end_block],
                    "node": stage.node_id,
                    "host": stage.host,
                    "busy_seconds": stage.busy_seconds,
                    # of the generation's wall time, its passes' compute; the share of that on discarded passes
                    "busy_fraction": busy[index][0] if index in busy else None,
                    "busy_discarded_share": busy[index][1] if index in busy else None,
                    "passes_dropped": stage.dropped_passes,
                    "passes_stopped": stage.stopped_passes,
                    **(stage.compute.record() if stage.compute else {}),
                }
                for index, stage in enumerate(self.stages)
            ],
            "speculators": [
                {"index": report.index, "node": report.node_id, "busy_seconds": report.busy_seconds, "lost": report.lost,
                 "restarts": report.restarts, "compute": report.compute, "error": report.error}
                for report in self.speculators
            ],
            "shipped": [
                {"what": shipment.what, "stage": shipment.stage_index if shipment.what == "stage" else None,
                 "node": shipment.node_id, "host": shipment.node_address,
                 "path": shipment.path, "bytes": shipment.size, "resumed_from": shipment.resumed_from,
                 "bytes_sent": shipment.bytes_sent, "seconds": shipment.seconds, "from": shipment.source,
                 "why_from_driver": shipment.note, "sha256": shipment.sha256}
                for shipment in self.shipments
            ],
            "restarts": [
                {"stage": restart.stage_index, "reason": restart.reason, "old_node": restart.old_node_id,
                 "node": restart.node_id, "seconds": restart.seconds, "replay_seconds": restart.replay_seconds}
                for restart in self.restarts
            ],
            "relinks": [{"reason": relink.reason, "seconds": relink.seconds, "replay_seconds": relink.replay_seconds}
                        for relink in self.relinks],
        }

    def summary_line(self) -> str:
        generation = self.generation
        placed = "; ".join(
            f"stage {stage.stage_index} blocks [{stage.first_block}, {stage.end_block}) on node "
            f"{stage.node_id[:8]} ({stage.host})"
            for stage in self.stages
        )
        speculation = ""
        if self.speculators:
            stats = generation.speculation
            speculation = (
                f", {generation.passes} target passes, acceptance {stats.acceptance_rate:.0%}"
                f" ({stats.accepted_tokens}/{stats.drafted_tokens} drafts)"
            )
        restarts = "".join(
            f"; stage {restart.stage_index} restarted after it died ({restart.reason}) in {restart.seconds:.1f} s"
            for restart in self.restarts
        ) + "".join(f"; the chain wired anew, every stage alive ({relink.reason}), in {relink.seconds:.1f} s"
                    for relink in self.relinks)
        emulated = f" (emulated: {self.cost_curve})" if self.cost_curve else ""
        restarts += "".join(f"; {trouble}" for report in self.speculators if (trouble := report.trouble()))
        return (
            f"[{len(generation.tokens)} tokens, {generation.tokens_per_second:.1f} tokens/s{emulated}{speculation}, "
            f"{len(self.stages)} stages: {placed}; hop {self.hop_seconds * 1e6:.0f} us{restarts}]"
        )


def prompt_tokens(tokenizer: Tokenizer, prompt: str, chat: bool | None) -> list[int]:
    """The prompt's tokens: in the model's chat template (chat None: where the
    model has one, as llama.cpp's CLI does), or the text as it is."""
    if chat is None:
        chat = bool(tokenizer.chat_template)
    return tokenizer.chat_prompt(prompt) if chat else tokenizer.tokenize(prompt)


def run_generation(
    settings: RunSettings,
    on_text: Callable[[str], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> RunOutcome:
    """Connect Ray, start the pipeline (shipping the stages with --model) and
    the drafters, generate, and report what each part did."""
    settings = dataclasses.replace(settings, pipeline=settings.pipeline.with_local_draft(on_status))
    pipeline_settings = settings.pipeline
    whole = pipeline_settings.whole_model
    if whole is None and pipeline_settings.address is None:  # a local run: bad files fail before Ray starts
        check_stage_files(pipeline_settings.stage_paths)
    # On a cluster each file is checked on the node that runs its stage (Pipeline).
    vocabulary_path = whole.vocabulary_path if whole is not None else local_vocabulary_file(pipeline_settings.stage_paths)
    prepared = _prepare(settings, Tokenizer(vocabulary_path)) if vocabulary_path else None
    speculation = pipeline_settings.speculation
    with ray_session(pipeline_settings.address, dashboard=pipeline_settings.dashboard) as where:
        if where and on_status is not None:
            on_status(f"[{where}]")
        drafter_nodes(speculation.drafter_nodes)  # a node not alive fails before the stages load
        restart_metrics = RestartMetrics()
        stage_settings = tree_stage_settings(pipeline_settings.stage, speculation.tree_leaves)
        stages = None if whole is None else whole_model_stages(whole, stage_settings, speculation.draft_path, on_status)
        if stages is None:  # stage files given, or one unsplit file for a one-node cluster
            stages, whole = pipeline_settings.stage_paths or [whole.path], None
        with pipeline_settings.start(stages, stage=stage_settings, overlapping=speculation.asynchronous,
                                     on_restart=_restart_reporter(restart_metrics, on_status)) as pipeline:
            check_same_model(vocabulary_path if whole is None else None, pipeline.stage_files)
            if prepared is None:  # no stage file here: the vocabulary comes from stage 0's node
                prepared = _prepare(settings, Tokenizer(pipeline.vocabulary_file()))
            return _generate_through(pipeline, settings, prepared, restart_metrics, on_text, on_status)


def _restart_reporter(restart_metrics: RestartMetrics, on_status: Callable[[str], None] | None):
    def stage_restarted(restart: StageRestart) -> None:
        restart_metrics.record("stage", restart.stage_index)
        if on_status is not None:
            on_status(f"[stage {restart.stage_index} died ({restart.reason}); restarted and replayed "
                      f"in {restart.seconds:.1f} s]")

    return stage_restarted


class _StreamedText:
    """The generated text, streamed token by token (on_text) and kept whole."""

    def __init__(self, tokenizer: Tokenizer, on_text: Callable[[str], None] | None):
        self.stream = tokenizer.text_stream()
        self.on_text = on_text
        self.pieces: list[str] = []

    def push(self, token: int) -> None:
        self._add(self.stream.push(token))

    def finish(self) -> str:
        self._add(self.stream.finish())
        return "".join(self.pieces)

    def _add(self, text: str) -> None:
        self.pieces.append(text)
        if self.on_text is not None and text:
            self.on_text(text)


def _generate_through(pipeline: Pipeline, settings: RunSettings, prepared, restart_metrics: RestartMetrics,
                      on_text: Callable[[str], None] | None, on_status: Callable[[str], None] | None) -> RunOutcome:
    """Start the drafters beside the stages (with a speculator; a draft model
    shipped to their nodes first), generate, stop them, and report."""
    tokenizer, tokens, make_speculator = prepared
    speculation = exact_trees(settings.pipeline.speculation, pipeline.inexact_tree_stages(), on_status)
    text = _StreamedText(tokenizer, on_text)
    drafter_set = None
    drafting = None
    if make_speculator is not None:
        pass_seconds, step, curve = pipeline.speculation_costs(trees=speculation.tree_leaves > 1)
        drafter_set = start_speculation(
            pipeline, speculation, make_speculator, tokens, pass_seconds, max_restarts=settings.pipeline.max_restarts,
            on_restart=lambda index: restart_metrics.record("drafter", index),
            progress=transfer_progress(on_status, lambda _: "the draft model"))
    drafters = drafter_set.drafters if drafter_set is not None else []
    live = GenerationMetrics()
    try:
        if drafter_set is not None:
            drafting = drafter_set.drafting(speculation.schedule, speculation.draft_max, step=step,
                                            tree_leaves=speculation.tree_leaves, pass_curve=curve,
                                            coupled=speculation.draft_sampling == "coupled")
        generation = generate(
            pipeline, tokens, settings.max_tokens, settings.sampling, tokenizer.is_end, on_token=text.push,
            drafting=drafting,
            on_pass=lambda running, committed: live.record(running, committed, pipeline.hop_seconds, drafters),
        )
    finally:
        speculator_reports = [SpeculatorReport(client.index, client.node_id, client.busy_seconds, client.lost_reason,
                                               client.restarts, drafter_compute(client), client.last_error)
                              for client in drafters]
        if drafter_set is not None:
            drafter_set.stop()
    curve = settings.pipeline.stage.cost_curve
    drafts_shipped = {client.draft_shipment.node_id: client.draft_shipment for client in drafters
                      if client.draft_shipment is not None}
    return RunOutcome(text.finish(), generation, pipeline.reports(), speculator_reports, pipeline.hop_seconds,
                      list(pipeline.restarts), [*pipeline.shipments, *drafts_shipped.values()],
                      curve.name if curve else None, list(pipeline.relinks))


def _prepare(settings: RunSettings, tokenizer: Tokenizer):
    """(tokenizer, the prompt's tokens, the speculator factory), once the
    vocabulary is here: a prompt that does not fit and a draft model of
    another vocabulary are refused before anything generates."""
    tokens = prompt_tokens(tokenizer, settings.prompt, settings.chat)
    if not tokens:
        raise RunError("the prompt is empty")
    pipeline = settings.pipeline
    speculation = pipeline.speculation
    cells = speculation.draft_room  # a token tree's rows each hold a KV cell while its pass runs, however shallow
    reserve = f" + {cells} cells for a token tree's rows" if speculation.tree_leaves > 1 else f" + --draft-max {cells}"
    if len(tokens) + settings.max_tokens + cells > pipeline.stage.n_ctx:
        raise RunError(
            f"prompt ({len(tokens)} tokens) + --max-tokens {settings.max_tokens}"
            f"{reserve if cells else ''} exceed the context of "
            f"{pipeline.stage.n_ctx} tokens; raise --n-ctx or lower --max-tokens"
        )
    if speculation.speculator == "model" and pipeline.address is None:
        draft_gpu_layers(speculation.draft_device)  # a local run's drafters use this build: no GPU, no gpu
    return tokenizer, tokens, speculator_factory(speculation, tokenizer, pipeline.stage)
