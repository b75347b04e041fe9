"""`orchestrate run` across two real network hosts: a Ray head and a worker in
two network namespaces joined by a bandwidth-limited veth link (1 Gbit/s; a
1 ms delay too where the kernel has netem), the driver on the head's host.
Output must equal the whole model, and the stages must run on different hosts
(placed by the resources the hosts advertise, or by --place:
tests/hosts/test_delayed_link.py, over a delayed link). Skips where
namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import PROMPTS
from support.network_hosts import NamespacesUnavailable, RayAcrossHosts, TwoHosts

HUB_SERVER = Path(__file__).parent.parent / "support" / "hub_server.py"
HUB_PORT = 8765  # the namespaces are private: a fixed port is free there

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hosts():
    try:
        two_hosts = TwoHosts(str(os.getpid())).open()
    except NamespacesUnavailable as reason:
        pytest.skip(f"two-host test needs network namespaces: {reason}")
    try:
        yield two_hosts
    finally:
        two_hosts.close()


@pytest.fixture(scope="module")
def cluster(hosts):
    ray_nodes = RayAcrossHosts(hosts)
    try:
        alive = ray_nodes.start()
        assert sorted(alive) == sorted([hosts.first.address, hosts.second.address]), alive
        yield ray_nodes
    finally:
        ray_nodes.close()


@pytest.fixture(autouse=True)
def report_link(hosts):
    """Say what the link got; where netem is missing, say so as a pytest warning."""
    for note in hosts.link_notes:
        print(f"two-host link: {note}")
    if not hosts.netem_available:
        warnings.warn("two-host test ran WITHOUT link delay: netem is not available in this kernel", stacklevel=1)


def run_across_hosts(cluster: RayAcrossHosts, stage_files: list[str], *options: str,
                     env: dict[str, str] | None = None) -> dict:
    """`orchestrate run` from the head's host; its JSON report. No stage files: options give --model."""
    files = ["--model-split", *stage_files] if stage_files else []
    result = cluster.driver(
        ["-m", "orchestrator.cli", "run", *files, "--address", cluster.address,
         "--raw", "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS), "--json", *options],
        timeout=300, env=env,
    )
    assert result is not None, f"orchestrate run timed out\n{cluster.log_tail()}"
    assert result.returncode == 0, f"orchestrate run failed:\n{result.stderr}\n{cluster.log_tail()}"
    return json.loads(result.stdout)


def test_the_whole_model_is_shipped_to_each_host_once_and_a_broken_transfer_resumes(cluster, smollm2, splits,
                                                                                   reference):
    """`--model` from the driver, no stage file on either host beforehand: each
    stage's file arrives in its own node's cache, byte for byte the split's,
    and the tokens are the whole model's. In a second run, the file a node
    holds is not sent again, and a file cut short (what an interrupted
    transfer leaves) gets only its rest (one run for both: each run is about
    20 s of this test)."""
    first, second = cluster.hosts.first.address, cluster.hosts.second.address
    caches = {second: cluster.stage_cache("worker"), first: cluster.stage_cache("head")}  # stage 0 on the worker
    assert not any(cache.exists() for cache in caches.values())
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens

    report = run_across_hosts(cluster, [], "--model", smollm2)
    assert report["tokens"] == expected
    assert [stage["host"] for stage in report["stages"]] == [second, first]
    assert [stage["layers"] for stage in report["stages"]] == [[0, 15], [15, 30]]
    for item, split_file in zip(report["shipped"], splits[2]):
        path = Path(item["path"])
        assert item["host"] in (first, second) and path.is_relative_to(caches[item["host"]])
        assert item["bytes_sent"] == item["bytes"] == path.stat().st_size
        assert path.read_bytes() == Path(split_file).read_bytes()

    worker_file = Path(report["shipped"][0]["path"])
    kept = worker_file.stat().st_size // 3
    partial = worker_file.with_name(worker_file.name + ".partial")
    partial.write_bytes(worker_file.read_bytes()[:kept])
    worker_file.unlink()
    resumed = run_across_hosts(cluster, [], "--model", smollm2)
    assert resumed["tokens"] == expected
    assert [(item["resumed_from"], item["bytes_sent"]) for item in resumed["shipped"]] == \
        [(kept, report["shipped"][0]["bytes"] - kept), (report["shipped"][1]["bytes"], 0)]
    assert worker_file.read_bytes() == Path(splits[2][0]).read_bytes()


@pytest.fixture(scope="module")
def hub_on_head(hosts, cluster, smollm2, tmp_path_factory):
    """The stand-in Hub (tests/support/hub_server.py) on the head's host, on
    every address there: the worker reaches it at the head's address; at
    127.0.0.1 only the head's host does."""
    folder = tmp_path_factory.mktemp("hub-on-head")
    config = {"address": "0.0.0.0", "port": HUB_PORT, "log": str(folder / "served.jsonl"),
              "ready": str(folder / "ready"), "repos": {"org/smol": {"files": {Path(smollm2).name: smollm2}}}}
    (folder / "config.json").write_text(json.dumps(config))
    server = hosts.start(hosts.first, [sys.executable, str(HUB_SERVER), str(folder / "config.json")],
                         folder / "server.log", dict(os.environ))
    deadline = time.monotonic() + 30
    while not (folder / "ready").exists():
        assert server.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()
        time.sleep(0.2)
    yield config["port"], folder / "served.jsonl"
    hosts.stop(server)


def served_by_client(log: Path, data_start: int, since: int) -> tuple[dict[str, int], dict[str, int]]:
    """From the Hub's log (lines from ``since``): bytes of header reads and of tensor reads, by client address."""
    header, tensors = {}, {}
    for line in log.read_text().splitlines()[since:]:
        item = json.loads(line)
        into = header if item["start"] < data_start else tensors
        into[item["client"]] = into.get(item["client"], 0) + item["sent"]
    return header, tensors


def test_each_host_fetches_its_own_slice_from_the_hub_or_the_driver_ships_it(cluster, hub_on_head, smollm2,
                                                                             reference):
    """The driver (on the head's host) reads only the header; each host
    fetches just its stage's tensors. Where the worker cannot reach the Hub
    (HF_ENDPOINT at 127.0.0.1: the head's own loopback), the driver ships its
    stage instead, and the report says why."""
    from stages.gguf_file import read_model
    from stages.split import plan_split, stage_file_image
    from stages.stage_image import SourceRange

    port, log = hub_on_head
    first, second = cluster.hosts.first.address, cluster.hosts.second.address
    model = read_model(smollm2)
    data_start = min(tensor.offset for tensor in model.tensors)
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens

    def slice_bytes(boundary: int, index: int) -> int:
        image = stage_file_image(plan_split(model, 2, [boundary]), index)
        return sum(part.length for part in image.parts if isinstance(part, SourceRange))

    report = run_across_hosts(cluster, [], "--model", f"hf:org/smol/{Path(smollm2).name}", "--boundaries", "12",
                              env={"HF_ENDPOINT": f"http://{first}:{port}"})
    assert report["tokens"] == expected
    assert [(item["host"], item["from"]) for item in report["shipped"]] == [(second, "source"), (first, "source")]
    header, tensors = served_by_client(log, data_start, 0)
    assert tensors == {second: slice_bytes(12, 0), first: slice_bytes(12, 1)}  # stage 0 is the worker's
    assert list(header) == [first] and header[first] <= 3 * data_start

    since = len(log.read_text().splitlines())
    fallback = run_across_hosts(cluster, [], "--model", f"hf:org/smol/{Path(smollm2).name}", "--boundaries", "9",
                                env={"HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert fallback["tokens"] == expected
    worker, head = fallback["shipped"]
    assert (worker["host"], worker["from"], head["from"]) == (second, "driver", "source")
    assert "cannot reach its server" in worker["why_from_driver"]
    assert worker["resumed_from"] + worker["bytes_sent"] == worker["bytes"]  # the header it held is not sent again
    header, tensors = served_by_client(log, data_start, since)
    # the head fetched its own slice; the driver (same host) read the worker's to ship it
    assert tensors == {"127.0.0.1": slice_bytes(9, 0) + slice_bytes(9, 1)}


def test_a_host_that_holds_no_stage_drafts_for_the_pipeline_with_the_draft_shipped_there(
        cluster, splits, realistic_draft, reference):
    """llama_duo's setup: both stages on the head, and the worker, which holds
    no stage, runs drafter 0 (--drafter-node); the other drafter stays beside
    stage 1. The draft model is shipped from the driver into the worker's
    cache, once. Under an emulated curve the draft policy takes drafts, so
    tokens drafted on the worker are verified, and the output is the whole model's."""
    first, second = cluster.hosts.first.address, cluster.hosts.second.address
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
    options = ["--place", f"0={first},1={first}", "--speculator", "model", "--draft", realistic_draft,
               "--drafter-node", second, "--cost-curve", "benchmarks/setups/llama-405b-two-machines.toml@40"]
    report = run_across_hosts(cluster, splits[2], *options)
    assert report["tokens"] == expected
    head = report["stages"][0]["node"]
    assert report["stages"][1]["node"] == head  # both on the driver's host: they listen on loopback
    drafters = report["speculators"]
    assert [drafter["lost"] for drafter in drafters] == ["", ""]
    assert drafters[0]["node"] != head and drafters[1]["node"] == head
    assert drafters[0]["busy_seconds"] > 0 and report["accepted_tokens"] > 0
    size = Path(realistic_draft).stat().st_size
    [draft] = report["shipped"]
    assert (draft["what"], draft["host"], draft["bytes"], draft["bytes_sent"]) == ("draft", second, size, size)
    assert Path(draft["path"]).is_relative_to(cluster.stage_cache("worker"))
    assert Path(draft["path"]).read_bytes() == Path(realistic_draft).read_bytes()
    assert [drafter["compute"]["path"] for drafter in drafters] == [draft["path"], realistic_draft]

    again = run_across_hosts(cluster, splits[2], *options)
    assert again["tokens"] == expected
    assert [(item["what"], item["bytes_sent"]) for item in again["shipped"]] == [("draft", 0)]


CUT_SECONDS = 5.0
CUT_DRIVER = """
import json, subprocess, sys, threading, time
import ray
from orchestrator.cluster.pipeline import Pipeline
from orchestrator.decoding.loop import generate
from speculators.sampling import SamplingSettings
from stages.settings import StageSettings
from stages.tokenizer import Tokenizer

address, interface, seconds, max_tokens, prompt, *paths = sys.argv[1:]
ray.init(address=address, log_to_driver=False, configure_logging=False)
link = lambda state: subprocess.run(["ip", "link", "set", interface, state], check=True)
tokenizer, produced, cut = Tokenizer(paths[0]), [], {}

def on_token(token):
    produced.append(token)
    if len(produced) == 8:  # mid-generation: the link goes down, and comes back
        link("down")
        cut["at"] = time.monotonic()
        threading.Timer(float(seconds), link, ("up",)).start()

with Pipeline(paths, StageSettings(n_ctx=512)) as pipeline:
    hosts = [stage.host for stage in pipeline.stages]
    result = generate(pipeline, tokenizer.tokenize(prompt), int(max_tokens), SamplingSettings(), tokenizer.is_end,
                      on_token=on_token)
    print(json.dumps({"tokens": result.tokens, "hosts": hosts, "restarts": len(pipeline.restarts),
                      "relinks": len(pipeline.relinks), "after_cut": time.monotonic() - cut["at"]}))
"""


def test_a_link_cut_mid_generation_that_heals_costs_no_token(cluster, splits, reference):
    """The head host's end of the link taken down for CUT_SECONDS after the
    8th token (both stages are on different hosts: every pass crosses it),
    then up again: the pass waits (within its deadline; TCP resends once
    the link is back) and the run ends with the whole model's tokens, no
    stage restarted and at most one relink with replay."""
    max_tokens = 40
    result = cluster.driver(["-c", CUT_DRIVER, cluster.address, cluster.hosts.first.interface, str(CUT_SECONDS),
                             str(max_tokens), PROMPTS[0], *splits[2]], timeout=300)
    assert result is not None, f"the driver timed out\n{cluster.log_tail()}"
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{cluster.log_tail()}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["hosts"] == [cluster.hosts.second.address, cluster.hosts.first.address]
    assert report["tokens"] == reference.greedy(reference.tokenize(PROMPTS[0]), max_tokens).tokens
    assert report["after_cut"] >= CUT_SECONDS  # the cut was felt: generation waited for the link
    assert report["restarts"] == 0 and report["relinks"] <= 1
