"""A set of stage files checked before anything loads: on this machine, or
from each file's header as read on the node that is to run its stage.

Pure: headers only (stages.gguf_file), no llama.cpp, no Ray. The Ray task that
reads a header on its node is in orchestrator.cluster.pipeline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stages.gguf_file import ModelFileError, StageFileInfo, stage_info_of, validate_stage_set

NOT_FOUND = "not found"


def check_stage_files(paths: list[str]) -> list[StageFileInfo | None]:
    """Validate a set of stage files on this machine before anything is loaded (ModelFileError if not)."""
    infos = [stage_info_of(path) for path in paths]
    validate_stage_set(infos, [Path(path) for path in paths])
    return infos


@dataclass(frozen=True)
class NodeStageFile:
    """A stage file's header as read on the node that is to run the stage.

    problem: "" if the file is a readable GGUF file, NOT_FOUND if there is no
    such file on that node, else why it cannot be used (one line).
    """

    node_address: str
    node_id: str
    info: StageFileInfo | None
    problem: str = ""


def read_stage_file(path: str, node_address: str, node_id: str) -> NodeStageFile:
    """Read a stage file's header on this node (run there as a Ray task)."""
    if not os.path.exists(path):
        return NodeStageFile(node_address, node_id, None, NOT_FOUND)
    try:
        return NodeStageFile(node_address, node_id, stage_info_of(path))
    except ModelFileError as error:
        return NodeStageFile(node_address, node_id, None, str(error))


def check_stage_files_on_nodes(paths: list[str], found: list[NodeStageFile]) -> list[StageFileInfo | None]:
    """Validate a set of stage files from their headers as read on their nodes
    (``found[i]`` for ``paths[i]``); ModelFileError names the node of a bad file."""
    for stage_index, (path, file) in enumerate(zip(paths, found)):
        node = f"node {file.node_address} ({file.node_id[:8]})"
        if file.problem == NOT_FOUND:
            raise ModelFileError(f"stage {stage_index} file {path} not found on {node}")
        if file.problem:
            raise ModelFileError(f"stage {stage_index} file on {node}: {file.problem}")
    infos = [file.info for file in found]
    validate_stage_set(infos, [Path(path) for path in paths])
    return infos
