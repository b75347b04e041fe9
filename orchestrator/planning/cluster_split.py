"""The split of a whole model over the nodes a run was given, from what each
node has free and, when profiled, how fast it is.

Each stage must fit its node: its weights, its blocks' KV cache for the
context, and the draft model, within ``MEMORY_HEADROOM`` of the memory the
node has available when the run starts (its GPUs' free memory, for a stage
offloaded whole to a node whose build has GPUs) (``ModelShape.stage_bytes``: the
embedding table is counted on the first stage, the head on the last). Of the
splits that fit, the one whose slowest stage is fastest wins
(``stages.plan.balanced_starts``): a stage's time is its blocks' bytes over
its node's speed, which without profiles is the same on every node (so the
bytes are balanced, as ``orchestrate split`` does) and with a profile of each
node (``orchestrate profile`` run there) the bytes per second one of its
blocks was read at. Pure: no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import MEMORY_HEADROOM
from orchestrator.planning.costs import ModelShape
from orchestrator.planning.inputs import PlanError
from orchestrator.planning.loaders import measured_machine
from stages.plan import balanced_starts

MIB = 1024**2


@dataclass(frozen=True)
class NodeMemory:
    """A node a stage is placed on: its address, its Ray node id, the bytes of
    memory it has available now, and the free bytes of the GPUs its llama.cpp
    build offloads to (0: none, or not asked)."""

    address: str
    node_id: str
    available_bytes: int
    offload_bytes: int = 0

    def budget(self, offloaded: bool) -> tuple[int, str]:
        """(bytes, what) a stage may take: the GPUs' (" GPU memory") for a stage offloaded whole to a
        node that has them, else the host's ("")."""
        if offloaded and self.offload_bytes:
            return self.offload_bytes, " GPU memory"
        return self.available_bytes, ""

    def shown(self, offloaded: bool) -> str:
        """That budget for the user: "100 MiB", "100 MiB GPU memory"."""
        budget, what = self.budget(offloaded)
        return f"{budget / MIB:.0f} MiB{what}"


@dataclass(frozen=True)
class ClusterSplit:
    """starts: each stage's first block; needed: the bytes each stage needs on
    its node; reason: why this split, one line."""

    starts: tuple[int, ...]
    needed: tuple[int, ...]
    reason: str

    def lines(self, blocks: int, nodes: list[NodeMemory], offloaded: bool = False) -> list[str]:
        """What was chosen and why, for the user, before anything loads."""
        ends = self.starts[1:] + (blocks,)
        stages = [
            f"  stage {index}: blocks [{first}, {end}) on {node.address}: needs {need / MIB:.0f} MiB of "
            f"{node.shown(offloaded)} available"
            for index, (first, end, need, node) in enumerate(zip(self.starts, ends, self.needed, nodes))
        ]
        return [f"split: {self.reason}", *stages]


def stage_memory(shape: ModelShape, first: int, end: int, context: int, draft_bytes: int) -> int:
    """Bytes a stage of blocks [first, end) needs: weights, KV for ``context`` positions, the draft model."""
    return shape.stage_bytes(first, end) + (end - first) * context * shape.kv_bytes_per_token + draft_bytes


def node_speed(profile: dict) -> float:
    """Bytes of block weights a profiled node reads per second, in one-token passes."""
    machine = measured_machine(profile)
    block_bytes = profile["model_shape"]["block_bytes"]
    seconds = machine.block.at(1)
    if not block_bytes or seconds <= 0:
        raise PlanError(f"the profile of {machine.name} has no block timing; run `orchestrate profile` again")
    return sum(block_bytes) / len(block_bytes) / seconds


def choose_cluster_split(shape: ModelShape, nodes: list[NodeMemory], *, context: int, draft_bytes: int,
                         boundaries: list[int], profiles: dict[str, dict] | None = None,
                         offloaded: bool = False) -> ClusterSplit:
    """The split of ``shape`` over ``nodes`` (stage i on nodes[i]); boundaries:
    the blocks a stage may start at (stages.layer_rules). profiles: node
    address -> its ``orchestrate profile`` (every node's, or none). offloaded:
    every stage goes whole onto its node's GPUs (--n-gpu-layers all), so a
    node with GPUs must hold it there (NodeMemory.budget). PlanError, with each
    node's numbers, when no split fits."""
    if profiles:
        missing = [node.address for node in nodes if node.address not in profiles]
        if missing:
            raise PlanError(f"--profile gives no profile for node {missing[0]}; profile every node or none")
        speeds = [node_speed(profiles[node.address]) for node in nodes]
        reason = ("of the splits that fit, the one whose slowest stage is fastest, at the speeds profiled ("
                  + ", ".join(f"{node.address} {speed / 1e9:.2f} GB/s" for node, speed in zip(nodes, speeds)) + ")")
    else:
        speeds = None
        reason = "of the splits that fit, the one with the block bytes most even (no --profile: nodes taken as alike)"

    def fits(stage: int, first: int, end: int) -> bool:
        return stage_memory(shape, first, end, context, draft_bytes) <= MEMORY_HEADROOM * nodes[stage].budget(offloaded)[0]

    try:
        starts = tuple(balanced_starts(list(shape.block_bytes), len(nodes), boundaries, speeds=speeds, fits=fits))
    except ValueError as error:
        available = ", ".join(f"{node.address} {node.shown(offloaded)}" for node in nodes)
        whole = stage_memory(shape, 0, shape.blocks, context, draft_bytes)
        raise PlanError(
            f"{shape.name} fits no split over {len(nodes)} node(s) ({error}): it needs about {whole / MIB:.0f} MiB "
            f"in all (weights, KV for {context} positions{', draft model' if draft_bytes else ''}), and each stage "
            f"must fit within {MEMORY_HEADROOM:.0%} of its node's available memory ({available})"
        ) from None
    ends = starts[1:] + (shape.blocks,)
    needed = tuple(stage_memory(shape, first, end, context, draft_bytes) for first, end in zip(starts, ends))
    return ClusterSplit(starts, needed, reason)
