"""Which node each stage runs on: a pure decision from the cluster's node list.

* One node: every stage shares it (a local run).
* Several nodes: one stage per node, different nodes (a Ray placement group,
  STRICT_SPREAD), so that each machine holds one slice of the model.
* ``--place 0=ADDR,1=ADDR``: stage i on the node whose address or node id
  (or a unique prefix of it) is given.
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """A placement that cannot be satisfied; the message is one line."""


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node: its id, its IP address and its CPUs."""

    node_id: str
    address: str
    cpus: float


@dataclass(frozen=True)
class PlacementPlan:
    """strategy: "local" (all stages on local_node), "spread" (one per node,
    Ray picks which), or "explicit" (node_ids[i] for stage i)."""

    strategy: str
    node_ids: tuple[str, ...] = ()


def parse_place(text: str) -> dict[int, str]:
    """Parse "0=10.0.0.1,1=10.0.0.2" into {0: "10.0.0.1", 1: "10.0.0.2"}."""
    mapping: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        stage, separator, node = item.partition("=")
        if not separator or not stage.strip().isdigit() or not node.strip():
            raise PlacementError(f"--place entry {item!r} is not STAGE=NODE (e.g. 0=10.0.0.1)")
        mapping[int(stage)] = node.strip()
    return mapping


def _find_node(nodes: list[NodeInfo], wanted: str) -> NodeInfo:
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


def plan_placement(
    nodes: list[NodeInfo], stage_count: int, local_node_id: str, place: dict[int, str] | None = None
) -> PlacementPlan:
    if not nodes:
        raise PlacementError("the Ray cluster has no alive nodes")
    if place:
        unknown = sorted(stage for stage in place if not 0 <= stage < stage_count)
        if unknown:
            raise PlacementError(f"--place names stage {unknown[0]}, but stages are 0..{stage_count - 1}")
        missing = [stage for stage in range(stage_count) if stage not in place]
        if missing:
            raise PlacementError(f"--place gives no node for stage {missing[0]}")
        return PlacementPlan("explicit", tuple(_find_node(nodes, place[stage]).node_id for stage in range(stage_count)))
    if len(nodes) == 1:
        return PlacementPlan("local", (local_node_id,) * stage_count)
    if len(nodes) < stage_count:
        raise PlacementError(
            f"{stage_count} stages need {stage_count} nodes (one stage per node) but the cluster has "
            f"{len(nodes)}; add nodes or give --place"
        )
    return PlacementPlan("spread")
