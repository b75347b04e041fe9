"""Whether a Ray node still lives: listed alive, running a task within a
deadline, or reported dead. Ray lists a node that died hard (killed, cut
off) as alive until its health checks fail, so a lost stage's recovery and
a restart's placement ask both (orchestrator.cluster.recovery, .reservation)."""

from __future__ import annotations

import time

from orchestrator.cluster.placement import NodeInfo
from orchestrator.config import NODE_DEATH_POLL_SECONDS, STAGE_ANSWER_SECONDS


def alive_nodes() -> list[NodeInfo]:
    import ray

    return [
        NodeInfo(
            node["NodeID"], node["NodeManagerAddress"], float(node["Resources"].get("CPU", 0)), dict(node["Resources"])
        )
        for node in ray.nodes()
        if node["Alive"]
    ]


def answers(scheduling_strategy, seconds: float) -> bool:
    """Whether a task placed by ``scheduling_strategy`` runs within ``seconds``:
    Ray lists a node that died hard (killed, cut off) as alive, and keeps a
    placement group's bundle on it, until its health checks fail; a restart
    placed there would wait for nothing."""
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def here() -> bool:
        return True

    call = here.options(scheduling_strategy=scheduling_strategy).remote()
    try:
        return ray.get(call, timeout=seconds)
    except ray.exceptions.RayError:  # the node is gone, or does not answer in time
        ray.cancel(call, force=True)
        return False


def node_answers(node_id: str, seconds: float = STAGE_ANSWER_SECONDS) -> bool:
    """Whether node ``node_id`` runs a task within ``seconds``: a stage
    that does not answer there is hung, not lost with its machine (a frozen or
    cut-off machine runs nothing)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return answers(NodeAffinitySchedulingStrategy(node_id, soft=False), seconds)


def node_dies(node_id: str, seconds: float) -> bool:
    """Whether Ray reports node ``node_id`` dead within ``seconds`` (asked every NODE_DEATH_POLL_SECONDS)."""
    deadline = time.monotonic() + seconds
    while node_id in {node.node_id for node in alive_nodes()}:
        if time.monotonic() > deadline:
            return False
        time.sleep(NODE_DEATH_POLL_SECONDS)
    return True
