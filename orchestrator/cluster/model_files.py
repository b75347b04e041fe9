"""Which model files a run or a service uses: the stage files given, or the
whole model to cut on the driver and ship to the nodes; where the
coordinator's vocabulary comes from; and the check of a draft model."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.cluster.shipping import ModelToShip
from stages.errors import SpecpipeError
from stages.engine import StageError
from stages.gguf_file import ModelFileError, StageFileInfo, stage_info_of
from stages.settings import StageSettings
from stages.stage_files import check_stage_files
from stages.tokenizer import Tokenizer

MIB = 1024**2


class RunError(SpecpipeError):
    """A run that cannot be done as asked; the message is one line."""


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
                       on_status: Callable[[str], None] | None) -> ModelToShip | None:
    """What Pipeline needs to cut ``settings.path`` and ship its stages: how many, and where to cut for the nodes."""
    from orchestrator.cluster.connect import alive_nodes
    from orchestrator.planning.cluster_split import choose_cluster_split
    from orchestrator.planning.loaders import model_shape_of_gguf
    from stages.gguf_file import read_model
    from stages.layer_rules import layer_rules
    from stages.settings import ALL_LAYERS

    model = read_model(settings.path)
    if stage_info_of(settings.path) is not None:
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
        shape = model_shape_of_gguf(settings.path)
        draft_bytes = os.path.getsize(draft_path) if draft_path else 0
        split = choose_cluster_split(shape, nodes, context=stage.n_ctx * stage.sequences, draft_bytes=draft_bytes,
                                     boundaries=layer_rules(model.metadata).allowed_boundaries(),
                                     profiles=settings.profiles, offloaded=offloaded)
        if on_status is not None:
            for line in split.lines(shape.blocks, nodes, offloaded):
                on_status(line)
        return split.starts

    shown: dict[int, int] = {}  # stage -> the last tenth of its file shown

    def progress(stage_index: int, done: int, total: int) -> None:
        tenth = done * 10 // total
        if on_status is not None and tenth > shown.get(stage_index, -1):
            shown[stage_index] = tenth
            on_status(f"shipping stage {stage_index}: {done / MIB:.0f} of {total / MIB:.0f} MiB")

    return ModelToShip(settings.path, stage_count, choose_starts, progress, offloaded)
