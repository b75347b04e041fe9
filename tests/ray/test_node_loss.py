"""A machine lost mid-generation (issue 36): a Ray node of a cluster of this
test's own (``ray.cluster_utils.Cluster``: one head without CPUs, which no
stage can use, and three one-CPU nodes) removed while its stage computes, as
a machine that dies would be: its processes killed, the node gone from Ray.
The stage comes back on the spare node, shipped there again, and every token
equals an uninterrupted run's. A node that holds only a drafter may go too:
the run goes on without it.

Its own cluster, not the session's: removing one of the session's nodes
would take it from every test after. The session's Ray is stopped before
this file runs (conftest.py runs the files on it first)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

import pytest

from orchestrator.cluster.model_files import WholeModelSettings, whole_model_stages
from orchestrator.cluster.pipeline import Pipeline
from orchestrator.decoding.loop import generate
from orchestrator.transport.liveness import StageDeadlines
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings
from stages.tokenizer import Tokenizer

from conftest import PROMPTS

pytestmark = pytest.mark.system  # machines lost, minutes of Ray calling them dead: `make test-system`

SETTINGS = StageSettings(n_ctx=1024)
MAX_TOKENS = 24
# the frozen machine's stage: found silent within 1 + 5 s, then 4 s for its actor and 4 for its node to answer
# (14 s, before Ray calls the node dead; the other losses of its run, and its no-room run, share them)
FROZEN_DEADLINES = StageDeadlines(ping_seconds=1.0, silence_seconds=5.0, answer_seconds=4.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, monkeypatch_module):
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.cluster.connect import ray_environment

    ray_environment()
    # stage caches of this test's: the driver's, and one for each node (add_worker), as each machine has a disk
    caches = tmp_path_factory.mktemp("stage-caches")
    monkeypatch_module.setenv("SPECPIPE_STAGE_CACHE", str(caches / "driver"))
    # Ray's health checks 1 s apart, 15 missed: a frozen node is called dead ~16 s on, after the frozen
    # node's stage (the first test) had 1 + 5 s to be silent and 4 + 4 s to answer (FROZEN_DEADLINES: so the wait for
    # its node's death is what finds it lost), not Ray's default ~35 s; a node killed hard is found as soon
    checks = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 15}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * 1024**2,
                                                            "include_dashboard": False, "_system_config": checks})
    cluster.stage_caches = caches
    for _ in range(3):
        add_worker(cluster)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_worker(cluster) -> None:
    """A one-CPU node with a stage cache of its own: a stage shipped to it is
    written there, not found where another node put it (its raylet, and so its
    workers, get SPECPIPE_STAGE_CACHE)."""
    cluster.added = getattr(cluster, "added", 0) + 1
    cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2,
                     env_vars={"SPECPIPE_STAGE_CACHE": str(cluster.stage_caches / f"node-{cluster.added}")})


def with_workers(cluster, count: int):
    """The cluster with ``count`` one-CPU worker nodes besides its head (a test before may have removed one)."""
    while len(cluster.list_all_nodes()) > count + 1:
        cluster.remove_node(cluster.list_all_nodes()[-1])
    while len(cluster.list_all_nodes()) < count + 1:
        add_worker(cluster)
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture
def three_workers(cluster):
    return with_workers(cluster, 3)


@contextlib.contextmanager
def serving(cluster, model: str, tmp_path, max_sequences: int):
    """`orchestrate serve --model MODEL --stages 2` on the cluster: (its base URL,
    the index of a stage not on the coordinator's node, that stage's node id, its log)."""
    import httpx
    import ray

    from benchmarks.serve_bench import replica_node, start_specpipe_server, stop_server
    from conftest import free_port
    from orchestrator.serving.deployment import where_serve_runs

    port, log = free_port(), tmp_path / "serve.log"
    server = start_specpipe_server(["--address", cluster.address, "--model", model, "--stages", "2",
                                    "--max-sequences", str(max_sequences), "--n-ctx", "512"], port, log)
    try:
        base = f"http://127.0.0.1:{port}"
        stages = httpx.get(base + "/health", timeout=30).json()["stages"]
        coordinator = replica_node(cluster)
        assert coordinator.node_id == cluster.head_node.node_id  # where serve's driver runs, however nodes share addresses
        assert "), Ray's head]" in log.read_text()  # serve said so; a worker's node gets a warning instead
        [worker] = [node for node in ray.nodes() if node["Alive"] and node["NodeID"] != coordinator.node_id][:1]
        assert "is not Ray's head" in where_serve_runs(ray.nodes(), worker["NodeID"])
        index = next(index for index, stage in enumerate(stages) if stage["node"] != coordinator.node_id)
        yield base, index, stages[index]["node"], log
        assert server.poll() is None  # the same serve process throughout
    finally:
        stop_server(server, timeout=60)  # let it remove its stages
    # the stage actors outlive a replica (detached) but not the service
    left = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith("specpipe-")]
    assert not left, left


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def removing_node(cluster, pipeline, stage_index: int, after_tokens: int, graceful: bool = False):
    """An on_token callback that removes the Ray node running stage
    ``stage_index`` once ``after_tokens`` tokens are out, killed as a machine
    dies (or drained: ``graceful``); .removed tells which node."""
    produced = []

    def on_token(token):
        produced.append(token)
        if len(produced) == after_tokens:
            node_id = pipeline.stages[stage_index].node_id
            [node] = [node for node in cluster.list_all_nodes() if node.node_id == node_id]
            if not graceful:  # a machine's death takes its processes with it; here they may outlive the raylet
                os.kill(pipeline.stages[stage_index].process_id, signal.SIGKILL)
            cluster.remove_node(node, allow_graceful=graceful)
            on_token.removed = node_id

    on_token.removed = None
    return on_token


def test_each_lost_node_s_stage_is_shipped_to_a_spare_and_no_token_changes_then_without_room_the_run_ends(
        cluster, smollm2, reference):
    """Four workers, two of them spares, in one generation: stage 1's node
    removed after the 8th token, as a machine that dies; then stage 0's
    node frozen after the 16th (SIGSTOP to its raylet and every process
    under it: a machine that hangs, or whose link is cut, answers nothing
    and closes no socket). Stage 1 comes back at once; stage 0 does not
    answer, and once Ray's health checks call its node dead it is lost, not
    hung (it used to be named hung and the run failed). Each comes back on
    a node that held none, shipped there again, and every token equals an
    uninterrupted run's. (These were three runs: each loss alone.)

    Then, no spare left, stage 1's node again, in the next generation: the
    stage has nowhere to go, and within ROOM_WAIT_SECONDS the run ends with
    a StageWaiting that says so (the CLI prints it as one line, exit 1), not
    after the 300 s it used to wait."""
    import psutil

    from orchestrator.cluster.recovery import StageWaiting

    with_workers(cluster, 4)
    tokens = reference.tokenize(PROMPTS[2])
    model = whole_model_stages(WholeModelSettings(smollm2, stages=2), SETTINGS, None, None)
    frozen: list[psutil.Process] = []
    with Pipeline(model, SETTINGS, pass_deadline_minimum=3.0, deadlines=FROZEN_DEADLINES) as pipeline:
        nodes = [stage.node_id for stage in pipeline.stages]
        remove = removing_node(cluster, pipeline, 1, after_tokens=1)
        [frozen_node] = [node for node in cluster.list_all_nodes() if node.node_id == nodes[0]]
        produced = []

        def on_token(token):
            produced.append(token)
            if len(produced) == 8:
                remove(token)
            if len(produced) == 16:
                [raylet] = [psutil.Process(info.process.pid) for info in frozen_node.all_processes["raylet"]]
                frozen.extend([raylet, *raylet.children(recursive=True)])
                for process in frozen:
                    process.send_signal(signal.SIGSTOP)

        try:
            result = generate(pipeline, tokens, MAX_TOKENS, SamplingSettings(), Tokenizer(smollm2).is_end,
                              on_token=on_token)
        finally:
            for process in frozen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            cluster.remove_node(frozen_node, allow_graceful=False)
        assert remove.removed == nodes[1] and frozen
        assert result.tokens == reference.greedy(tokens, MAX_TOKENS).tokens
        assert [(restart.stage_index, restart.old_node_id) for restart in pipeline.restarts] == [(1, nodes[1]),
                                                                                                 (0, nodes[0])]
        assert "Ray reports it dead" in pipeline.restarts[1].reason, pipeline.restarts[1].reason
        spares = {node.node_id for node in cluster.list_all_nodes()} - set(nodes) - {cluster.head_node.node_id}
        assert {stage.node_id for stage in pipeline.stages} == spares  # each on a node that held no stage
        # shipped again, whole, into the spare's own cache (the stage then runs from the file there)
        assert [(shipment.stage_index, shipment.node_id) for shipment in pipeline.shipments[2:]] == [
            (restart.stage_index, restart.node_id) for restart in pipeline.restarts]
        assert all(shipment.bytes_sent == shipment.size > 0 for shipment in pipeline.shipments[2:])
        assert len({shipment.path for shipment in pipeline.shipments}) == 4

        # drained: killed hard, the stage's process may outlive its raylet long enough to finish this
        # short run (a full make test saw it, 2026-12-06); the no-room path is what this part is for
        remove = removing_node(cluster, pipeline, 1, after_tokens=4, graceful=True)
        started = time.monotonic()
        with pytest.raises(StageWaiting, match="stage 1 lost its node and no other node has room for it"):
            generate(pipeline, tokens, MAX_TOKENS, SamplingSettings(), Tokenizer(smollm2).is_end, on_token=remove)
        assert remove.removed and time.monotonic() - started < 120


def test_a_lost_drafter_only_node_changes_no_token_and_is_named(three_workers, smollm2, reference,
                                                                realistic_draft):
    """A draft model's drafter 0 (the one async waits for after a rejection)
    on a node that holds no stage (--drafter-node), that node killed and
    removed mid-generation: the run goes on without it, every token the
    whole model's, and the drafter says it was lost; drafters started again
    (a serve coordinator restarted) put drafter 0 beside stage 0."""
    import psutil
    import ray

    from orchestrator.cluster.drafter_set import start_drafter_set
    from orchestrator.cluster.drafters import DrafterSettings, speculator_factory
    from orchestrator.decoding.drafting import SpeculationSettings
    from orchestrator.decoding.schedule import Schedule

    from stages.cost_curve import BatchCurve, CostCurve, StageCurve

    cluster = three_workers
    tokens = reference.tokenize(PROMPTS[0])
    # passes of at least 30 ms, flat, as a memory-bound machine's: drafts pay, so drafter 0 is in use when lost
    flat = dataclasses.replace(SETTINGS, cost_curve=CostCurve("flat 30 ms", (StageCurve(BatchCurve((1, 64),
                                                                                                 (0.03, 0.03))),)))
    model = whole_model_stages(WholeModelSettings(smollm2, stages=2), flat, None, None)
    with Pipeline(model, flat) as pipeline:
        stage_nodes = {stage.node_id for stage in pipeline.stages}
        [node] = [node for node in cluster.list_all_nodes()
                  if node.node_id not in stage_nodes and node is not cluster.head_node]
        make = speculator_factory(SpeculationSettings("model", realistic_draft, Schedule.ASYNC, draft_max=4),
                                  Tokenizer(smollm2), flat)
        drafters = start_drafter_set(pipeline, "model", make,
                                     DrafterSettings(draft_max=4, nodes=(node.node_id,), draft_path=realistic_draft))
        try:
            assert drafters.drafters[0].node_id == node.node_id and drafters.drafters[0].alive
            pass_seconds, step = pipeline.pass_costs()  # as a run measures them
            drafters.measure_prices(pipeline, tokens, pass_seconds)
            produced, drafted_before = [], []

            def lose_the_drafter_s_node(token):
                produced.append(token)
                if len(produced) == 8:  # a machine's death takes its processes with it
                    drafted_before.append(drafters.drafters[0].busy_seconds)
                    [raylet] = [psutil.Process(info.process.pid) for info in node.all_processes["raylet"]]
                    for process in raylet.children(recursive=True):
                        process.kill()
                    cluster.remove_node(node, allow_graceful=False)

            result = generate(pipeline, tokens, MAX_TOKENS, SamplingSettings(), Tokenizer(smollm2).is_end,
                              on_token=lose_the_drafter_s_node, drafting=drafters.drafting(Schedule.ASYNC, 4, step=step))
            assert result.tokens == reference.greedy(tokens, MAX_TOKENS).tokens
            assert drafted_before[0] > 0 and result.speculation.accepted_tokens > 0  # it drafted until lost
            assert not drafters.drafters[0].alive and drafters.drafters[0].lost_reason, drafters.drafters[0].lost_reason
            assert pipeline.restarts == []  # the stages never noticed
            drafters.stop()
            deadline = time.monotonic() + 60  # Ray calls the node dead once its heartbeats are missed
            while any(known["NodeID"] == node.node_id and known["Alive"] for known in ray.nodes()):
                assert time.monotonic() < deadline
                time.sleep(0.5)
            # as serve's next coordinator starts them, the node still named: drafter 0 goes beside stage 0
            drafters = start_drafter_set(pipeline, "model", make, DrafterSettings(draft_max=4, nodes=(node.node_id,),
                                                                                 draft_path=realistic_draft))
            assert [client.node_id for client in drafters.drafters] == [stage.node_id for stage in pipeline.stages]
            assert all(client.alive for client in drafters.drafters)
        finally:
            drafters.stop()


def test_serve_moves_a_lost_stage_to_the_spare_then_without_one_answers_503_and_resumes_when_a_node_joins(
        three_workers, smollm2, reference, tmp_path):
    """`orchestrate serve --model` on the cluster, four streamed greedy
    requests in flight, the node of a stage (not the coordinator's) removed:
    every request finishes with the whole model's text, and the stage runs on
    the spare. Before, serve pinned each stage to its first node and every
    request failed ('could not read the stage files on their node').

    Then, the same server with no spare left: another stage's node removed
    under a request. The request and the next ones get 503 with Retry-After
    naming the lost node, /health says degraded; a node joins and, without
    restarting serve, a request gets the whole model's text. (One server for
    both: a serve start is about 20 s of this file.)"""
    import asyncio

    import httpx
    import openai

    from benchmarks.serve_bench import replica_node

    cluster = three_workers
    with serving(cluster, smollm2, tmp_path, max_sequences=4) as (base, index, lost, log):
        stage_process = httpx.get(base + "/health", timeout=30).json()["stages"][index]["process"]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], "1, 2, 3, 4,"]
        expected = [reference.llama.detokenize(reference.greedy(reference.tokenize(prompt), 40).tokens)
                    .decode("utf-8", errors="replace") for prompt in prompts]

        async def ask(client, model, prompt, started):
            text = ""
            async for chunk in await client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                                                temperature=0, stream=True):
                started.set()
                text += chunk.choices[0].text if chunk.choices else ""
            return text

        async def main():
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            started = asyncio.Event()
            asks = [asyncio.create_task(ask(client, model, prompt, started)) for prompt in prompts]
            await started.wait()
            [node] = [node for node in cluster.list_all_nodes() if node.node_id == lost]
            os.kill(stage_process, signal.SIGKILL)  # a machine's death takes its processes with it
            await asyncio.to_thread(cluster.remove_node, node, False)  # killed, as a machine dies: no drain
            return await asyncio.gather(*asks)

        async def main_without_loss():
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            return [await ask(client, model, prompts[0], asyncio.Event())]

        texts = asyncio.run(main())
        assert texts == expected, log.read_text()[-3000:]
        health = httpx.get(base + "/health", timeout=30).json()
        assert health["status"] == "ok" and health["stages"][index]["restarts"] == 1
        moved = health["stages"][index]["node"]
        assert moved not in (lost, health["stages"][1 - index]["node"])

        # then only its process is killed: it restarts where it is now (its node lives)
        os.kill(health["stages"][index]["process"], signal.SIGKILL)
        assert asyncio.run(main_without_loss()) == expected[:1]
        health = httpx.get(base + "/health", timeout=30).json()
        assert health["stages"][index]["restarts"] == 2 and health["stages"][index]["node"] == moved

        # no spare now: the node of a stage not beside the coordinator removed under a request, the stage
        # restarted least if both qualify (the one restarted twice is one restart from serve's limit)
        coordinator = replica_node(cluster)
        lost = min((stage for stage in health["stages"] if stage["node"] != coordinator.node_id),
                   key=lambda stage: stage["restarts"])["node"]
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0}

        async def in_flight_then_lost():
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                asked = asyncio.create_task(client.post("/v1/completions", json=body))
                while httpx.get(base + "/health", timeout=30).json()["requests_decoding"] == 0:
                    await asyncio.sleep(0.05)
                [node] = [node for node in cluster.list_all_nodes() if node.node_id == lost]
                await asyncio.to_thread(cluster.remove_node, node)
                return await asked

        during = asyncio.run(in_flight_then_lost())
        assert during.status_code == 503 and during.headers["Retry-After"] == "5", during.text
        assert lost[:8] in during.json()["error"]["message"] and "no other node has room" in during.text
        refused = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert refused.json()["error"]["message"].startswith("the service is degraded: stage ")
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "degraded" and lost[:8] in health.text

        add_worker(cluster)
        for _ in range(240):
            if httpx.get(base + "/health", timeout=30).json()["status"] == "ok":
                break
            time.sleep(0.5)
        after = httpx.post(base + "/v1/completions", json=body, timeout=120)
        expected = reference.greedy(reference.tokenize(PROMPTS[1]), 60).tokens
        assert after.status_code == 200, log.read_text()[-3000:]
        assert after.json()["choices"][0]["text"] == reference.llama.detokenize(expected).decode("utf-8", "replace")
        settled = httpx.get(base + "/health", timeout=30).json()
        assert [stage["kv_cells"] for stage in settled["stages"]] == [0, 0]  # nothing held beyond the prefix cache
