"""Which model files a run or a service uses: the stage files given, or the
whole model to cut on the driver and ship to the nodes; where the
coordinator's vocabulary comes from; the check of a draft model; what a
model's KV cache and a draft model take in memory."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.cluster.fetching import StageFetcher
from orchestrator.cluster.node_liveness import alive_nodes
from orchestrator.cluster.shipping import ModelToShip, write_vocabulary_file
from orchestrator.cluster.stage_cache import draft_entry, stage_cache_root
from orchestrator.config import DRAFT_FETCH_PROGRESS_SECONDS, MEMORY_HEADROOM
from orchestrator.planning.cluster_split import choose_cluster_split
from orchestrator.planning.loaders import kv_bytes_per_token, model_shape_of_gguf
from orchestrator.sources.hub import read_model_source
from orchestrator.sources.hub_reference import is_hub_source
from stages.engine import StageError
from stages.errors import SpecpipeError
from stages.gguf_file import ModelFile, ModelFileError, StageFileInfo, read_model, stage_info, stage_info_of
from stages.layer_rules import layer_rules
from stages.settings import ALL_LAYERS, StageSettings
from stages.stage_files import check_stage_files
from stages.stage_image import SourceRange, StageImage, vocabulary_image
from stages.tokenizer import Tokenizer

MIB = 1024**2


class RunError(SpecpipeError):
    """A run that cannot be done as asked; the message is one line."""


@dataclass(frozen=True)
class WholeModelSettings:
    """``--model PATH``: the whole model on this machine, or an ``hf:`` source
    (orchestrator.sources.hub), cut into ``stages`` (None: one per node the
    cluster has) and shipped to the nodes, or from a source fetched by them.
    boundaries: first blocks of stages 2..n (None: chosen for the nodes'
    memory, orchestrator.planning.cluster_split); profiles: node address ->
    its ``orchestrate profile``, for the nodes' speeds."""

    path: str
    stages: int | None = None
    boundaries: list[int] | None = None
    profiles: dict[str, dict] | None = None
    single_file: bool = False  # given as the one file of --model-split: on a single node it runs as it is
    source: ModelFile | None = None  # an hf: source's header, read once (with_source); its tensors are RemoteFiles
    vocabulary: str | None = None  # with source: its metadata in a file on this machine, for the tokenizer

    def model(self) -> ModelFile:
        return self.source if self.source is not None else read_model(self.path)

    @property
    def vocabulary_path(self) -> str:
        """A file on this machine the coordinator's tokenizer can load."""
        return self.vocabulary or self.path


def with_source(settings: WholeModelSettings) -> WholeModelSettings:
    """An ``hf:`` source resolved and its header read, on the driver, before
    anything is placed (one-line errors: orchestrator.sources.hub); a local path as it is."""

    if not is_hub_source(settings.path):
        return settings
    source = read_model_source(settings.path)
    if isinstance(source.paths[0], Path):  # HF_HUB_OFFLINE: the copy in huggingface_hub's cache
        return replace(settings, path=str(source.paths[0]))
    return replace(settings, source=source, vocabulary=write_vocabulary_file(vocabulary_image(source).header))


def local_draft(text: str | None, on_status: Callable[[str], None] | None = None) -> str | None:
    """``--draft``: a file here as it is, or an ``hf:`` source fetched whole
    into this machine's stage cache first (by HTTP range, resumed, kept under
    the draft's fingerprint: a second run fetches nothing), from where it is
    checked and shipped to the drafters' nodes as any draft. One-line errors
    (orchestrator.sources.hub) before anything starts."""

    if text is None or not is_hub_source(text):
        return text
    model = read_model_source(text)
    if len(model.paths) != 1:
        raise ModelFileError(f"{text}: a draft model must be one file, not {len(model.paths)} shards")
    source = model.paths[0]
    if isinstance(source, Path):  # HF_HUB_OFFLINE: the copy in huggingface_hub's cache
        return str(source)
    fetcher = StageFetcher(stage_cache_root(), draft_entry(model),
                           StageImage(b"", (SourceRange(source, 0, source.size),)))
    progress = transfer_progress(on_status, lambda _: f"the draft model {text}")
    finished = threading.Event()

    def report() -> None:
        while not finished.wait(DRAFT_FETCH_PROGRESS_SECONDS):
            progress(0, fetcher.done, fetcher.size, "fetching")

    threading.Thread(target=report, name="draft-fetch-progress", daemon=True).start()
    try:
        fetched = fetcher.fetch()
    finally:
        finished.set()
    if fetched.bytes_fetched:
        progress(0, fetcher.size, fetcher.size, "fetching")
    return fetched.path


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


def kv_bytes_per_sequence(path: str, context: int) -> int:
    """KV cache bytes one sequence of ``context`` positions takes in the
    model file at path (a stage file, a whole model, or a vocabulary file:
    its metadata is enough)."""
    model = read_model(path)
    return model.block_count * kv_bytes_per_token(model.metadata, model.architecture) * context


def draft_memory_bytes(path: str | None, positions: int) -> int:
    """What a draft model holds on each machine it drafts on: its file, and
    its KV cache for ``positions`` (its context times the requests it drafts for); 0 without one."""
    return os.path.getsize(path) + kv_bytes_per_sequence(path, positions) if path else 0


def check_memory_available(needed: int, what: str, where: str) -> None:
    """Raise StageError, one line, unless ``needed`` bytes fit within
    MEMORY_HEADROOM of the memory this machine (``where``, for the message) has available now."""
    import psutil


    available = psutil.virtual_memory().available
    if needed > MEMORY_HEADROOM * available:
        raise StageError(f"{what} needs {needed / 2**20:.0f} MiB, but {where} has {available / 2**20:.0f} MiB "
                         f"available (at most {MEMORY_HEADROOM:.0%} of it is used)")


def whole_model_stages(settings: WholeModelSettings, stage: StageSettings, draft_path: str | None,
                       on_status: Callable[[str], None] | None) -> ModelToShip | None:
    """What Pipeline needs to cut ``settings.path`` and ship its stages: how many, and where to cut for the nodes."""

    model = settings.model()
    if stage_info(model) is not None:
        raise ModelFileError(f"{settings.path}: is a stage file; --model takes the whole model")
    stage_count = settings.stages or max(1, len(alive_nodes()))
    if settings.single_file and stage_count == 1:
        return None
    if stage_count > model.block_count:
        raise RunError(f"{stage_count} stages but {settings.path} has only {model.block_count} blocks; give --stages")

    offloaded = stage.n_gpu_layers == ALL_LAYERS  # partly offloaded stages are fitted to host memory

    def choose_starts(nodes) -> tuple[int, ...]:
        if settings.boundaries is not None:
            return (0, *settings.boundaries)
        shape = model_shape_of_gguf(model)
        draft_bytes = draft_memory_bytes(draft_path, stage.n_ctx * stage.sequences)
        split = choose_cluster_split(shape, nodes, context=stage.n_ctx * stage.sequences, draft_bytes=draft_bytes,
                                     boundaries=layer_rules(model.metadata).allowed_boundaries(),
                                     profiles=settings.profiles, offloaded=offloaded)
        if on_status is not None:
            for line in split.lines(shape.blocks, nodes, offloaded):
                on_status(line)
        return split.starts

    progress = transfer_progress(on_status, lambda stage_index: f"stage {stage_index}")
    return ModelToShip(model, stage_count, choose_starts, settings.vocabulary_path, progress, offloaded)


def transfer_progress(on_status: Callable[[str], None] | None, named: Callable[[int], str]):
    """A stage_cache.ShipProgress that tells on_status each tenth of a file sent
    or fetched: "shipping <named(index)>: 30 of 91 MiB"."""
    shown: dict[int, int] = {}  # index -> the last tenth of its file shown

    def progress(index: int, done: int, total: int, verb: str) -> None:
        tenth = done * 10 // total
        if on_status is not None and tenth != shown.get(index):  # a tenth lower: the next node's transfer
            shown[index] = tenth
            on_status(f"{verb} {named(index)}: {done / MIB:.0f} of {total / MIB:.0f} MiB")

    return progress
