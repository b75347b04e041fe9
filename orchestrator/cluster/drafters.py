"""Drafter actors beside the stages, and the coordinator's side of their sockets.

One drafter per machine, placed on its stage's node (in the same placement
bundle), or on a node the user names (``DrafterSettings.nodes``: a
drafter-only node drafts in place of the one beside stage i). Every failure
of a drafter (it raises, hangs, its actor dies, its socket closes, it sends
tokens outside the vocabulary) is absorbed here: the
client answers with an empty draft, marks the drafter lost, and the pipeline
goes on without it. A lost drafter is restarted in the background (at most
max_restarts times) and rejoins at the next request once it is up; drafts
only ever change the speed, never the output.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from orchestrator.cluster.connect import actor_name, peak_rss_mb, readable_class_name
from orchestrator.cluster.node_liveness import alive_nodes
from orchestrator.cluster.placement import PlacementError, find_node
from orchestrator.cluster.ray_calls import one_line, worker_log
from orchestrator.cluster.sequence_drafter import SequenceDrafter
from orchestrator.cluster.shipping import LOOPBACK, ship_draft
from orchestrator.cluster.stage_cache import ShippingError
from orchestrator.config import (ACTOR_START_SECONDS, CONNECT_SECONDS, DRAFT_MAX, DRAFT_TREE_BRANCHES,
                                 DRAFTER_REPLY_SECONDS, DRAFTER_WAIT_SECONDS, MAX_RESTARTS, chain_reach)
from orchestrator.planning.cluster_split import NodeMemory
from orchestrator.transport import wire
from orchestrator.transport.handshake import HandshakeError, connect_peer, drafter_role
from orchestrator.transport.messages import CollectDraft, DraftReply, Shutdown, SpeculateFrom
from orchestrator.workers.drafter_server import DrafterServer
from speculators import Speculator
from speculators.corrections import CORRECTION_RANKS, Corrections, Forks
from speculators.draft_length import DraftPrices
from speculators.model import ModelSpeculator
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from speculators.tree import MAX_TREE_ROWS, DraftTree, TreeAsk
from stages.tree_shape import depths


@dataclass(frozen=True)
class DrafterSettings:
    """draft_max: most tokens drafted per request (--draft-max).
    overlap: keep drafting while the machine's own stage runs (--draft-overlap).
    wait_seconds: how long a synchronous request may wait for the draft to finish.
    max_restarts: how often a lost drafter is restarted (--max-restarts).
    sequences: the requests it drafts for at once, a KV sequence each (serve's --max-sequences).
    nodes: Ray nodes (address or id): drafter i runs on nodes[i] instead of
    beside stage i (--drafter-node); the others beside their stages.
    memory_bytes: what the draft holds where it runs, its file and KV cache
    (model_files.draft_memory_bytes): a drafter whose node has less available refuses to start.
    draft_path: a draft model's file here, shipped to every drafter's node
    but this one (shipping.ship_draft) and loaded there from its cache; None: nothing to ship."""

    draft_max: int = DRAFT_MAX
    overlap: bool = False
    wait_seconds: float = DRAFTER_WAIT_SECONDS
    max_restarts: int = MAX_RESTARTS
    sequences: int = 1
    nodes: tuple[str, ...] = ()
    memory_bytes: int = 0
    draft_path: str | None = None


def drafter_settings(speculation, stage, max_restarts: int, sequences: int = 1) -> DrafterSettings:
    """The drafters of ``speculation`` (a SpeculationSettings) beside stages of
    ``stage`` (StageSettings), drafting for ``sequences`` requests at once."""
    from orchestrator.cluster.model_files import draft_memory_bytes

    draft = speculation.draft_path if speculation.speculator == "model" else None
    return DrafterSettings(draft_max=speculation.draft_max, overlap=speculation.overlap, max_restarts=max_restarts,
                           sequences=sequences, nodes=speculation.drafter_nodes, draft_path=draft,
                           memory_bytes=draft_memory_bytes(draft, (stage.n_ctx + speculation.draft_max) * sequences))


def _drafter_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    @readable_class_name  # the dashboard shows "DrafterActor", not "_drafter_actor_class.<locals>.DrafterActor"
    class DrafterActor:
        """Thin Ray shell over a DrafterServer."""

        def __init__(self, index: int, make_speculator: Callable[[], Speculator], settings: DrafterSettings,
                     secret: bytes, loopback: bool, certificate=None):
            """loopback: the coordinator is on this machine; listen on 127.0.0.1 only."""
            from orchestrator.cluster.model_files import check_memory_available

            self.index = index
            self.host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
            check_memory_available(settings.memory_bytes, f"drafter {index}'s draft model (its file and KV cache)",
                                   self.host)
            self.server = DrafterServer(
                make_speculator, self.host,
                draft_max=settings.draft_max, overlap=settings.overlap, wait_seconds=settings.wait_seconds,
                secret=secret, certificate=certificate, index=index, sequences=settings.sequences,
            )

        def peak_rss_mb(self) -> float:
            return peak_rss_mb()

        def compute(self) -> dict | None:
            return self.server.compute()

        def address(self) -> tuple[str, int, str, int]:
            return self.host, self.server.port, ray.get_runtime_context().get_node_id(), os.getpid()

        def __repr__(self) -> str:  # the name shown on the Ray dashboard
            return f"drafter-{self.index}" if hasattr(self, "index") else "drafter (not started)"

    return DrafterActor


class Launched(NamedTuple):
    """A drafter actor started and connected to."""

    actor: object
    sock: socket.socket  # proved (connect_peer)
    node_id: str
    process_id: int  # its worker process: the log that tells why it died is named by it


Launch = Callable[[], Launched]  # starts a drafter actor and connects to it; raises if it cannot


class DrafterClient:
    """The coordinator's handle on one drafter; never raises."""

    def __init__(self, index: int, sock: socket.socket | None, node_id: str = "", actor=None, process_id: int = 0, *,
                 n_vocab: int | None = None, draft_max: int | None = None, relaunch: Launch | None = None,
                 max_restarts: int = 0, on_restart: Callable[[int], None] | None = None):
        """n_vocab, draft_max: what a reply's tokens must stay within (None: unchecked).
        relaunch: starts a replacement after a loss, at most max_restarts times;
        on_restart: told the index each time a replacement rejoins."""
        self.index = index
        self.node_id = node_id
        self.actor = actor
        self.process_id = process_id
        self.n_vocab = n_vocab
        self.draft_max = draft_max
        self._sock = sock
        self._epochs: dict[int, int] = {}  # by KV sequence: its latest request's number
        self._speculating: set[int] = set()  # KV sequences asked to draft and not collected since
        self._asked: set[int] = set()  # KV sequences whose collect was sent (ask) and not yet read
        self._trees: dict[int, tuple[TreeAsk | None, int]] = {}  # by KV sequence: its latest request's tree, root
        self._forks: dict[int, Forks | None] = {}  # by KV sequence: its latest request's forks
        self._corrections: dict[int, Corrections] = {}  # by KV sequence: its last reply's corrections
        self._busy_earlier = 0.0  # drafting seconds of the drafters this one replaced
        self.busy_seconds = 0.0
        self.last_error = ""
        self.lost_reason = "" if sock is not None else "did not start"
        self._relaunch = relaunch
        self._max_restarts = max_restarts
        self._on_restart = on_restart
        self.restarts_started = 0
        self.restarts = 0  # replacements that rejoined
        self.draft_shipment = None  # a draft model's file on its node (shipping.Shipment), set by start_drafters
        self._lock = threading.Lock()
        self._replacement: Launched | None = None
        self._closed = False
        # set while a restarted drafter waits to rejoin (tests wait on it, not on the clock)
        self.replacement_ready = threading.Event()
        if sock is None:
            self._restart_in_background()

    @property
    def alive(self) -> bool:
        return self._sock is not None

    def _lose(self, reason: str, *, connection: bool = False) -> None:
        """Lost for ``reason``; where the connection itself failed (``connection``), the
        process may have died: the reason names its log (a native crash's backtrace is there)."""
        if connection and self.process_id:
            reason = f"{reason}; {worker_log(self.node_id, self.process_id)}"
        self.lost_reason = reason
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._speculating.clear()
        self._asked.clear()
        self._restart_in_background()

    def _restart_in_background(self) -> None:
        if self._relaunch is None or self.restarts_started >= self._max_restarts or self._closed:
            return
        self.restarts_started += 1
        threading.Thread(target=self._restart, args=(self.actor,), name=f"drafter-{self.index}-restart",
                         daemon=True).start()

    def _restart(self, old_actor) -> None:
        import ray

        if old_actor is not None:
            ray.kill(old_actor)  # dead already, or hung: it must not hold its node's memory beside the new one
        try:
            launched = self._relaunch()  # type: ignore[misc]
        except Exception as error:  # noqa: BLE001 - any failure to start leaves the drafter lost, never the run
            self.lost_reason = f"{self.lost_reason}; the restart failed: {one_line(error)}"
            return
        with self._lock:
            if self._closed:  # stopped meanwhile: the replacement must not outlive the run
                launched.sock.close()
                ray.kill(launched.actor)
                return
            self._replacement = launched
        self.replacement_ready.set()

    def _rejoin(self) -> None:
        """Adopt a restarted drafter once it is up (in the loop's thread, between requests)."""
        with self._lock:  # close() may take it meanwhile, from another thread
            launched, self._replacement = self._replacement, None
        if launched is None:
            return
        self.actor, self._sock, self.node_id, self.process_id = launched
        self.replacement_ready.clear()
        self._busy_earlier = self.busy_seconds
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart(self.index)

    def for_sequence(self, sequence: int) -> SequenceDrafter:
        """This drafter as one request's (its KV sequence ``sequence``): the loop's Drafter."""
        return SequenceDrafter(self, sequence)

    def speculate(self, context: list[int], most: int | None = None, sequence: int = 0, *,
                  sampling: SamplingSettings | None = None, tree: TreeAsk | None = None,
                  forks: Forks | None = None) -> None:
        """Ask the drafter to extend context (committed text + speculation) from
        now on, by at most ``most`` tokens (None: up to draft_max), in KV
        sequence ``sequence``; sampling, tree, forks: as the loop's Drafter.speculate."""
        self._rejoin()
        self._corrections.pop(sequence, None)
        if self._sock is None:
            return
        epoch = self._epochs[sequence] = self._epochs.get(sequence, 0) + 1
        self._trees[sequence] = (tree, int(context[-1]))
        self._forks[sequence] = forks
        try:
            wire.send_message(self._sock, SpeculateFrom(epoch, np.asarray(context, dtype=np.int32), most or 0, sequence,
                                                        tree, sampling, forks))
            self._speculating.add(sequence)
        except OSError as error:
            self._lose(f"send failed: {error}", connection=True)

    def ask(self, sequence: int = 0) -> None:
        """Send the collect of ``sequence`` now; its collect() (without wait) then reads the reply."""
        if self._sock is None or sequence not in self._speculating:
            return
        self._speculating.discard(sequence)
        try:
            wire.send_message(self._sock, CollectDraft(self._epochs[sequence], False, sequence))
            self._asked.add(sequence)
        except OSError as error:
            self._lose(f"send failed: {error}", connection=True)

    def collect(self, wait: bool = False, sequence: int = 0) -> list[int]:
        """The tokens drafted since the last speculate of ``sequence`` (best effort); [] if none or lost."""
        reply = self._reply(wait, sequence)
        return [] if reply is None else reply.tokens.tolist()

    def peek(self, sequence: int = 0) -> list[int]:
        """As collect, but the drafter drafts on (its collect then returns these and more)."""
        reply = self._reply(False, sequence, keep=True)
        return [] if reply is None else reply.tokens.tolist()

    def corrections(self, sequence: int = 0) -> Corrections:
        """The corrections of the last reply of ``sequence`` (asked with forks):
        (position, a runner-up of the draft there) -> that token and its continuation."""
        return self._corrections.pop(sequence, {})

    def collect_tree(self, leaves: int, sequence: int = 0) -> DraftTree:
        """The tree drafted since a speculate that asked for one, once grown
        (best effort: a chain where the drafter sent one, the root alone if
        nothing or lost); a reply beyond the tree asked for loses the drafter."""
        ask, token = self._trees.get(sequence, (None, 0))
        root = DraftTree([token], [-1], [0])
        reply = self._reply(True, sequence, ask.rows if ask is not None else None)
        if reply is None:
            return root
        if reply.parents is None:
            return DraftTree.chain(token, reply.tokens.tolist())
        tree = DraftTree([token, *reply.tokens.tolist()], reply.parents.tolist(), reply.ranks.tolist())
        leaf_count = len(tree.parents) - len(set(tree.parents[1:]))
        if leaf_count > min(leaves, ask.leaves):  # type: ignore[union-attr]
            self._lose(f"sent a tree of {leaf_count} leaves (asked for {leaves})")
            return root
        return tree

    def _reply(self, wait: bool, sequence: int, rows: int | None = None, keep: bool = False) -> DraftReply | None:
        """The drafter's checked reply to a collect of ``sequence`` (None: none, or lost);
        rows: the most draft rows it may carry (None: a chain, at most chain_reach(draft_max));
        keep: it drafts on (peek)."""
        asked = sequence in self._asked and not keep
        if self._sock is None or not (asked or sequence in self._speculating):
            return None
        if not keep:
            self._speculating.discard(sequence)
            self._asked.discard(sequence)
        epoch = self._epochs[sequence]
        try:
            if not asked:
                wire.send_message(self._sock, CollectDraft(epoch, wait, sequence, keep))
            self._sock.settimeout(DRAFTER_REPLY_SECONDS)
            reply = wire.receive_message(self._sock)
            self._sock.settimeout(None)
        except (OSError, wire.ConnectionClosed, wire.ProtocolError) as error:
            self._lose(f"no reply: {error or type(error).__name__}", connection=True)
            return None
        if not isinstance(reply, DraftReply) or reply.epoch != epoch or reply.sequence != sequence:
            self._lose(f"unexpected reply {reply!r:.100}")
            return None
        tokens = reply.tokens
        most = rows if rows is not None else self.draft_max and chain_reach(self.draft_max)
        if most is not None and len(tokens) > most:
            self._lose(f"sent {len(tokens)} draft tokens (at most {most})")
            return None
        if reply.parents is not None and rows is None:
            self._lose("sent a tree where a chain was asked for")
            return None
        if self.draft_max is not None and reply.parents is not None and int(depths(reply.parents).max()) > self.draft_max:
            self._lose(f"sent a tree deeper than {self.draft_max}")
            return None
        if self.n_vocab is not None and len(tokens) and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            self._lose(f"sent token ids outside the vocabulary of {self.n_vocab}")
            return None
        if not self._check_corrections(reply, sequence):
            return None
        self.busy_seconds = self._busy_earlier + reply.busy_seconds
        if reply.error:
            self.last_error = reply.error
        return reply

    def _check_corrections(self, reply: DraftReply, sequence: int) -> bool:
        """Keep a reply's corrections if they are where they were asked for,
        no longer than a window and in the vocabulary; else lose the drafter."""
        if not reply.corrections:
            return True
        forks = self._forks.get(sequence)
        if forks is None:
            self._lose("sent corrections that were not asked for")
            return False
        first, count = forks.first, forks.count
        longest = 1 + (self.draft_max or MAX_TREE_ROWS)
        if len(reply.corrections) > count * CORRECTION_RANKS:
            self._lose(f"sent {len(reply.corrections)} corrections (at most {count * CORRECTION_RANKS})")
            return False
        for position, tokens in reply.corrections:
            if not first <= position < first + count or len(tokens) > longest:
                self._lose(f"sent a correction at position {position} of {len(tokens)} tokens"
                           f" (asked for {first}..{first + count - 1}, at most {longest})")
                return False
            if self.n_vocab is not None and (min(tokens) < 0 or max(tokens) >= self.n_vocab):
                self._lose(f"sent token ids outside the vocabulary of {self.n_vocab}")
                return False
        self._corrections[sequence] = {(position, tokens[0]): list(tokens) for position, tokens in reply.corrections}
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            replacement, self._replacement = self._replacement, None
        if replacement is not None:
            self.actor, self._sock = replacement.actor, replacement.sock
        if self._sock is not None:
            try:
                wire.send_message(self._sock, Shutdown())
            except OSError:
                pass
            self._sock.close()
            self._sock = None


def start_drafters(pipeline, make_speculator: Callable[..., Speculator], settings: DrafterSettings,
                   on_restart: Callable[[int], None] | None = None, kind: str = "",
                   progress=None) -> list[DrafterClient]:
    """One drafter actor beside each stage of ``pipeline`` (or on the node
    settings.nodes names for it), connected to this process.

    A draft model (settings.draft_path) is first shipped to every drafter's
    node but this one, and each drafter loads it from there: make_speculator
    then takes the file as ``path=``. progress: stage_cache.ShipProgress, as it goes.
    A drafter that fails to start, or is lost later, is restarted in the
    background (settings.max_restarts); generation goes on without it meanwhile.
    Drafter ``index`` is named ``specpipe-drafter-<index>.<tag>`` with its pipeline's stages' tag
    (connect.actor_name; a service's kept stages' followed by the drafters' own: they die with the
    coordinator, StageActors.drafter_tag), each restart anew; with a ``kind``,
    ``specpipe-drafter-<kind>-<index>.<tag>``, so several sets of drafters (the bench's kinds) can stand
    beside one pipeline."""
    import ray

    actor_class = _drafter_actor_class()
    launches = [0] * len(pipeline.stages)  # per drafter: its actors started so far
    placed = drafter_placement(pipeline, settings.nodes)
    shipped = {}
    if settings.draft_path is not None:
        shipped = ship_draft(settings.draft_path, [place.node for place in placed], pipeline.secret,
                             pipeline.certificate, progress or (lambda *_: None))
    unshipped = {node_id: error for node_id, error in shipped.items() if isinstance(error, ShippingError)}
    makers = [functools.partial(make_speculator, path=shipped[place.node.node_id].path)
              if place.node.node_id in shipped and place.node.node_id not in unshipped else make_speculator
              for place in placed]

    def start(index: int):
        if placed[index].node.node_id in unshipped:  # its node lost while the draft went there, say
            raise unshipped[placed[index].node.node_id]
        name = actor_name(f"drafter-{kind}" if kind else "drafter", index, pipeline.actors.drafter_tag, launches[index])
        launches[index] += 1
        return actor_class.options(**placed[index].options, name=name).remote(
            index, makers[index], settings, pipeline.secret, placed[index].loopback, pipeline.certificate)

    def connect(index: int, actor) -> Launched:
        try:
            host, port, node_id, process_id = ray.get(actor.address.remote(), timeout=ACTOR_START_SECONDS)
            sock = connect_peer(host, port, pipeline.secret, drafter_role(index), CONNECT_SECONDS,
                                pipeline.certificate)
            return Launched(actor, sock, node_id, process_id)
        except BaseException:
            ray.kill(actor)
            raise

    actors = [None if place.node.node_id in unshipped else start(index)  # they load at once, side by side
              for index, place in enumerate(placed)]
    clients = []
    for index, actor in enumerate(actors):
        checks = dict(n_vocab=pipeline.n_vocab, draft_max=settings.draft_max, max_restarts=settings.max_restarts,
                      relaunch=lambda index=index: connect(index, start(index)), on_restart=on_restart)
        try:
            if actor is None:  # its draft could not be shipped to its node (lost meanwhile, say)
                raise unshipped[placed[index].node.node_id]
            launched = connect(index, actor)
            client = DrafterClient(index, launched.sock, launched.node_id, actor, launched.process_id, **checks)
        except (ray.exceptions.RayError, OSError, HandshakeError, ShippingError) as error:
            client = DrafterClient(index, None, **checks)
            client.lost_reason = f"did not start: {one_line(error)}"
        shipment = shipped.get(placed[index].node.node_id)
        client.draft_shipment = None if isinstance(shipment, ShippingError) else shipment
        clients.append(client)
    return clients


def drafter_nodes(nodes: tuple[str, ...], stage_count: int | None = None,
                  lost: Callable[[str], None] | None = None) -> list:
    """The alive Ray nodes (placement.NodeInfo) that ``nodes`` (addresses or ids, --drafter-node) name;
    PlacementError, one line, for a node not alive or more nodes than the ``stage_count`` stages (None:
    not known yet). With ``lost`` (a node may have died since the start's check), a node not alive is None."""

    if stage_count is not None and len(nodes) > stage_count:
        raise PlacementError(f"--drafter-node given {len(nodes)} times, but the pipeline has {stage_count} "
                             f"stage{'s' * (stage_count != 1)}: drafter i drafts in place of the one beside stage i")
    alive = alive_nodes() if nodes else []
    found = []
    for node in nodes:
        try:
            found.append(find_node(alive, node))
        except PlacementError as error:
            if lost is None:
                raise
            lost(str(error))
            found.append(None)
    return found


@dataclass(frozen=True)
class DrafterPlace:
    """Where a drafter runs: its Ray options, whether it listens on loopback
    only (the coordinator is on its machine), and its node (shipping.NodeMemory: address and id)."""

    options: dict
    loopback: bool
    node: NodeMemory


def drafter_placement(pipeline, nodes: tuple[str, ...]) -> list[DrafterPlace]:
    """For each drafter, where it runs: on ``nodes[i]`` where given (drafter_nodes), else beside stage i,
    as also where ``nodes[i]`` was lost since the driver checked it (a serve coordinator started again)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.util.get_node_ip_address()
    named = drafter_nodes(nodes, len(pipeline.stages),
                          lost=lambda why: print(f"a --drafter-node is lost: its drafter drafts beside its stage ({why})"))
    placed = []
    for stage in pipeline.stages:
        node = named[stage.stage_index] if stage.stage_index < len(named) else None
        if node is not None:
            placed.append(DrafterPlace({"max_restarts": 0, "num_cpus": 0,
                                        "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False)},
                                       pipeline.loopback and node.address == here,
                                       NodeMemory(node.address, node.node_id, 0)))
            continue
        address = here if stage.host == LOOPBACK else stage.host
        placed.append(DrafterPlace(pipeline.actor_options(stage.stage_index, num_cpus=0), pipeline.loopback,
                                   NodeMemory(address, stage.node_id, 0)))
    return placed


def draft_seconds_per_token(client: DrafterClient, context: list[int], tokens: int = 4) -> float | None:
    """What one draft token of ``client`` takes, measured by its own clock
    (DraftReply.busy_seconds): it first drafts a token from ``context`` (its
    prefill, not counted), then ``tokens`` more one by one; None if it drafts nothing."""
    client.speculate(context, 1)
    first = client.collect(wait=True)
    if not first:
        return None
    before = client.busy_seconds
    client.speculate(context + first, tokens)
    drafted = client.collect(wait=True)
    return (client.busy_seconds - before) / len(drafted) if drafted else None


def drafter_compute(client: DrafterClient) -> dict | None:
    """Where the client's drafter computes (DrafterServer.compute), or None if it does not answer."""
    import ray

    if client.actor is None or not client.alive:
        return None
    try:
        return ray.get(client.actor.compute.remote(), timeout=DRAFTER_REPLY_SECONDS)
    except ray.exceptions.RayError:
        return None


def speculator_factory(settings, tokenizer, stage, sequences: int = 1, spare_context: int = 0):
    """A picklable function building the speculator inside each drafter actor
    (settings: a SpeculationSettings; stage: the stages' StageSettings): prompt
    lookup, or a draft model with ``sequences`` KV sequences of the stages'
    context plus ``spare_context``; None without a speculator.

    Checks a draft model before anything runs: it must exist and share the
    target's vocabulary token for token."""
    from orchestrator.cluster.model_files import check_draft_model

    if settings.speculator == "ngram":
        return PromptLookupSpeculator
    if settings.speculator == "model":
        check_draft_model(settings.draft_path, tokenizer)
        trees = settings.tree_leaves > 1 and sequences == 1  # a tree grows in the cells after its one sequence
        # corrections (speculators.corrections): a KV id for each runner-up at each draft of a window,
        # a window's cells each
        corrects = settings.asynchronous and sequences == 1
        forks = settings.draft_max * CORRECTION_RANKS if corrects else 0
        branches = DRAFT_TREE_BRANCHES if trees else forks
        cells = MAX_TREE_ROWS if trees else forks * (1 + settings.draft_max)
        return functools.partial(
            ModelSpeculator, path=settings.draft_path, p_min=settings.draft_p_min,
            n_ctx=stage.n_ctx + spare_context + cells,
            threads=settings.draft_threads or stage.threads, device=settings.draft_device, sequences=sequences,
            step_seconds=stage.cost_curve.draft_seconds if stage.cost_curve else 0.0, tree_branches=branches,
        )
    return None


def draft_prices(kind: str, pipeline, drafters: list[DrafterClient], context: list[int], pass_seconds: float,
                 passes: int = 4) -> DraftPrices:
    """What drafting a token costs the target, in one-token passes
    (Pipeline.pass_costs' ``pass_seconds``), measured before a run:

    * awaited: a draft model's step on the drafter beside stage 0, after its
      prefill of ``context`` (draft_seconds_per_token);
    * relayed: how much every drafter drafting at once slows ``passes``
      one-token passes, per token drafted meanwhile: about 0 where the
      drafters have cores the stages do not use, about the step where they share them.

    Prompt lookup (asked in the coordinator), or a drafter that drafts nothing: nothing."""
    if kind != "model" or not drafters or pass_seconds <= 0:
        return DraftPrices()
    step = draft_seconds_per_token(drafters[0], context)
    if not step:
        return DraftPrices()
    for client in drafters[1:]:  # its prefill, as drafter 0's, left out
        client.speculate(context, 1)
        client.collect(wait=True)
    for client in drafters:
        client.speculate(context)
    started = time.perf_counter()
    for _ in range(passes):
        pipeline.forward(np.arange(1, dtype=np.int32), np.ones(1, np.int32), 0)
    slower = time.perf_counter() - started - passes * pass_seconds
    drafted = sum(len(client.collect()) for client in drafters)
    relayed = max(0.0, slower) / pass_seconds / drafted if drafted else 0.0
    return DraftPrices(awaited=step / pass_seconds, relayed=relayed)


def stop_drafters(clients: list[DrafterClient]) -> None:
    import ray

    for client in clients:
        client.close()
        if client.actor is not None:
            ray.kill(client.actor)
