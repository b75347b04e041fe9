"""The pipeline on a real three-node Ray cluster (three raylets on this machine)."""

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from orchestrator.decoding.loop import generate
from orchestrator.cluster.pipeline import Pipeline, PipelineError
from orchestrator.transport.liveness import StageDeadlines
from orchestrator.cluster.placement import PlacementError
from speculators.sampling import SamplingSettings
from stages.tokenizer import Tokenizer
from stages.settings import StageSettings
from stages.gguf_file import ModelFileError

from conftest import PROMPTS, orchestrate

SETTINGS = StageSettings(n_ctx=1024)


def run(pipeline, tokenizer, prompt_tokens, max_tokens, sampling=SamplingSettings()):
    return generate(pipeline, prompt_tokens, max_tokens, sampling, tokenizer.is_end)


@pytest.mark.parametrize("stage_count", [2, 3])
def test_greedy_pipeline_equals_llama_and_stages_land_on_distinct_nodes(ray_cluster, splits, reference, stage_count):
    tokenizer = Tokenizer(splits[stage_count][0])
    with Pipeline(splits[stage_count], SETTINGS) as pipeline:
        nodes = [stage.node_id for stage in pipeline.stages]
        assert len(set(nodes)) == stage_count
        # every node of this test cluster is this machine: nothing listens beyond loopback
        # (across real hosts the stages listen on their addresses: tests/hosts/test_two_hosts.py)
        assert pipeline.loopback and pipeline.chain.address[0] == "127.0.0.1"
        assert {stage.host for stage in pipeline.stages} == {"127.0.0.1"}
        assert [(stage.first_block, stage.end_block) for stage in pipeline.stages][0][0] == 0
        for prompt in PROMPTS:
            tokens = reference.tokenize(prompt)
            expected = reference.greedy(tokens, 40).tokens
            assert run(pipeline, tokenizer, tokens, 40).tokens == expected, prompt
        reports = pipeline.reports()
        assert all(report.busy_seconds > 0 and report.passes > 0 for report in reports)
        # the node each stage reports is where Ray's own actor table has its process
        assert [report.node_id for report in reports] == [actor_nodes()[stage.process_id] for stage in pipeline.stages]
        assert pipeline.hop_seconds > 0  # measured; its size is benchmarks.probe transport-hop's business


def stage_actors() -> dict[str, dict]:
    """Ray's own table of stage actors, by actor id (ray.util.state needs the
    dashboard, which this cluster has not). The class is named by its
    qualified name (defined inside orchestrator.cluster.stage_actors.stage_actor_class)."""
    from ray._private.state import actors

    return {actor_id: actor for actor_id, actor in actors().items()
            if actor["ActorClassName"].rsplit(".", 1)[-1] == "StageActor"}


def actor_nodes() -> dict[int, str]:
    """Process id -> node id of every live stage actor, from Ray's actor table."""
    return {actor["Pid"]: actor["Address"]["NodeID"] for actor in stage_actors().values() if actor["State"] == "ALIVE"}


def test_seeded_sampling_is_reproducible(ray_cluster, splits, reference):
    tokenizer = Tokenizer(splits[2][0])
    tokens = reference.tokenize(PROMPTS[2])
    with Pipeline(splits[2], SETTINGS) as pipeline:
        first = run(pipeline, tokenizer, tokens, 30, SamplingSettings(temperature=0.9, top_p=0.95, seed=11)).tokens
        again = run(pipeline, tokenizer, tokens, 30, SamplingSettings(temperature=0.9, top_p=0.95, seed=11)).tokens
        other = run(pipeline, tokenizer, tokens, 30, SamplingSettings(temperature=0.9, top_p=0.95, seed=12)).tokens
    assert first == again
    assert first != other
    assert first != reference.greedy(tokens, 30).tokens  # the temperature reached the sampler


def test_serve_s_replicas_are_pinned_to_the_driver_s_node_by_its_id(ray_cluster):
    """`orchestrate serve`'s replicas read the vocabulary from the driver's machine, so they run on the
    driver's node: pinned by the node's id, since nodes may share an address (the session's three do).
    Pinned by the address, Ray could place it on any of them: with a head busy, on a worker whose loss
    then cut the requests in flight (docs/measurements.md, a stage's machine lost)."""
    import ray

    from orchestrator.cluster.pipeline_settings import PipelineSettings
    from orchestrator.serving.deployment import ServeSettings, coordinator_deployment, front_deployment

    settings = ServeSettings(PipelineSettings(["stage-0.gguf"], StageSettings()), queue_limit=1)
    for deployment in (coordinator_deployment, front_deployment):
        options = deployment(settings).ray_actor_options
        assert options["label_selector"] == {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
        assert "resources" not in options and options["num_cpus"] == 0


def test_explicit_placement_and_its_errors(ray_cluster, splits):
    import ray

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    place = {0: nodes[2], 1: nodes[1]}
    with Pipeline(splits[2], SETTINGS, place=place) as pipeline:
        assert [stage.node_id for stage in pipeline.stages] == [nodes[2], nodes[1]]
    with pytest.raises(PlacementError, match="no alive node"):
        Pipeline(splits[2], SETTINGS, place={0: "10.255.255.1", 1: nodes[0]})


def test_a_stage_error_reaches_the_coordinator_as_one_line(ray_cluster, splits):
    with Pipeline(splits[2], StageSettings(n_ctx=64)) as pipeline:
        with pytest.raises(PipelineError, match="stage 0 failed: position 5000 is beyond the context of"):
            pipeline.forward(np.array([5000], np.int32), np.array([1], np.int32), 5000)
        # the pipeline still works after a failed pass
        reply = pipeline.forward(np.arange(3, dtype=np.int32), np.array([1, 2, 3], np.int32), 0)
        assert reply.logits.shape == (1, pipeline.n_vocab)


def test_lossy_f16_wire_is_close_and_labelled_lossy(ray_cluster, splits):
    tokens = np.arange(100, 120, dtype=np.int32)
    positions = np.arange(20, dtype=np.int32)
    with Pipeline(splits[2], SETTINGS) as exact, Pipeline(splits[2], SETTINGS, wire_dtype="f16") as lossy:
        expected = exact.forward(positions, tokens, 0).logits
        approximate = lossy.forward(positions, tokens, 0).logits
    assert approximate.dtype == np.float32 and approximate.shape == expected.shape
    difference = float(np.max(np.abs(approximate - expected)))
    assert 0.0 < difference < 2.0  # really rounded on the wire (measured ~0.34), yet close
    assert int(np.argmax(approximate)) == int(np.argmax(expected))
    # the label: wherever --wire-dtype is offered, its help says f16 is lossy
    from click.testing import CliRunner

    from orchestrator.cli import main

    for command in ("run", "serve"):
        (option,) = [option for option in main.commands[command].params if option.name == "wire_dtype"]
        assert option.default == "f32" and "f16 halves traffic but is LOSSY" in option.help, command
        shown = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
        assert "f16 halves traffic but is LOSSY (output may differ from the whole model)" in shown, command


def alive_nodes_in_order():
    import ray

    return [node for node in ray.nodes() if node["Alive"]]


def test_a_stage_file_missing_on_its_node_fails_before_any_stage_loads(ray_cluster, splits, tmp_path, monkeypatch):
    """Each file is read on the node that is to run it. (All nodes here share one
    file system, so "missing on that node" is a path that exists nowhere.)"""
    from orchestrator.cluster import stage_actors as actors_module

    def no_stage_may_load():
        raise AssertionError("a stage began loading before the files were checked")

    monkeypatch.setattr(actors_module, "stage_actor_class", no_stage_may_load)
    nodes = alive_nodes_in_order()
    missing = str(tmp_path / "b.gguf")
    with pytest.raises(ModelFileError) as raised:
        Pipeline([splits[2][0], missing], SETTINGS, place={0: nodes[1]["NodeID"], 1: nodes[2]["NodeID"]})
    node = f"{nodes[2]['NodeManagerAddress']} ({nodes[2]['NodeID'][:8]})"
    assert str(raised.value) == f"stage 1 file {missing} not found on node {node}"


def test_an_invalid_stage_file_on_its_node_is_named_with_the_node(ray_cluster, splits, tmp_path):
    nodes = alive_nodes_in_order()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(splits[2][1], "rb").read(100_000))
    with pytest.raises(ModelFileError) as raised:
        Pipeline([splits[2][0], str(truncated)], SETTINGS, place={0: nodes[0]["NodeID"], 1: nodes[1]["NodeID"]})
    node = f"{nodes[1]['NodeManagerAddress']} ({nodes[1]['NodeID'][:8]})"
    assert str(raised.value).startswith(f"stage 1 file on node {node}: {truncated}: truncated GGUF file")


def test_the_whole_set_is_validated_from_the_nodes_readings(ray_cluster, splits):
    """Spread over the cluster (a placement group), the set checks still apply."""
    with pytest.raises(ModelFileError, match="out of order"):
        Pipeline([splits[2][1], splits[2][0]], SETTINGS)
    with pytest.raises(ModelFileError, match="stage 2 of 3 missing"):
        Pipeline([splits[3][0], splits[3][2]], SETTINGS)
    with Pipeline(splits[2], SETTINGS) as pipeline:  # the failed attempts left the nodes free
        assert [info.stage_index for info in pipeline.stage_files] == [0, 1]


def test_run_on_a_cluster_names_the_node_of_a_missing_file(ray_cluster, splits, tmp_path):
    """`orchestrate run --address` as a driver of an existing cluster: one error line."""
    missing = tmp_path / "b.gguf"
    result = orchestrate("run", "--address", ray_cluster.address, "--model-split", splits[2][0], missing,
                         "--prompt", "hi", "--max-tokens", "2")
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    addresses = {node["NodeManagerAddress"] for node in alive_nodes_in_order()}
    assert len(lines) == 1 and lines[0].startswith(f"error: stage 1 file {missing} not found on node "), result.stderr
    assert lines[0].split(" not found on node ")[1].split(" ")[0] in addresses


def test_a_stopped_stage_is_found_silent_long_before_the_deadline_and_named(ray_cluster, splits):
    """SIGSTOP stage 1: it leaves the coordinator's pings unanswered, so the
    pass is late long before its deadline (120 s), and the error names the
    stage that does not answer (transport.liveness). The deadlines shortened
    (pings 1 s apart, silent after 3 s, 3 s to answer Ray; 5, 15 and 10 by
    default) to see the same path in a third of the time."""
    deadlines = StageDeadlines(ping_seconds=1.0, silence_seconds=3.0, answer_seconds=3.0)
    with Pipeline(splits[2], StageSettings(n_ctx=64), deadlines=deadlines) as pipeline:
        tokens, positions = np.array([1, 2, 3], np.int32), np.arange(3, dtype=np.int32)
        pipeline.forward(positions, tokens, 0)
        stopped = pipeline.stages[1]
        os.kill(stopped.process_id, signal.SIGSTOP)
        outcome: list[BaseException] = []

        def forward() -> None:
            try:
                pipeline.forward(positions, tokens, 0)
            except BaseException as error:
                outcome.append(error)

        waiting = threading.Thread(target=forward, daemon=True)
        try:
            waiting.start()
            waiting.join(timeout=180)  # liveness: without a deadline this would wait forever
            assert not waiting.is_alive(), "the pass waited past its deadline"
        finally:
            os.kill(stopped.process_id, signal.SIGCONT)
        assert len(outcome) == 1 and isinstance(outcome[0], PipelineError)
        assert re.fullmatch(r"no result of pass 2: stage 1 is silent: no answer to the coordinator's ping for [34] s "
                            r"\(a frozen process or machine, or a cut link\): stage 1 on node \S+ \(.*process "
                            rf"{stopped.process_id}\) does not answer within 3 s \(hung or stopped\)", str(outcome[0]))


def wait_gone(pid: int) -> None:
    """Until the process has exited (a zombie its parent has not reaped yet counts):
    a liveness bound, not a speed limit."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"process {pid} never exited"
        time.sleep(0.05)


def test_a_killed_stage_out_of_restarts_is_named(ray_cluster, splits):
    with Pipeline(splits[2], StageSettings(n_ctx=64), max_restarts=0) as pipeline:
        tokens, positions = np.array([1, 2, 3], np.int32), np.arange(3, dtype=np.int32)
        pipeline.forward(positions, tokens, 0)
        os.kill(pipeline.stages[0].process_id, signal.SIGKILL)
        wait_gone(pipeline.stages[0].process_id)  # the kernel has closed its sockets
        # the chain breaks, or stage 0's cancel connection closes first (liveness): either names the loss
        with pytest.raises(PipelineError, match=r"(the chain broke|stage 0's cancel connection broke) .*: stage 0 on "
                                                r"node .* died \(.*\); restarted 0 times already \(--max-restarts 0\)"):
            pipeline.forward(positions, tokens, 0)


def killing_stage(pipeline, stage_index, after_tokens):
    """An on_token callback that kills stage ``stage_index``'s process (SIGKILL,
    by pid) once ``after_tokens`` tokens are out; .killed tells if it did."""
    produced = []

    def on_token(token):
        produced.append(token)
        if len(produced) == after_tokens:
            os.kill(pipeline.stages[stage_index].process_id, signal.SIGKILL)
            on_token.killed = True

    on_token.killed = False
    return on_token


@pytest.mark.parametrize("stage_index", [0, 1])
def test_a_killed_stage_is_restarted_and_replayed_and_the_output_is_unchanged(ray_cluster, splits, reference,
                                                                              stage_index):
    """SIGKILL a stage mid-generation: it is restarted on its node, the chain is
    rewired, the caches are rebuilt by replay, and every token (greedy, and
    seeded sampling) equals an uninterrupted run's."""
    tokens = reference.tokenize(PROMPTS[2])
    seeded = SamplingSettings(temperature=0.9, top_p=0.95, seed=5)
    with Pipeline(splits[2], SETTINGS) as pipeline:
        uninterrupted = run(pipeline, tokenizer := Tokenizer(splits[2][0]), tokens, 24, seeded).tokens
        old = pipeline.stages[stage_index]
        kill = killing_stage(pipeline, stage_index, after_tokens=10)
        greedy = generate(pipeline, tokens, 24, SamplingSettings(), tokenizer.is_end, on_token=kill)
        assert kill.killed and greedy.tokens == reference.greedy(tokens, 24).tokens
        [restart] = pipeline.restarts
        assert restart.stage_index == stage_index and restart.node_id == old.node_id  # its own node first
        assert pipeline.stages[stage_index].process_id != old.process_id
        kill = killing_stage(pipeline, 1 - stage_index, after_tokens=7)
        assert generate(pipeline, tokens, 24, seeded, tokenizer.is_end, on_token=kill).tokens == uninterrupted
        assert [restart.stage_index for restart in pipeline.restarts] == [stage_index, 1 - stage_index]


def test_a_broken_link_that_heals_costs_a_replay_not_a_stage(ray_cluster, splits, reference):
    """The link to the coordinator reset mid-generation while every stage
    lives (a cable pulled and put back): the chain is wired anew through the
    same stage processes and replayed, the tokens are the uninterrupted
    run's, and it is reported as a relink, not a restart. Before, recovery
    failed with 'every stage still answers'."""
    import socket

    tokens = reference.tokenize(PROMPTS[2])
    with Pipeline(splits[2], SETTINGS) as pipeline:
        processes = [stage.process_id for stage in pipeline.stages]
        produced = []

        def cut_the_link(token):
            produced.append(token)
            if len(produced) == 9:
                pipeline.chain._from_last.shutdown(socket.SHUT_RDWR)

        result = generate(pipeline, tokens, 24, SamplingSettings(), Tokenizer(splits[2][0]).is_end,
                          on_token=cut_the_link)
        assert result.tokens == reference.greedy(tokens, 24).tokens
        assert len(pipeline.relinks) == 1 and "the chain broke" in pipeline.relinks[0].reason
        assert pipeline.restarts == [] and [stage.process_id for stage in pipeline.stages] == processes


def test_a_stage_killed_during_asynchronous_speculation_through_three_stages(ray_cluster, splits, reference):
    """Passes in flight, cancelled and started ahead, drafting while they run:
    a killed middle stage still changes no token."""
    from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
    from orchestrator.decoding.drafting import Drafting
    from orchestrator.decoding.schedule import Schedule
    from speculators.prompt_lookup import PromptLookupSpeculator

    tokens = reference.tokenize(PROMPTS[1]) * 2  # prompt lookup finds drafts in a repeated prompt
    expected = reference.greedy(tokens, 40).tokens
    with Pipeline(splits[3], SETTINGS) as pipeline:
        drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=4))
        try:
            kill = killing_stage(pipeline, 1, after_tokens=12)
            result = generate(pipeline, tokens, 40, SamplingSettings(), lambda token: False, on_token=kill,
                              drafting=Drafting(drafters, Schedule.ASYNC, 4))
        finally:
            stop_drafters(drafters)
    assert kill.killed and [restart.stage_index for restart in pipeline.restarts] == [1]
    assert result.tokens == expected
    assert result.speculation.accepted_tokens > 0  # the drafts were used, before and after the loss


def test_a_setup_that_fails_leaves_no_actor_or_reservation_behind(ray_cluster, splits):
    """The stages fail to start (llama.cpp refuses 10 000 KV sequences, beyond
    its maximum): every actor and the placement group are released, so a
    long-lived driver (the server, the bench) loses nothing."""
    import ray

    def free_cpus() -> float:
        return ray.available_resources().get("CPU", 0.0)

    total = ray.cluster_resources()["CPU"]
    before = set(stage_actors())
    with pytest.raises(PipelineError, match="a stage failed to start: .*could not create a context"):
        Pipeline(splits[2], StageSettings(n_ctx=64, sequences=10_000))
    deadline = time.monotonic() + 30  # a liveness bound on the releases, not a speed
    while (free_cpus() < total or any(actor["State"] != "DEAD" for actor_id, actor in stage_actors().items()
                                      if actor_id not in before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free_cpus() == total
    assert all(group["state"] != "CREATED" for group in ray.util.placement_group_table().values())
    started = {actor_id: actor["State"] for actor_id, actor in stage_actors().items() if actor_id not in before}
    assert len(started) == 2 and set(started.values()) == {"DEAD"}, started


def strangers_at(host, port, forged) -> list:
    """Three strangers at host:port: one silent, one sending garbage, one a
    well-formed batch of its own tokens."""
    import socket

    from orchestrator.transport import wire

    silent = socket.create_connection((host, port))
    garbage = socket.create_connection((host, port))
    garbage.sendall(b"\x00\xff" * 100)
    frame = socket.create_connection((host, port))
    wire.send_message(frame, forged)
    return [silent, garbage, frame]


def test_strangers_at_every_port_neither_hijack_nor_block_the_run(ray_cluster, splits, reference, monkeypatch):
    """Strangers reach every listening port first: each stage's, the
    coordinator's (result and cancels) and each drafter's, before the
    real peer; then again at every port during decoding, where they wait in
    the backlog until a stage is killed and the chain is wired anew through
    them. Each is dropped; the output is the whole model's."""
    from orchestrator.transport import chain as chain_module
    from orchestrator.cluster import drafters as drafters_module
    from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
    from orchestrator.decoding.drafting import Drafting
    from orchestrator.transport.messages import StageBatch
    from orchestrator.decoding.schedule import Schedule
    from speculators.prompt_lookup import PromptLookupSpeculator

    forged = StageBatch(1, 0, np.arange(3, dtype=np.int32), np.array([2], np.int32), tokens=np.array([7, 7, 7], np.int32))
    intruders, ports = [], set()
    wire_for_real, chain_for_real, connect_for_real = Pipeline.new_chain, chain_module.SocketChain.__init__, \
        drafters_module.connect_peer

    def stage_strangers_first(self):
        for stage in self.stages:
            intruders.extend(strangers_at(stage.host, stage.port, forged))
            ports.add((stage.host, stage.port))
        return wire_for_real(self)

    def coordinator_strangers_first(self, *arguments, **options):
        chain_for_real(self, *arguments, **options)
        intruders.extend(strangers_at(*self.address, forged))
        ports.add(self.address)

    def drafter_strangers_first(host, port, *arguments):
        intruders.extend(strangers_at(host, port, forged))
        ports.add((host, port))
        return connect_for_real(host, port, *arguments)

    monkeypatch.setattr(Pipeline, "new_chain", stage_strangers_first)
    monkeypatch.setattr(chain_module.SocketChain, "__init__", coordinator_strangers_first)
    monkeypatch.setattr(drafters_module, "connect_peer", drafter_strangers_first)
    tokens = reference.tokenize(PROMPTS[0]) * 2
    with Pipeline(splits[2], StageSettings(n_ctx=256)) as pipeline:
        drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=4))
        assert len(ports) == 2 + 1 + 2 and len(intruders) == 3 * 5
        kill = killing_stage(pipeline, 1, after_tokens=10)
        during = []

        def on_token(token):
            if not during:  # decoding has begun: strangers at every port again
                for host, port in sorted(ports):
                    during.extend(strangers_at(host, port, forged))
            kill(token)

        try:
            result = generate(pipeline, tokens, 16, SamplingSettings(), Tokenizer(splits[2][0]).is_end,
                              on_token=on_token, drafting=Drafting(drafters, Schedule.ASYNC, 4))
        finally:
            stop_drafters(drafters)
    for intruder in intruders + during:
        intruder.close()
    assert kill.killed and len(pipeline.restarts) == 1 and len(during) == 3 * 5
    assert result.tokens == reference.greedy(tokens, 16).tokens


def test_a_tls_chain_with_drafters_equals_the_whole_model_and_survives_a_lost_stage(ray_cluster, splits, reference):
    """--tls: every chain, cancel and drafter connection in TLS; output exact,
    before and after a stage is killed and rewired (in TLS again)."""
    import ssl

    from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
    from orchestrator.decoding.drafting import Drafting
    from orchestrator.decoding.schedule import Schedule
    from speculators.prompt_lookup import PromptLookupSpeculator

    tokens = reference.tokenize(PROMPTS[1]) * 2
    with Pipeline(splits[2], SETTINGS, tls=True) as pipeline:
        assert isinstance(pipeline.chain._to_first, ssl.SSLSocket)
        assert pipeline.chain._to_first.version() == "TLSv1.3"
        drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=4))
        try:
            assert all(isinstance(drafter._sock, ssl.SSLSocket) for drafter in drafters)
            kill = killing_stage(pipeline, 0, after_tokens=10)
            result = generate(pipeline, tokens, 30, SamplingSettings(), lambda token: False, on_token=kill,
                              drafting=Drafting(drafters, Schedule.ASYNC, 4))
        finally:
            stop_drafters(drafters)
        assert isinstance(pipeline.chain._to_first, ssl.SSLSocket)
    assert kill.killed and len(pipeline.restarts) == 1
    assert result.tokens == reference.greedy(tokens, 30).tokens


def test_orchestrate_run_survives_a_killed_stage_and_reports_the_restart(ray_cluster, splits, reference):
    """`orchestrate run` as a user runs it, on the cluster: once text streams,
    one of its stage processes is killed (SIGKILL, found by its process title);
    the text is the whole model's, and stderr says which stage was restarted."""
    import subprocess
    import sys

    def stage_processes() -> set[int]:
        """This cluster's stage actors: its raylets are this process's children (another
        pytest-xdist worker's cluster runs stage actors of its own at the same time)."""
        found = set()
        for process in psutil.process_iter(["cmdline"]):
            if (process.info["cmdline"] or [""])[0].startswith("ray::StageActor"):
                with contextlib.suppress(psutil.Error):
                    if os.getpid() in {parent.pid for parent in process.parents()}:
                        found.add(process.pid)
        return found

    prompt = "Write a long story about a lighthouse keeper."
    tokens = Tokenizer(splits[2][0]).chat_prompt(prompt)
    expected = reference.llama.detokenize(reference.greedy(tokens, 64).tokens).decode("utf-8", errors="replace")
    before = stage_processes()
    command = [sys.executable, "-m", "orchestrator.cli", "run", "--address", ray_cluster.address,
               "--model-split", *splits[2], "--prompt", prompt, "--chat", "--max-tokens", "64"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    try:
        first = process.stdout.read(1)  # the generation has begun (unbuffered: communicate reads the rest)
        ours = sorted(stage_processes() - before)
        assert len(ours) == 2, ours
        os.kill(ours[-1], signal.SIGKILL)
        rest, errors = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    output, errors = (first + rest).decode(), errors.decode()
    assert process.returncode == 0, errors
    assert output == expected + "\n"  # the text, then the line's end
    died = re.search(r"\[stage (\d) died \(.*\); restarted and replayed in [\d.]+ s\]", errors)
    assert died, errors
    assert f"; stage {died.group(1)} restarted after it died" in errors.splitlines()[-1], errors


def test_a_stage_that_crashes_natively_is_restarted_and_its_log_named(ray_cluster, splits, reference):
    """A segmentation fault in stage 1 (SIGSEGV, as a crash in llama.cpp
    would end it): restarted and replayed, the tokens unchanged, and the
    reason the user sees names the worker log that holds the crash."""
    tokens = reference.tokenize(PROMPTS[2])
    with Pipeline(splits[2], SETTINGS) as pipeline:
        crashed = pipeline.stages[1].process_id
        produced = []

        def crash(token):
            produced.append(token)
            if len(produced) == 6:
                os.kill(crashed, signal.SIGSEGV)

        result = generate(pipeline, tokens, 16, SamplingSettings(), Tokenizer(splits[2][0]).is_end, on_token=crash)
        assert result.tokens == reference.greedy(tokens, 16).tokens
        [restart] = pipeline.restarts
        log = re.search(rf"its log: (\S+-{crashed}\.err) \(Fatal Python error: Segmentation fault\)", restart.reason)
        assert log, restart.reason
        named = Path(log.group(1))  # where it was; Ray's log monitor may have moved it to old/ since
        held = named if named.exists() else named.parent / "old" / named.name
        assert "Segmentation fault" in held.read_text(errors="replace")
