"""Stage actors that outlive their coordinator: ``orchestrate serve``'s
replica may die (its process killed, its machine's Serve restarting it) and
Serve starts another; the stages, loaded once (minutes for a 405B), stay.

What lives where: ``orchestrate serve`` (the driver) makes a ``KeptStages``
once, before the first replica: the tag that names the service's stage
actors (``specpipe-stage-<index>.<tag>``) and its placement group, and the
chain's secret and TLS certificate, so that stages started by one replica
take the handshake of the next. Serve hands it to every replica it starts
(the deployment's arguments, kept by Serve's controller). The stage actors
and the placement group are *detached*: no replica owns them, so a
replica's death does not take them; a replica that is shut down
(Coordinator.close) removes them, and the driver removes whatever is left
of them when it stops (``remove_kept``). The ledger of what each stage
caches dies with the replica, so a new one takes a found stage over only
after it answers, holds the same slice of the same model on the node its
placement names, and has forgotten every KV sequence (StageServer.forget).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, NamedTuple

from orchestrator.config import STAGE_ANSWER_SECONDS
from orchestrator.transport.handshake import new_secret
from orchestrator.transport.tls import ChainCertificate, new_chain_certificate
from orchestrator.workers.stage_server import StageDescription
from stages.gguf_file import StageFileInfo

SERVE_NAMESPACE = "serve"  # Ray Serve's replicas run in it: the kept actors and group are named there


@dataclass(frozen=True)
class KeptStages:
    """A service's stages kept across its coordinator's restarts: the tag
    naming its actors and placement group, the chain's secret and
    certificate (None without --tls)."""

    tag: str
    secret: bytes
    certificate: ChainCertificate | None = None

    @classmethod
    def new(cls, tls: bool) -> KeptStages:
        """A service's own (eight hex digits: services side by side on one cluster stay apart)."""
        return cls(secrets.token_hex(4), new_secret(), new_chain_certificate() if tls else None)

    @property
    def group_name(self) -> str:
        """The name of the service's placement group (when its stages are spread by one)."""
        return f"specpipe-stages.{self.tag}"


class FoundStage(NamedTuple):
    """A stage actor an earlier coordinator started that still answers: its
    handle, its restarts so far (its name's .rN) and what it holds."""

    actor: Any
    restarts: int
    description: StageDescription


def stage_names(tag: str, names: list[str]) -> dict[int, tuple[str, int]]:
    """Of Ray actor ``names``, each stage's newest named with ``tag``
    (connect.actor_name): stage index -> (name, restarts)."""
    pattern = re.compile(rf"specpipe-stage-(\d+)\.{re.escape(tag)}(?:\.r(\d+))?")
    newest: dict[int, tuple[str, int]] = {}
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            index, restarts = int(match.group(1)), int(match.group(2) or 0)
            if index not in newest or restarts > newest[index][1]:
                newest[index] = (name, restarts)
    return newest


def find_kept(tag: str) -> tuple[dict[int, FoundStage], dict[int, int]]:
    """The stage actors named with ``tag`` that still live in this namespace:
    (those that answer within STAGE_ANSWER_SECONDS, each stage's restarts
    so far, which the next actor's name counts on from). One that does not
    answer is killed: a new one takes its place."""
    import ray

    named = stage_names(tag, ray.util.list_named_actors())
    restarts = {index: count for index, (_, count) in named.items()}
    actors = {}
    for index, (name, _) in named.items():
        try:
            actors[index] = ray.get_actor(name)
        except ValueError:  # gone since it was listed
            continue
    calls = {index: actor.describe.remote() for index, actor in actors.items()}
    found = {}
    for index, call in calls.items():
        try:
            found[index] = FoundStage(actors[index], restarts[index], ray.get(call, timeout=STAGE_ANSWER_SECONDS))
        except ray.exceptions.RayError:  # died meanwhile, or hung
            ray.kill(actors[index])
            restarts[index] += 1
    return found, restarts


def holds(description: StageDescription, info: StageFileInfo | None) -> bool:
    """Whether a found stage holds the slice that stage file describes (None: a whole model, one stage)."""
    if info is None:
        return description.stage_count == 1 and not description.source_fingerprint
    return (description.stage_index, description.stage_count, description.first_block, description.end_block,
            description.source_fingerprint) == (info.stage_index, info.stage_count, info.first_block,
                                                info.end_block, info.source_fingerprint)


def remove_kept(kept: KeptStages) -> int:
    """Kill every actor named with the service's tag and remove its placement
    group (what a replica's shutdown left, e.g. one that died just before);
    the driver calls it when it stops. Returns the actors killed."""
    import ray

    names = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
             if entry["namespace"] == SERVE_NAMESPACE and f".{kept.tag}" in entry["name"]]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE))
        except ValueError:  # gone meanwhile
            pass
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(kept.group_name))
    except ValueError:  # none: its stages were not spread by a group, or it is removed already
        pass
    return len(names)
