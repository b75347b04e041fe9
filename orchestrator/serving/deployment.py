"""``orchestrate serve``: the split model as a long-lived OpenAI-compatible service on Ray Serve.

One Serve application (``specpipe``) of two deployments, both on the node
``serve`` runs on: the front (``specpipe``), whose ingress is the FastAPI app
of orchestrator.serving.app, and the coordinator (``coordinator``), which the
front asks through a Serve handle (serving.coordinator_calls,
serving.resuming: a request whose coordinator dies goes on through the one
Serve starts next, its text unchanged). Both appear on the Ray dashboard's
Serve page, with Serve's request metrics, and ``serve status`` describes them.
The coordinator's replica owns what ``orchestrate run`` starts for one prompt, started once:
the stage actors and their socket chain (``Pipeline``), and the ``Service``
loop that keeps them busy with many requests. The replica's ``__del__`` (Serve
calls it when the application is deleted) drains the service and closes the
pipeline. The stage actors and their placement group outlive the replica
(orchestrator.cluster.kept_stages): a replica Serve starts after one died takes
them over instead of loading them again, and the driver removes what is
left of them when it stops. A stage lost with its machine moves to a
spare node (a whole model's is shipped there again); with none, the service
answers 503 until a node joins and then resumes (decoding.service,
Pipeline.resume). The replica's health check fails only once the pipeline
has failed for good, so Serve replaces it (a fresh pipeline).

The deployment classes are built inside functions (``coordinator_deployment``,
``front_deployment``) because importing Ray Serve takes seconds and
``orchestrate --help`` must not.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.cluster.connect import ray_session
from orchestrator.cluster.drafter_set import start_speculation
from orchestrator.cluster.drafters import drafter_nodes, speculator_factory, stop_drafters
from orchestrator.cluster.metrics import RestartMetrics, ServiceMetrics
from orchestrator.cluster.ray_calls import one_line
from orchestrator.cluster.reservation import Reservation
from orchestrator.cluster.shipping import ModelToShip, fetch_vocabulary, probe_nodes, ship_whole_model
from orchestrator.config import (COORDINATOR_HEALTH_CHECK_SECONDS, MAX_CONTEXT, REPLICA_BACK_SECONDS,
                                 SERVE_DRAIN_SECONDS, SERVE_KV_MEMORY_SHARE, SERVE_MAX_SEQUENCES)
from orchestrator.decoding.drafting import exact_trees, tree_stage_settings
from orchestrator.decoding.prefix_cache import PREFIX_BLOCK
from orchestrator.decoding.service import Progress, Service, ServiceRequest, ServiceSettings
from orchestrator.serving.coordinator_calls import CoordinatorCalls
from orchestrator.serving.resuming import ResumingService
from orchestrator.transport.handshake import new_secret
from orchestrator.transport.tls import new_chain_certificate
from speculators.draft_length import DraftPrices, curve_step
from speculators.model import draft_gpu_layers
from speculators.prompt_lookup import PromptLookupSpeculator
from stages.errors import SpecpipeError
from stages.gguf_file import stage_info_of
from stages.settings import ALL_LAYERS
from stages.stage_files import check_stage_files

if TYPE_CHECKING:
    from orchestrator.cluster.kept_stages import KeptStages
    from orchestrator.cluster.pipeline_settings import PipelineSettings

APPLICATION = "specpipe"  # Serve's application, and its front deployment's name
COORDINATOR = "coordinator"  # the deployment that holds the pipeline
COORDINATOR_TITLE = f"ServeReplica:{APPLICATION}:{COORDINATOR}"  # its replica process's title (tests, chaos)
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node alone (ray._common.constants)


class ServeError(SpecpipeError):
    """The service could not start as asked; the message is one line."""


@dataclass(frozen=True)
class ShippedStages:
    """Where ``place_stages`` cut a whole model (each stage's first block) and
    shipped its stages (stage index -> node id): the replica's pipeline starts
    them there, and moves one to a spare node if its node is lost, shipping
    it again (placement.replacement_node)."""

    starts: tuple[int, ...]
    nodes: dict[int, str]


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``orchestrate serve`` was asked to do: the pipeline's
    settings (pipeline.stage.sequences is max_sequences), and the service's.
    prefix_cache_tokens: the most tokens finished requests' prefixes keep
    (None: as many as max_sequences sequences hold; 0: no prefix cache),
    in stage.prefix_sequences more KV sequences (``prepare`` fills both in)."""

    pipeline: PipelineSettings
    queue_limit: int
    model_name: str | None = None  # None: the GGUF file's name (model_name_of)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    drain_seconds: float = SERVE_DRAIN_SECONDS
    shipped: ShippedStages | None = None  # where place_stages put whole_model's stages
    vocabulary_path: str | None = None  # a file on this machine with the vocabulary (None: a local stage file)
    prefix_cache_tokens: int | None = None
    kept: KeptStages | None = None  # the stages outlive a replica (orchestrator.cluster.kept_stages); made by the driver

    def with_pipeline(self, **changes) -> ServeSettings:
        """The same with these fields of the pipeline's settings changed."""
        return replace(self, pipeline=replace(self.pipeline, **changes))


def default_max_sequences(kv_bytes: int, available_bytes: int) -> int:
    """Sequences (requests at once) whose KV cache fits SERVE_KV_MEMORY_SHARE of
    the available memory, at most SERVE_MAX_SEQUENCES, at least 1."""
    fitting = int(available_bytes * SERVE_KV_MEMORY_SHARE) // max(kv_bytes, 1)
    return max(1, min(SERVE_MAX_SEQUENCES, fitting))


def available_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def model_name_of(path: str) -> str:
    """The name the API serves the model under: the unsplit file's name without .gguf."""
    info = stage_info_of(path)
    name = info.source_name if info is not None else path
    return Path(name).name.removesuffix(".gguf")


class Coordinator:
    """What the Serve replica holds: tokenizer, pipeline, service, and the app over them."""

    def __init__(self, settings: ServeSettings):
        from orchestrator.cluster.model_files import check_same_model
        from stages.tokenizer import Tokenizer

        self.settings = settings
        self.incarnation = secrets.token_hex(8)  # names this coordinator in its requests' tickets
        tokenizer = Tokenizer(vocabulary_of(settings))
        self.drafters: list = []

        restart_metrics = RestartMetrics()
        speculation = settings.pipeline.speculation
        self.pipeline = settings.pipeline.start(
            pipeline_stages(settings), overlapping=True, prefer=settings.shipped and settings.shipped.nodes,
            kept=settings.kept, on_restart=lambda restart: restart_metrics.record("stage", restart.stage_index))
        try:
            check_same_model(vocabulary_of(settings), self.pipeline.stage_files)
            speculation = exact_trees(speculation, self.pipeline.inexact_tree_stages(), print)  # to the replica's log
            # the pass cost measured here at several widths (or under --cost-curve, the curve's): batching reads it
            pass_curve = self.pipeline.pass_curve(sequence=0)
            pass_seconds, batch_step = pass_curve.at(1), curve_step(pass_curve)
            drafters, draft_prices = self._drafters(tokenizer, speculation, pass_seconds, restart_metrics)
            self.service = Service(
                self.pipeline, tokenizer.is_end,
                ServiceSettings(
                    max_sequences=settings.pipeline.stage.sequences, queue_limit=settings.queue_limit,
                    context=settings.pipeline.stage.n_ctx, speculator=self._speculator(), drafters=drafters,
                    draft_prices=draft_prices, draft_max=speculation.draft_max,
                    schedule=speculation.schedule, stage_count=len(settings.pipeline.stage_paths),
                    tree_leaves=speculation.tree_leaves, batch_step=batch_step, pass_curve=pass_curve,
                    prefix_sequences=settings.pipeline.stage.prefix_sequences,
                    prefix_tokens=settings.prefix_cache_tokens or 0,
                    coupled=speculation.draft_sampling == "coupled",
                ),
                observer=ServiceMetrics(),
            )
        except BaseException:
            stop_drafters(self.drafters)
            self.pipeline.close()
            raise
        self._closed = False

    def _speculator(self):
        """Prompt lookup's speculator of a request, from its KV sequence id,
        asked here (microseconds a token; an actor's round trip would cost
        more than it drafts), or None."""
        if self.settings.pipeline.speculation.speculator == "ngram":
            return lambda sequence: PromptLookupSpeculator()
        return None

    def _drafters(self, tokenizer, speculation, pass_seconds: float, restart_metrics):
        """A draft model's drafter actors, one beside every stage, each with a
        KV sequence per request (run's actors, driven by the same loop), and
        what drafting a token costs (measured: draft_prices); (None, nothing)
        without a draft model. speculation: the settings after exact_trees
        (no tree cells where the stages' trees are off)."""

        pipeline_settings = self.settings.pipeline
        if speculation.speculator != "model":
            return None, DraftPrices()
        stage = pipeline_settings.stage
        make = speculator_factory(speculation, tokenizer, stage, sequences=stage.sequences,
                                  spare_context=speculation.draft_max)
        drafter_set = start_speculation(
            self.pipeline, speculation, make, tokenizer.chat_prompt("Hello."), pass_seconds,
            max_restarts=pipeline_settings.max_restarts, sequences=stage.sequences,
            on_restart=lambda index: restart_metrics.record("drafter", index))
        self.drafters = clients = drafter_set.drafters
        return (lambda sequence: [client.for_sequence(sequence) for client in clients]), drafter_set.prices

    async def stage_load(self):
        """Each stage's StageLoad (KV cells, sequences, resident MiB, process,
        restarts, compute, node), or None for a stage that does not answer (lost, or being restarted)."""
        loads = await asyncio.gather(*self.pipeline.load_calls(), return_exceptions=True)
        restarted = [restart.stage_index for restart in self.pipeline.restarts]
        return [None if isinstance(load, BaseException) else
                load._replace(restarts=restarted.count(index), compute=self.pipeline.stages[index].compute,
                              node_id=self.pipeline.stages[index].node_id)
                for index, load in enumerate(loads)]

    def drafter_health(self) -> list[dict]:
        """Each drafter beside a stage: alive, or why it was last lost, its
        speculator's last failure, its restarts and drafting seconds."""
        return [{"index": client.index, "node": client.node_id, "alive": client.alive, "lost": client.lost_reason,
                 "error": client.last_error, "restarts": client.restarts, "busy_seconds": round(client.busy_seconds, 3)}
                for client in self.drafters]

    async def generate(self, request: ServiceRequest):
        """The request's ticket (this coordinator, its number in the service),
        then its Progress events until every choice ended; the service's
        refusal is raised. Closed early (the front's client went away), the request is cancelled."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Progress] = asyncio.Queue()
        number = self.service.submit(request, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            yield self.incarnation, number
            going = request.choices
            while going:
                event = await events.get()
                going -= event.finished is not None
                yield event
        finally:
            self.service.cancel(number)  # no-op once ended

    def cancel_choice(self, ticket: tuple[str, int], choice: int) -> None:
        """Stop a choice of the request ``ticket`` names; a ticket of an earlier coordinator
        (a cancel that reached this one late) is ignored: its numbers name other requests here."""
        incarnation, number = ticket
        if incarnation == self.incarnation:
            self.service.cancel_choice(number, choice)

    async def health(self) -> tuple[dict, int]:
        """/health's body and status: the service's state, each stage's load and each drafter's."""
        service = self.service
        active, queued = service.counts()
        stages = await self.stage_load()
        body = {  # degraded: a stage lost and no node with room yet; the service resumes by itself
            "status": "failed" if service.failure else "degraded" if service.degraded else "ok",
            "error": service.failure or service.degraded or None,
            "requests_decoding": active,
            "requests_queued": queued,
            "stages": [{"answering": False} if stage is None else
                       {"kv_cells": stage.kv_cells, "sequences": stage.sequences, "rss_mb": round(stage.rss_mb, 1),
                        "process": stage.process_id, "node": stage.node_id, "restarts": stage.restarts,
                        "prefix_cache_tokens": stage.prefix_cells,  # finished requests' prefixes kept
                        # requests per pass so far (over 1: passes shared by requests, continuous batching)
                        "sequences_per_pass": round(stage.windows / stage.passes, 2) if stage.passes else None,
                        "busy_fraction": round(stage.busy_fraction, 3),  # computing, over the last BUSY_WINDOW_SECONDS
                        **(stage.compute.record() if stage.compute else {})}
                       for stage in stages],
            "drafters": self.drafter_health(),
        }
        return body, 503 if service.failure or service.degraded else 200

    def check_health(self) -> None:
        """Raise once the pipeline failed for good, so that Serve replaces
        the replica; its stages are removed first, so that the next replica
        starts fresh ones instead of taking these over (they outlive it)."""
        if self.service.failure:
            self.close()
            raise RuntimeError(f"the pipeline failed: {self.service.failure}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        self.service.close(self.settings.drain_seconds)
        stop_drafters(self.drafters)
        self.pipeline.close()


def where_serve_runs(nodes: list[dict], here: str) -> str:
    """The status line naming ``here``, serve's node (its front and
    coordinator are pinned there, _pinned_here), with a warning where it is
    not Ray's head: losing it ends the service, where the service outlives
    any other node but the head. nodes: ray.nodes()."""
    [node] = [node for node in nodes if node["NodeID"] == here]
    address = node["NodeManagerAddress"]
    if HEAD_RESOURCE in node["Resources"]:
        return f"[the service's HTTP front and coordinator on this node ({address}), Ray's head]"
    return (f"[this node ({address}) is not Ray's head: the service's HTTP front and coordinator run "
            "here, so losing it ends the service; run serve on the head to outlive any other node]")


def _pinned_here() -> dict:
    """Serve's label selector for this node: the replicas read the vocabulary
    from a file here (vocabulary_of), which another node may not hold. Pinned
    by the node's id, not its address: nodes may share one (a ray.cluster_utils.Cluster's do)."""
    import ray

    return {"ray.io/node-id": ray.get_runtime_context().get_node_id()}


def _replica_options(settings: ServeSettings) -> dict:
    return {
        "num_replicas": 1,
        # the service queues and refuses (429) by itself: Serve must let every request through to it
        "max_ongoing_requests": settings.pipeline.stage.sequences + settings.queue_limit + 64,
        "ray_actor_options": {"num_cpus": 0, "label_selector": _pinned_here()},  # the stages hold the CPUs
        "graceful_shutdown_timeout_s": settings.drain_seconds + 10,
    }


def coordinator_deployment(settings: ServeSettings):
    """The deployment whose replica holds the Coordinator (pipeline, drafters,
    service); the front asks it through a handle. Its health check fails once
    the pipeline failed for good, so that Serve replaces it."""
    from ray import serve

    @serve.deployment(name=COORDINATOR, health_check_period_s=COORDINATOR_HEALTH_CHECK_SECONDS,
                      **_replica_options(settings))
    class CoordinatorDeployment:
        def __init__(self, settings: ServeSettings):
            self.coordinator = Coordinator(settings)

        async def generate(self, request: ServiceRequest):
            async for item in self.coordinator.generate(request):
                yield item

        def cancel_choice(self, ticket: tuple[str, int], choice: int) -> None:
            self.coordinator.cancel_choice(ticket, choice)

        async def health(self) -> tuple[dict, int]:
            return await self.coordinator.health()

        def check_health(self) -> None:
            self.coordinator.check_health()

        def __del__(self):
            if hasattr(self, "coordinator"):
                self.coordinator.close()

    return CoordinatorDeployment


def front_deployment(settings: ServeSettings):
    """The ingress deployment: the HTTP app (serving.app) over the
    coordinator's service, reached through its handle (serving.resuming:
    a request whose coordinator dies goes on through the next one)."""
    from ray import serve

    @serve.deployment(name=APPLICATION, **_replica_options(settings))
    @serve.ingress()
    class FrontDeployment:
        def __init__(self, settings: ServeSettings, coordinator):
            from orchestrator.serving.app import Backend
            from stages.tokenizer import Tokenizer

            service = ResumingService(CoordinatorCalls(coordinator), back_seconds=REPLICA_BACK_SECONDS)
            self.backend = Backend(service, Tokenizer(vocabulary_of(settings)), settings.model_name,
                                   settings.pipeline.stage.n_ctx, settings.pipeline.speculation.draft_room,
                                   api_key=settings.api_key)

        def __serve_build_asgi_app__(self):
            from orchestrator.serving.app import build_app

            return build_app(self.backend)

    return FrontDeployment


def vocabulary_of(settings: ServeSettings) -> str:
    """The file on this machine the vocabulary is read from (ServeError if none)."""
    from orchestrator.cluster.model_files import local_vocabulary_file

    path = settings.vocabulary_path or local_vocabulary_file(settings.pipeline.stage_paths)
    if path is None:
        raise ServeError("none of the stage files is on this machine and no vocabulary was fetched")
    return path


def pipeline_stages(settings: ServeSettings):
    """What the replica's Pipeline starts from: the stage files, or a whole
    model shipped before (ShippedStages), cut where it was cut, so that a
    stage lost with its node can be shipped to another."""

    if settings.shipped is None:
        return settings.pipeline.stage_paths
    whole, starts = settings.pipeline.whole_model, settings.shipped.starts
    return ModelToShip(whole.model(), len(starts), lambda nodes: starts, whole.vocabulary_path,
                       offloaded=settings.pipeline.stage.n_gpu_layers == ALL_LAYERS)


def needs_placing(settings: ServeSettings) -> bool:
    """Whether the stages must be placed before the replica starts: a whole
    model to ship, or stage files none of which is here (the vocabulary is
    then read on stage 0's node)."""
    from orchestrator.cluster.model_files import local_vocabulary_file

    pipeline = settings.pipeline
    return pipeline.whole_model is not None or (
        settings.vocabulary_path is None and local_vocabulary_file(pipeline.stage_paths) is None)


def place_stages(settings: ServeSettings, on_status: Callable[[str], None]) -> ServeSettings:
    """With Ray up, before the replica: place the stages, and ship a whole
    model's (as ``orchestrate run --model`` does: ``shipped`` says where, and
    the replica moves a stage whose node is lost) or fetch the vocabulary
    from stage 0's node (the stages are then pinned to those nodes,
    ``place``: their files are there), so that the replica's pipeline finds
    each file where it was put."""
    from orchestrator.cluster.model_files import whole_model_stages

    pipeline = settings.pipeline
    whole = pipeline.whole_model
    shipping = None
    if whole is not None:
        shipping = whole_model_stages(whole, pipeline.stage, pipeline.speculation.draft_path, on_status)
        if shipping is None:  # one unsplit file, one node: it runs as it is
            return replace(settings.with_pipeline(stage_paths=[whole.path], whole_model=None),
                           vocabulary_path=whole.path)
    count = shipping.stage_count if shipping is not None else len(pipeline.stage_paths)
    reservation = Reservation(count, pipeline.place)
    try:
        if shipping is None:
            nodes = [node.node_id for node in probe_nodes(reservation, count)]
            return replace(settings.with_pipeline(place=dict(enumerate(nodes))),
                           vocabulary_path=fetch_vocabulary(pipeline.stage_paths[0], reservation.scheduling_strategy(0)))
        split, shipments = ship_whole_model(shipping, reservation, range(count), new_secret(),
                                            new_chain_certificate() if pipeline.tls else None)
    finally:
        reservation.release()
    shipped = ShippedStages(tuple(split.starts), {item.stage_index: item.node_id for item in shipments})
    # a user's --place stays a pin; else the stages may move (Pipeline's prefer)
    model_name = settings.model_name or Path(shipping.model.name).name.removesuffix(".gguf")  # hf: files are digests
    return replace(settings.with_pipeline(stage_paths=[item.path for item in shipments]), shipped=shipped,
                   vocabulary_path=whole.vocabulary_path, model_name=model_name)


def prepare(settings: ServeSettings) -> ServeSettings:
    """Check the request before anything starts (files), and fill in the defaults
    that depend on the model: its name, and how many sequences fit in memory.
    Runs before Ray starts, unless needs_placing (then after place_stages)."""
    pipeline = settings.pipeline
    if pipeline.address is None and pipeline.whole_model is None and settings.vocabulary_path is None:
        check_stage_files(pipeline.stage_paths)  # a local run: bad files fail before Ray starts
    vocabulary_path = vocabulary_of(settings)
    if settings.model_name is None:
        settings = replace(settings, model_name=model_name_of(vocabulary_path))
    speculation = pipeline.speculation
    if speculation.speculator == "model":  # checked here: a bad draft fails before Ray starts
        from orchestrator.cluster.model_files import check_draft_model
        from stages.tokenizer import Tokenizer

        check_draft_model(speculation.draft_path, Tokenizer(vocabulary_path))
        if pipeline.address is None:  # a local service's drafters use this build: a GPU it lacks is refused
            draft_gpu_layers(speculation.draft_device)
    if speculation.tree_leaves > 1:  # a stage holds a tree's branches beside one sequence only (stages.engine)
        if settings.pipeline.stage.sequences > 1:
            raise ServeError("token trees (--tree-leaves) need --max-sequences 1")
        settings = settings.with_pipeline(stage=tree_stage_settings(replace(settings.pipeline.stage, sequences=1),
                                                                    speculation.tree_leaves))
    if settings.pipeline.stage.sequences < 1:  # not given: what fits in memory (the default prefix cache as much again)
        from orchestrator.cluster.model_files import kv_bytes_per_sequence

        kv_bytes = kv_bytes_per_sequence(vocabulary_path, settings.pipeline.stage.n_ctx)
        streams = 2 if settings.prefix_cache_tokens is None and speculation.tree_leaves == 1 else 1
        draft_bytes = 0 if speculation.speculator != "model" else \
            kv_bytes_per_sequence(speculation.draft_path, settings.pipeline.stage.n_ctx + speculation.draft_max)
        settings = settings.with_pipeline(stage=replace(settings.pipeline.stage, sequences=default_max_sequences(
            kv_bytes * streams + draft_bytes, available_memory_bytes())))  # a drafter holds a sequence per request
    return with_prefix_cache(settings)


def with_prefix_cache(settings: ServeSettings) -> ServeSettings:
    """The prefix cache's budget in tokens and its KV sequences (one per
    n_ctx tokens of the budget); none with token trees (a tree's stage holds
    one sequence, stages.engine)."""
    stage = settings.pipeline.stage
    tokens = stage.sequences * stage.n_ctx if settings.prefix_cache_tokens is None else settings.prefix_cache_tokens
    if stage.tree_sequences or tokens < PREFIX_BLOCK:
        tokens = 0
    sequences = -(-tokens // stage.n_ctx)
    if stage.n_ctx * (stage.sequences + sequences) > MAX_CONTEXT:
        raise ServeError(f"--n-ctx {stage.n_ctx} x ({stage.sequences} sequences + {sequences} for the prefix "
                         f"cache) exceeds {MAX_CONTEXT} KV cells per stage: lower --prefix-cache-tokens")
    return replace(settings.with_pipeline(stage=replace(stage, prefix_sequences=sequences)), prefix_cache_tokens=tokens)


def serve_until_stopped(settings: ServeSettings, on_status: Callable[[str], None]) -> None:
    """Start Ray (or join --address), run the deployment, serve until SIGINT or
    SIGTERM, then delete it (in-flight requests drain) and stop Serve."""
    import ray

    from orchestrator.cluster.kept_stages import SERVE_NAMESPACE, KeptStages

    settings = replace(settings, pipeline=settings.pipeline.with_local_draft(on_status))  # before Ray starts
    placing = needs_placing(settings)
    if not placing:
        settings = prepare(settings)
    stop = threading.Event()
    # in Serve's namespace, where the replica names the stages it keeps: what is left of them is removed at the end
    pipeline = settings.pipeline
    with ray_session(pipeline.address, dashboard=pipeline.dashboard, namespace=SERVE_NAMESPACE) as where:
        # after ray.init, which installs its own SIGTERM handler (it prints a stack and exits)
        previous = {number: signal.signal(number, lambda *_: stop.set()) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            if where:
                on_status(f"[{where}]")
            on_status(where_serve_runs(ray.nodes(), ray.get_runtime_context().get_node_id()))
            drafter_nodes(pipeline.speculation.drafter_nodes)  # a node not alive fails before the stages load
            if placing:
                settings = prepare(place_stages(settings, on_status))
            _run_application(replace(settings, kept=KeptStages.new(pipeline.tls)), on_status, stop)
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)


def _run_application(settings: ServeSettings, on_status: Callable[[str], None], stop: threading.Event) -> None:
    from ray import serve

    # Serve logs every step at INFO on the console; this command prints its own
    # (Serve's own logs stay in /tmp/ray/session_latest/logs/serve/).
    logging.getLogger("ray.serve").setLevel(logging.WARNING)

    stage = settings.pipeline.stage
    on_status(f"starting {len(settings.pipeline.stage_paths)} stages and the service "
              f"({stage.sequences} sequences of {stage.n_ctx} tokens, a prefix cache of "
              f"{settings.prefix_cache_tokens} tokens)...")
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        # returns once the replica has started (the stages loaded) or failed
        coordinator = coordinator_deployment(settings).bind(settings)
        serve.run(front_deployment(settings).bind(settings, coordinator), name=APPLICATION, route_prefix="/",
                  blocking=False)
    except Exception as error:  # Serve reports a replica that failed to start as a RuntimeError with its traceback
        _shutdown_serve(settings)
        raise ServeError(f"the service did not start: {one_line(error)}") from None
    key = " (API key required)" if settings.api_key else ""
    on_status(f"serving {settings.model_name!r} on http://{settings.host}:{settings.port}/v1{key}; "
              "Ctrl-C or SIGTERM stops it")
    try:
        stop.wait()
    finally:
        on_status("stopping: requests in flight may finish...")
        _shutdown_serve(settings)
        on_status("stopped")


def _shutdown_serve(settings: ServeSettings) -> None:
    """Delete the application (its replica drains and closes its stages),
    stop Serve, and remove what is left of the kept stages (a replica that
    died just before could not)."""
    from ray import serve

    from orchestrator.cluster.kept_stages import remove_kept

    try:
        serve.delete(APPLICATION)
    except Exception:  # never started
        pass
    serve.shutdown()
    remove_kept(settings.kept)
