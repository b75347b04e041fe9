"""One ``orchestrate run``: connect Ray, start the pipeline (and drafters), generate, report."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.cluster import ray_session
from orchestrator.defaults import DRAFT_MAX, MAX_RESTARTS
from orchestrator.drafters import DrafterClient, DrafterSettings, start_drafters, stop_drafters
from orchestrator.generate import Drafting, Generation, generate
from orchestrator.metrics import GenerationMetrics, RestartMetrics
from orchestrator.pipeline import Pipeline, StageReport, StageRestart
from orchestrator.schedule import Schedule
from orchestrator.shipping import Shipment, WholeModel
from orchestrator.tokenizer import Tokenizer
from speculators.draft_length import PRIOR_STEP, ask_cost
from speculators.sampling import SamplingSettings
from stages.engine import StageError
from stages.errors import SpecpipeError
from stages.gguf_file import ModelFileError, StageFileInfo, stage_info_of
from stages.settings import StageSettings
from stages.stage_files import check_stage_files

SPECULATORS = ("none", "ngram", "model")
MIB = 1024**2


class RunError(SpecpipeError):
    """A run that cannot be done as asked; the message is one line."""


@dataclass(frozen=True)
class SpeculationSettings:
    """speculator: none, ngram (prompt lookup) or model (draft_path, a whole GGUF model).
    schedule: async (draft on idle machines) or sync (draft, then verify).
    draft_max: most draft tokens per target pass; draft_p_min: a model draft stops
    below this probability; overlap: draft even while the machine's own stage runs.
    tree_leaves: above 1, prompt lookup drafts token trees of up to that many
    leaves (speculators.tree) and every stage holds as many KV ids less one."""

    speculator: str = "none"
    draft_path: str | None = None
    schedule: Schedule = Schedule.ASYNC
    draft_max: int = DRAFT_MAX
    draft_p_min: float = 0.0
    overlap: bool = False
    tree_leaves: int = 1


@dataclass(frozen=True)
class RunSettings:
    """Everything ``orchestrate run`` was asked to do."""

    stage_paths: list[str]
    prompt: str
    chat: bool
    max_tokens: int
    sampling: SamplingSettings
    stage: StageSettings
    speculation: SpeculationSettings = SpeculationSettings()
    address: str | None = None
    place: dict[int, str] | None = None
    wire_dtype: str = "f32"
    dashboard: bool = False
    max_restarts: int = MAX_RESTARTS  # of each stage (and drafter) that dies
    tls: bool = False  # the chain and the drafters' sockets in TLS (orchestrator.tls)
    whole_model: WholeModelSettings | None = None  # --model: stage_paths is empty, the stages are shipped


@dataclass(frozen=True)
class WholeModelSettings:
    """``--model PATH``: the whole model on this machine, cut into ``stages``
    (None: one per node the cluster has) and shipped to the nodes.
    boundaries: first blocks of stages 2..n (None: chosen for the nodes'
    memory, orchestrator.planning.cluster_split); profiles: node address ->
    its ``orchestrate profile``, for the nodes' speeds."""

    path: str
    stages: int | None = None
    boundaries: list[int] | None = None
    profiles: dict[str, dict] | None = None
    single_file: bool = False  # given as the one file of --model-split: on a single node it runs as it is


@dataclass(frozen=True)
class SpeculatorReport:
    """lost: why the drafter was last lost ("" if never); restarts: replacements that rejoined."""

    index: int
    node_id: str
    busy_seconds: float
    lost: str
    restarts: int = 0


@dataclass(frozen=True)
class RunOutcome:
    text: str
    generation: Generation
    stages: list[StageReport]
    speculators: list[SpeculatorReport]
    hop_seconds: float
    restarts: list[StageRestart]
    shipments: list[Shipment] = dataclasses.field(default_factory=list)

    def as_json(self) -> dict:
        generation = self.generation
        stats = generation.speculation
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
            "stages": [
                {
                    "layers": [stage.first_block, stage.end_block],
                    "node": stage.node_id,
                    "host": stage.host,
                    "busy_seconds": stage.busy_seconds,
                    "passes_dropped": stage.dropped_passes,
                    "passes_stopped": stage.stopped_passes,
                }
                for stage in self.stages
            ],
            "speculators": [
                {"index": report.index, "node": report.node_id, "busy_seconds": report.busy_seconds, "lost": report.lost,
                 "restarts": report.restarts}
                for report in self.speculators
            ],
            "shipped": [
                {"stage": shipment.stage_index, "node": shipment.node_id, "host": shipment.node_address,
                 "path": shipment.path, "bytes": shipment.size, "resumed_from": shipment.resumed_from,
                 "bytes_sent": shipment.bytes_sent, "seconds": shipment.seconds}
                for shipment in self.shipments
            ],
            "restarts": [
                {"stage": restart.stage_index, "reason": restart.reason, "old_node": restart.old_node_id,
                 "node": restart.node_id, "seconds": restart.seconds, "replay_seconds": restart.replay_seconds}
                for restart in self.restarts
            ],
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
        )
        return (
            f"[{len(generation.tokens)} tokens, {generation.tokens_per_second:.1f} tokens/s{speculation}, "
            f"{len(self.stages)} stages: {placed}; hop {self.hop_seconds * 1e6:.0f} us{restarts}]"
        )


def prompt_tokens(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    return tokenizer.chat_prompt(prompt) if chat else tokenizer.tokenize(prompt)


def speculator_factory(settings: SpeculationSettings, tokenizer: Tokenizer, stage: StageSettings):
    """A picklable function building the speculator inside each drafter actor.

    Checks a draft model before anything runs: it must exist and share the
    target's vocabulary token for token."""
    from speculators.model import ModelSpeculator
    from speculators.prompt_lookup import PromptLookupSpeculator

    if settings.speculator not in SPECULATORS:
        raise ValueError(f"unknown speculator {settings.speculator!r} (choose {', '.join(SPECULATORS)})")
    if settings.speculator == "ngram":
        return PromptLookupSpeculator
    if settings.speculator == "model":
        if not settings.draft_path:
            raise ValueError("--speculator model needs --draft DRAFT.gguf")
        check_draft_model(settings.draft_path, tokenizer)
        return functools.partial(
            ModelSpeculator, settings.draft_path, p_min=settings.draft_p_min, n_ctx=stage.n_ctx, threads=stage.threads
        )
    return None


def make_drafting(kind: str, drafters: list, schedule: Schedule, draft_max: int, make_speculator,
                  step: float = PRIOR_STEP, tree_leaves: int = 1) -> Drafting:
    """The Drafting of a run: prompt lookup is asked before a window in this
    process (no round trip; the actors beside the stages still relay in
    async), a draft model beside stage 0. step: Pipeline.draft_step's.
    tree_leaves: prompt lookup's trees (a draft model drafts chains)."""
    from orchestrator.interfaces import InstantDrafter

    if kind == "ngram":
        return Drafting(drafters, schedule, draft_max, first=InstantDrafter(make_speculator(), draft_max),
                        call_cost=ask_cost(kind), step=step, tree_leaves=tree_leaves)
    if tree_leaves > 1:
        raise RunError("token trees are drafted by prompt lookup (--speculator ngram); a draft model drafts chains")
    return Drafting(drafters, schedule, draft_max, call_cost=ask_cost(kind), step=step)


def check_draft_model(path: str, tokenizer: Tokenizer) -> None:
    """A draft model must be a whole model with the target's vocabulary, token for token."""
    info = check_stage_files([path])[0]
    if info is not None:
        raise ModelFileError(f"{path}: a draft model must be a whole model, not a stage file")
    if Tokenizer(path).vocabulary_digest() != tokenizer.vocabulary_digest():
        raise StageError(f"{path}: the draft model's vocabulary differs from the target's; "
                         "draft tokens would mean different text")


def local_vocabulary_file(stage_paths: list[str]) -> str | None:
    """The first stage file on this machine (every stage file carries the whole
    vocabulary), or None: then the coordinator reads the vocabulary from stage
    0's node once the pipeline is placed (Pipeline.vocabulary_file)."""
    return next((path for path in stage_paths if os.path.exists(path)), None)


def check_same_model(vocabulary_path: str | None, stage_files: list[StageFileInfo | None]) -> None:
    """The local file the vocabulary came from must be cut from the model the nodes run."""
    local = stage_info_of(vocabulary_path) if vocabulary_path is not None else None
    on_nodes = stage_files[0]
    if local is not None and on_nodes is not None and local.source_fingerprint != on_nodes.source_fingerprint:
        raise ModelFileError(
            f"{vocabulary_path} on this machine was cut from another model ({local.source_name}) than "
            f"the stage files on the nodes ({on_nodes.source_name})"
        )


def whole_model_stages(settings: WholeModelSettings, stage: StageSettings, draft_path: str | None,
                       on_status: Callable[[str], None] | None) -> WholeModel | None:
    """What Pipeline needs to cut ``settings.path`` and ship its stages: how many, and where to cut for the nodes."""
    from orchestrator.cluster import alive_nodes
    from orchestrator.planning.cluster_split import choose_cluster_split
    from orchestrator.planning.setup_file import model_shape_of_gguf
    from stages.gguf_file import read_model
    from stages.layer_rules import layer_rules

    model = read_model(settings.path)
    if stage_info_of(settings.path) is not None:
        raise ModelFileError(f"{settings.path}: is a stage file; --model takes the whole model")
    stage_count = settings.stages or max(1, len(alive_nodes()))
    if settings.single_file and stage_count == 1:
        return None
    if stage_count > model.block_count:
        raise RunError(f"{stage_count} stages but {settings.path} has only {model.block_count} blocks; give --stages")

    def choose_starts(nodes) -> tuple[int, ...]:
        if settings.boundaries is not None:
            return (0, *settings.boundaries)
        shape = model_shape_of_gguf(settings.path)
        draft_bytes = os.path.getsize(draft_path) if draft_path else 0
        split = choose_cluster_split(shape, nodes, context=stage.n_ctx * stage.sequences, draft_bytes=draft_bytes,
                                     boundaries=layer_rules(model.metadata).allowed_boundaries(),
                                     profiles=settings.profiles)
        if on_status is not None:
            for line in split.lines(shape.blocks, nodes):
                on_status(line)
        return split.starts

    shown: dict[int, int] = {}  # stage -> the last tenth of its file shown

    def progress(stage_index: int, done: int, total: int) -> None:
        tenth = done * 10 // total
        if on_status is not None and tenth > shown.get(stage_index, -1):
            shown[stage_index] = tenth
            on_status(f"shipping stage {stage_index}: {done / MIB:.0f} of {total / MIB:.0f} MiB")

    return WholeModel(settings.path, stage_count, choose_starts, progress)


def run_generation(
    settings: RunSettings,
    on_text: Callable[[str], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> RunOutcome:
    whole = settings.whole_model
    if whole is None and settings.address is None:  # a local run: bad files fail before Ray starts
        check_stage_files(settings.stage_paths)
    # On a cluster each file is checked on the node that runs its stage (Pipeline).
    vocabulary_path = whole.path if whole is not None else local_vocabulary_file(settings.stage_paths)
    prepared = _prepare(settings, Tokenizer(vocabulary_path)) if vocabulary_path else None
    pieces: list[str] = []
    speculation_settings = settings.speculation
    asynchronous = speculation_settings.speculator != "none" and speculation_settings.schedule is Schedule.ASYNC
    with ray_session(settings.address, dashboard=settings.dashboard) as where:
        if where and on_status is not None:
            on_status(f"[{where}]")
        restart_metrics = RestartMetrics()

        def stage_restarted(restart: StageRestart) -> None:
            restart_metrics.record("stage", restart.stage_index)
            if on_status is not None:
                on_status(f"[stage {restart.stage_index} died ({restart.reason}); restarted and replayed "
                          f"in {restart.seconds:.1f} s]")

        stage_settings = settings.stage
        if speculation_settings.tree_leaves > 1:
            stage_settings = dataclasses.replace(stage_settings, tree_sequences=speculation_settings.tree_leaves - 1)
        stages = None if whole is None else whole_model_stages(
            whole, stage_settings, speculation_settings.draft_path, on_status)
        if stages is None:  # stage files given, or one unsplit file for a one-node cluster
            stages, whole = settings.stage_paths or [whole.path], None
        with Pipeline(
            stages, stage_settings, wire_dtype=settings.wire_dtype, place=settings.place,
            notify_boundaries=asynchronous, max_restarts=settings.max_restarts, on_restart=stage_restarted,
            tls=settings.tls, overlapping=asynchronous,
        ) as pipeline:
            check_same_model(vocabulary_path if whole is None else None, pipeline.stage_files)
            if prepared is None:  # no stage file here: the vocabulary comes from stage 0's node
                prepared = _prepare(settings, Tokenizer(pipeline.vocabulary_file()))
            tokenizer, tokens, make_speculator = prepared
            stream = tokenizer.text_stream()

            def emit(token: int) -> None:
                text = stream.push(token)
                pieces.append(text)
                if on_text is not None and text:
                    on_text(text)

            drafters: list[DrafterClient] = []
            drafting = None
            if make_speculator is not None:
                drafters = start_drafters(
                    pipeline, make_speculator,
                    DrafterSettings(draft_max=speculation_settings.draft_max, overlap=speculation_settings.overlap,
                                    max_restarts=settings.max_restarts),
                    on_restart=lambda index: restart_metrics.record("drafter", index),
                )
                drafting = make_drafting(speculation_settings.speculator, drafters, speculation_settings.schedule,
                                         speculation_settings.draft_max, make_speculator, pipeline.draft_step(),
                                         speculation_settings.tree_leaves)
            live = GenerationMetrics()
            try:
                generation = generate(
                    pipeline, tokens, settings.max_tokens, settings.sampling, tokenizer.is_end,
                    on_token=emit, drafting=drafting,
                    on_pass=lambda running, committed: live.record(running, committed, pipeline.hop_seconds, drafters),
                )
            finally:
                speculator_reports = [
                    SpeculatorReport(client.index, client.node_id, client.busy_seconds,
                                     client.lost_reason, client.restarts)
                    for client in drafters
                ]
                stop_drafters(drafters)
            reports = pipeline.reports()
            hop_seconds = pipeline.hop_seconds
            restarts = list(pipeline.restarts)
            shipments = list(pipeline.shipments)
    tail = stream.finish()
    pieces.append(tail)
    if on_text is not None and tail:
        on_text(tail)
    return RunOutcome("".join(pieces), generation, reports, speculator_reports, hop_seconds, restarts, shipments)


def _prepare(settings: RunSettings, tokenizer: Tokenizer):
    """(tokenizer, the prompt's tokens, the speculator factory), once the
    vocabulary is here: a prompt that does not fit and a draft model of
    another vocabulary are refused before anything generates."""
    tokens = prompt_tokens(tokenizer, settings.prompt, settings.chat)
    if not tokens:
        raise RunError("the prompt is empty")
    drafts = settings.speculation.draft_max if settings.speculation.speculator != "none" else 0
    if len(tokens) + settings.max_tokens + drafts > settings.stage.n_ctx:
        raise RunError(
            f"prompt ({len(tokens)} tokens) + --max-tokens {settings.max_tokens}"
            f"{f' + --draft-max {drafts}' if drafts else ''} exceed the context of "
            f"{settings.stage.n_ctx} tokens; raise --n-ctx or lower --max-tokens"
        )
    return tokenizer, tokens, speculator_factory(settings.speculation, tokenizer, settings.stage)
