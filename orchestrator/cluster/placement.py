"""Which node each stage runs on: a pure decision from the cluster's node list.

* One node: every stage shares it (a local run).
* Several nodes: one stage per node, different nodes (a Ray placement group,
  STRICT_SPREAD), so that each machine holds one slice of the model.
* ``--place 0=ADDR,1=ADDR``: stage i on the node whose address or node id
  (or a unique prefix of it) is given.
* Nodes that advertise a custom resource ``specpipe-stage-K`` (cluster.yaml
  starts each machine with the stage it holds the file of): stage K on that
  node. ``--place`` wins over them.
* Nodes chosen before (``orchestrate serve`` shipped each stage there):
  stage i on its node while it lives, and on a spare node (one that holds no
  stage) once it is lost (``movable``; ``replacement_node``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stages.errors import SpecpipeError

STAGE_RESOURCE_PREFIX = "specpipe-stage-"


class PlacementError(SpecpipeError):
    """A placement that cannot be satisfied; the message is one line."""


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node: its id, its IP address, its CPUs and all its resources
    (Ray's own and custom ones such as ``specpipe-stage-0``)."""

    node_id: str
    address: str
    cpus: float
    resources: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementPlan:
    """strategy: "local" (all stages on local_node), "spread" (one per node,
    Ray picks which), or "explicit" (node_ids[i] for stage i: from --place or
    from the nodes' stage resources, pinned; or, ``movable``, where the stages
    were shipped before, each moved to a spare node when its own is lost)."""

    strategy: str
    node_ids: tuple[str, ...] = ()
    movable: bool = False


def stage_resource(stage_index: int) -> str:
    """The custom resource a node advertises to say it holds stage ``stage_index``'s file."""
    return f"{STAGE_RESOURCE_PREFIX}{stage_index}"


def advertised_stages(node: NodeInfo) -> list[int]:
    """The stages a node advertises with ``specpipe-stage-K`` resources."""
    stages = []
    for name, amount in node.resources.items():
        suffix = name[len(STAGE_RESOURCE_PREFIX):] if name.startswith(STAGE_RESOURCE_PREFIX) else ""
        if suffix.isdigit() and amount > 0:
            stages.append(int(suffix))
    return sorted(stages)


def parse_place(text: str) -> dict[int, str]:
    """Parse "0=10.0.0.1,1=10.0.0.2" into {0: "10.0.0.1", 1: "10.0.0.2"}."""
    mapping: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        stage, separator, node = item.partition("=")
        if not separator or not stage.strip().isdigit() or not node.strip():
            raise PlacementError(f"--place entry {item!r} is not STAGE=NODE (e.g. 0=10.0.0.1)")
        if int(stage) in mapping:
            raise PlacementError(f"--place names stage {int(stage)} twice")
        mapping[int(stage)] = node.strip()
    return mapping


def find_node(nodes: list[NodeInfo], wanted: str) -> NodeInfo:
    exact = [node for node in nodes if wanted in (node.address, node.node_id)]
    if exact:
        return exact[0]
    prefixed = [node for node in nodes if node.node_id.startswith(wanted)]
    if len(prefixed) == 1:
        return prefixed[0]
    known = ", ".join(f"{node.address} ({node.node_id[:8]})" for node in nodes)
    if prefixed:
        raise PlacementError(f"node {wanted!r} is ambiguous; alive nodes: {known}")
    raise PlacementError(f"no alive node {wanted!r}; alive nodes: {known}")


def _advertising_node(nodes: list[NodeInfo], stage_index: int) -> NodeInfo:
    """The one node that advertises stage ``stage_index``."""
    name = stage_resource(stage_index)
    holders = [node for node in nodes if stage_index in advertised_stages(node)]
    if len(holders) == 1:
        return holders[0]
    if holders:
        addresses = ", ".join(f"{node.address} ({node.node_id[:8]})" for node in holders)
        raise PlacementError(f"{name} is advertised by more than one node ({addresses}); give --place")
    advertised = ", ".join(
        f"{node.address} stage {','.join(map(str, advertised_stages(node)))}"
        for node in nodes if advertised_stages(node)
    )
    raise PlacementError(
        f"no alive node advertises {name} (advertised: {advertised}); "
        f"start the node holding stage {stage_index} with --resources='{{\"{name}\": 1}}', or give --place"
    )


def plan_placement(
    nodes: list[NodeInfo], stage_count: int, local_node_id: str, place: dict[int, str] | None = None,
    prefer: dict[int, str] | None = None,
) -> PlacementPlan:
    """prefer: node ids chosen before for each stage (movable); place (pins) wins over them."""
    if not nodes:
        raise PlacementError("the Ray cluster has no alive nodes")
    if prefer and not place:
        node_ids = [prefer.get(stage, "") for stage in range(stage_count)]
        for stage, node_id in enumerate(node_ids):
            if node_id not in {node.node_id for node in nodes}:
                node = replacement_node(nodes, tuple(node_ids), stage)
                if node is None:
                    raise PlacementError(f"stage {stage}'s node {node_id[:8]} is not alive and no other node has "
                                         "room for it (a CPU and no stage)")
                node_ids[stage] = node.node_id
        return PlacementPlan("explicit", tuple(node_ids), movable=True)
    if place:
        unknown = sorted(stage for stage in place if not 0 <= stage < stage_count)
        if unknown:
            raise PlacementError(f"--place names stage {unknown[0]}, but stages are 0..{stage_count - 1}")
        missing = [stage for stage in range(stage_count) if stage not in place]
        if missing:
            raise PlacementError(f"--place gives no node for stage {missing[0]}")
        return PlacementPlan("explicit", tuple(find_node(nodes, place[stage]).node_id for stage in range(stage_count)))
    if any(advertised_stages(node) for node in nodes):
        return PlacementPlan("explicit", tuple(_advertising_node(nodes, stage).node_id for stage in range(stage_count)))
    if len(nodes) == 1:
        return PlacementPlan("local", (local_node_id,) * stage_count)
    if len(nodes) < stage_count:
        raise PlacementError(
            f"{stage_count} stages need {stage_count} nodes (one stage per node) but the cluster has "
            f"{len(nodes)}; add nodes or give --place"
        )
    return PlacementPlan("spread")


def replacement_node(nodes: list[NodeInfo], node_ids: tuple[str, ...], lost: int) -> NodeInfo | None:
    """Where stage ``lost`` goes after its process died (node_ids: each
    stage's node now; nodes: the alive ones): its own node while it lives
    (also one it shares with other stages, as on one machine), else an
    alive node with a CPU that holds none of the other stages; None when
    there is none."""
    own = [node for node in nodes if node.node_id == node_ids[lost]]
    others = {node_id for index, node_id in enumerate(node_ids) if index != lost}
    spares = [node for node in nodes if node.node_id not in others and node.cpus >= 1]
    return (own or spares or [None])[0]
