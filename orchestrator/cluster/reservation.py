"""Ray's reservation of the stages' places (a placement group), over the
pure decision of where each stage runs (orchestrator.cluster.placement): the
scheduling strategy and actor options of each stage's actors and tasks, and
following a stage whose node was lost."""

from __future__ import annotations

import time

from orchestrator.cluster.connect import ClusterError, kept_group
from orchestrator.cluster.node_liveness import alive_nodes, answers
from orchestrator.cluster.placement import PlacementError, plan_placement, replacement_node
from orchestrator.config import NODE_DEATH_SECONDS, PLACEMENT_SECONDS, ROOM_WAIT_SECONDS, STAGE_ANSWER_SECONDS


class Reservation:
    """Where each stage's actors and tasks run, reserved up front.

    The placement decision is the pure ``placement.plan_placement``; for a
    "spread" plan the constructor reserves one CPU on each of n different
    nodes (a STRICT_SPREAD placement group), or fails with a ClusterError if the
    cluster cannot give them within PLACEMENT_SECONDS.
    Then ``scheduling_strategy`` and ``actor_options`` only read. ``release``
    gives the reservation back.
    """

    def __init__(self, stage_count: int, place: dict[int, str] | None = None, prefer: dict[int, str] | None = None,
                 group_name: str = ""):
        """group_name: a service's kept stages (orchestrator.cluster.kept_stages):
        its placement group is detached and named so, and an earlier
        coordinator's is taken over."""
        import ray

        self.stage_count = stage_count
        self.place = place  # the user's pins, looked up again when a pinned node is lost (follow_lost)
        self.plan = plan_placement(alive_nodes(), stage_count, ray.get_runtime_context().get_node_id(), place, prefer)
        self.node_ids = list(self.plan.node_ids)  # an explicit plan's node of each stage (a movable one's changes)
        self.placement_group = None
        if self.plan.strategy == "spread":
            self.placement_group = kept_group(group_name) or ray.util.placement_group(
                [{"CPU": 1}] * stage_count, strategy="STRICT_SPREAD", name=group_name,
                lifetime="detached" if group_name else None)
            try:
                ray.get(self.placement_group.ready(), timeout=PLACEMENT_SECONDS)
            except ray.exceptions.GetTimeoutError:
                self.release()
                raise ClusterError(
                    f"could not place {stage_count} stages on {stage_count} different nodes (each needs 1 free CPU)"
                ) from None

    def follow_lost(self, stage_index: int) -> None:
        """Before stage ``stage_index`` is started again, find it a node:
        its own while it lives; with a movable plan a spare node
        (placement.replacement_node); a pinned stage (--place, advertised
        resources) the node its pin names now (a machine back with a new Ray
        node id); a placement group's bundle, where Ray moved it. A
        ClusterError that names the lost node where there is none yet."""
        if self.placement_group is not None:
            self._follow_bundle(stage_index)
            return
        lost = self.node_ids[stage_index] if self.node_ids else ""
        gone = bool(lost) and not answers(self.scheduling_strategy(stage_index), STAGE_ANSWER_SECONDS)
        nodes = [node for node in alive_nodes() if not (gone and node.node_id == lost)]
        if self.plan.movable:
            node = replacement_node(nodes, tuple(self.node_ids), stage_index)
            if node is None:
                raise ClusterError(f"stage {stage_index}'s node {lost[:8]} is lost and no other node has room "
                                   "for it (a CPU and no stage)")
            self.node_ids[stage_index] = node.node_id
        elif self.plan.strategy == "explicit" and lost not in {node.node_id for node in nodes}:
            try:
                again = plan_placement(nodes, self.stage_count, lost, self.place)
            except PlacementError:
                again = None
            if again is None or again.strategy != "explicit":
                raise ClusterError(f"stage {stage_index} is pinned to node {lost[:8]} (--place, or the node "
                                   "advertising it), which is lost: waiting for it to come back")
            self.node_ids[stage_index] = again.node_ids[stage_index]

    def _follow_bundle(self, stage_index: int) -> None:
        """Until stage ``stage_index``'s bundle is on a node that answers: Ray
        moves it once it calls the lost node dead (within NODE_DEATH_SECONDS),
        onto a node with room (within ROOM_WAIT_SECONDS more); else a ClusterError."""
        import ray

        no_room = ClusterError(f"stage {stage_index} lost its node and no other node has room for it "
                               f"(a free CPU and no stage) within {ROOM_WAIT_SECONDS:.0f} s")
        try:
            ray.get(self.placement_group.ready(), timeout=ROOM_WAIT_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise no_room from None
        deadline = time.monotonic() + NODE_DEATH_SECONDS + ROOM_WAIT_SECONDS
        while not answers(self.scheduling_strategy(stage_index), STAGE_ANSWER_SECONDS):  # still on the lost node
            if time.monotonic() > deadline:
                raise no_room

    def scheduling_strategy(self, stage_index: int):
        """The Ray scheduling strategy that puts a task or actor on stage ``stage_index``'s node."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if self.placement_group is not None:
            return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=stage_index)
        return NodeAffinitySchedulingStrategy(self.node_ids[stage_index], soft=False)

    def actor_options(self, stage_index: int, *, num_cpus: float) -> dict:
        """Ray options that put an actor on stage ``stage_index``'s node (in its placement bundle)."""
        return {
            "max_restarts": 0,
            "scheduling_strategy": self.scheduling_strategy(stage_index),
            # in a placement group the bundle reserved the CPU; pinned to a node, nothing is reserved
            "num_cpus": num_cpus if self.placement_group is not None else 0,
        }

    def release(self) -> None:
        import ray

        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
