"""A lost stage brought back without a wrong or lost token.

When a pass is late (``PassLate``: the chain broke, or its deadline passed),
every stage actor is asked whether it lives. Each one that died is restarted
on its node (its placement bundle), the chain is wired anew through it and
the survivors, every live sequence's cache is rebuilt by replaying its
tokens (orchestrator.transport.ledger), and the passes that were in flight
are sent again: the caller sees a late result, never a wrong one. Where
every stage still answers (a link that broke and healed), the chain is
wired anew through the same stages and replayed, once per loss and at
most max_restarts times a pipeline (``ChainRelink``). A stage that hangs is
named and the pipeline fails: it may still hold its node's memory, and a
second copy beside it could not load. A stage that hangs on a node that
still runs a task at once (node_liveness.node_answers) is named at once; unless
its node does not answer and Ray reports it dead within NODE_DEATH_SECONDS
(a frozen or cut-off machine), which makes it a lost stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.cluster.node_liveness import node_answers, node_dies
from orchestrator.cluster.ray_calls import one_line, worker_log
from orchestrator.config import NODE_DEATH_SECONDS
from orchestrator.decoding.targets import TargetWaiting
from orchestrator.transport.chain import PassLate, PipelineError
from orchestrator.transport.ledger import PassRecord

if TYPE_CHECKING:
    from orchestrator.cluster.pipeline import Pipeline


class StageWaiting(PipelineError, TargetWaiting):
    """A lost stage has no node to go to yet (a spare, its pinned node back):
    the pipeline's sequences are lost with it, and Pipeline.resume starts it
    once a node has room. The message names the stage and the lost node."""


@dataclass(frozen=True)
class StageRestart:
    """A lost stage brought back: which, why it was lost (one line), the nodes
    before and after, the seconds from noticing the loss to the chain carrying
    passes again (reload, rewiring and replay), and of those the replay's
    (rebuilding every live sequence's cache)."""

    stage_index: int
    reason: str
    old_node_id: str
    node_id: str
    seconds: float
    replay_seconds: float


@dataclass(frozen=True)
class ChainRelink:
    """The chain wired anew through the same stages, none of which died (a
    link broke and healed): why (one line), and the seconds from noticing
    to the chain carrying passes again (of those the replay's)."""

    reason: str
    seconds: float
    replay_seconds: float


def recover(pipeline: Pipeline, late: PassLate) -> None:
    """Restart every stage that died, wire a new chain, rebuild every
    sequence's cache and send the unanswered passes again; or raise the
    PipelineError that names the stage at fault."""
    noticed = time.perf_counter()
    chain = pipeline.chain
    unanswered, cancelled = chain.unanswered(), chain.cancelled_unanswered()
    restarted: list[tuple[int, str, str]] = []  # (index, why, old node)
    relinked = ""  # why, when the chain was wired anew with every stage alive
    while True:
        dead = dead_stages(pipeline, late, restarted)
        if not dead:
            if relinked or len(pipeline.relinks) >= pipeline.max_restarts:
                raise PipelineError(f"{late}; every stage still answers (one may be stuck inside llama.cpp); the "
                                    f"chain was wired anew {len(pipeline.relinks) + bool(relinked)} times already")
            relinked = str(late)
        old_chain = pipeline.chain
        old_chain.close(shutdown=False)
        for index, reason in dead:
            restarted.append((index, reason, pipeline.stages[index].node_id))
            pipeline.restart_stage(index)
        pipeline.chain = pipeline.new_chain()
        pipeline.chain.take_timing_from(old_chain)
        replaying = time.perf_counter()
        try:
            replay(pipeline, unanswered, cancelled)
            break
        except PassLate as again:  # lost again while replaying: the ledger still holds only settled passes
            late = again
    done = time.perf_counter()
    if relinked:
        pipeline.relinks.append(ChainRelink(relinked, done - noticed, done - replaying))
    for index, reason, old_node in restarted:
        restart = StageRestart(index, reason, old_node, pipeline.stages[index].node_id, done - noticed,
                               done - replaying)
        pipeline.restarts.append(restart)
        if pipeline.on_restart is not None:
            pipeline.on_restart(restart)


def dead_stages(pipeline: Pipeline, late: PassLate, restarting: list[tuple[int, str, str]]) -> list[tuple[int, str]]:
    """(index, why) of each stage actor that died (none: every stage still
    answers); a PipelineError naming the stage if one does not answer, or if
    one died more often than max_restarts."""
    import ray

    calls = [actor.describe.remote() for actor in pipeline.actors]
    answer_seconds = pipeline.deadlines.answer_seconds
    dead = []
    for stage, call in zip(pipeline.stages, calls):
        where = f"stage {stage.stage_index} on node {stage.node_id[:8]} ({stage.host}, process {stage.process_id})"
        try:
            ray.get(call, timeout=answer_seconds)
            continue
        except ray.exceptions.GetTimeoutError:
            if node_answers(stage.node_id, answer_seconds) or not node_dies(stage.node_id, NODE_DEATH_SECONDS):
                raise PipelineError(f"{late}: {where} does not answer within {answer_seconds:.0f} s "
                                    "(hung or stopped)") from None
            reason = f"its node {stage.node_id[:8]} stopped answering and Ray reports it dead"
        except ray.exceptions.RayError as error:
            reason = f"{one_line(error)}; {worker_log(stage.node_id, stage.process_id)}"
        used = sum(restart.stage_index == stage.stage_index for restart in pipeline.restarts) + sum(
            index == stage.stage_index for index, _, _ in restarting)
        if used >= pipeline.max_restarts:
            raise PipelineError(f"{late}: {where} died ({reason}); restarted {used} times already "
                                f"(--max-restarts {pipeline.max_restarts})") from None
        dead.append((stage.stage_index, f"{late}; {reason}"))  # how the loss showed, then what Ray says
    return dead


def replay(pipeline: Pipeline, unanswered: list[PassRecord], cancelled: list[PassRecord]) -> None:
    """Rebuild every sequence's cache in the new chain (at most one pass per
    stage in flight, so results never pile up unread), then send the
    unanswered passes again (cancelling again those ``cancelled``)."""
    chain = pipeline.chain
    for record in pipeline.ledger.rebuild(pipeline.n_batch):
        if chain.in_flight >= len(pipeline.stages):
            chain.receive()
        chain.send(record)
    while chain.in_flight:
        chain.receive()
    for record in unanswered:
        chain.send(record)
    for record in cancelled:
        chain.cancel(record)
