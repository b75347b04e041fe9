"""The chaos soak: ``orchestrate serve`` under a steady load of streamed,
seeded requests while faults are injected in turn, each request checked
against its solo output. A benchmark, not a test: it takes minutes.

    python -m benchmarks.chaos --out DIR [--requests 160] [--clients 4] [--pause 8] [--speculator model] [--hosts]

The service runs on a Ray cluster of this process's own
(``ray.cluster_utils.Cluster``: a head without CPUs, one-CPU nodes for
the two stages and a spare, and a node without CPUs that drafts for stage 0),
``orchestrate serve --model M --stages 2`` joining it, drafting with the
bench's draft of realistic agreement (the default model requantized, made
for the soak and not kept; ``--speculator ngram``: prompt lookup, and no
drafting node). Before the load each request is run alone (its solo output).
Then CLIENTS clients stream REQUESTS requests (a few prompts, each sampled
with its own seed), while the faults below are injected one at a time, PAUSE
seconds after the service answered again from the last:

- ``stage``: a stage process SIGKILLed;
- ``replica``: the coordinator's Serve replica SIGKILLed (the front, which
  holds the HTTP streams, asks the next one each request again);
- ``node``: the Ray node holding a stage (and the drafter beside it)
  removed without a drain (its processes killed, as a machine that dies),
  and a node added back once the service answers again;
- ``stall``: a stage process stopped (SIGSTOP) for STALL_SECONDS, then let
  go: a link that stalls and heals;
- ``stranger``: connections to every stage's listening port that send
  garbage and a forged handshake;
- with a draft model, ``drafter``: a drafter process SIGKILLed,
  ``drafter-stall``: one stopped for STALL_SECONDS, then let go, and
  ``drafter-node``: the node that holds no stage and drafts for stage 0
  (``--drafter-node``) removed without a drain, once (generation goes on
  without that drafter).

Each request ends ``equal`` (its solo text), ``wrong`` (a text that differs:
never allowed), ``retryable`` (a 503 or 429, or an error event in its stream,
each saying why) or ``cut`` (the connection ended mid-stream, or Serve's
proxy answered a bare 500: never allowed). After the load: every stage's KV cells free,
each stage process that survived holds the file descriptors and sockets it
held after warm-up and its memory is within 10 % of it. It writes
chaos.json, prints the counts, and exits 1 if any check fails.

Here the nodes share one machine's loopback, so no link is cut (``stall``
stands in). ``--hosts`` (as root) runs the soak across three network
namespace hosts instead, where links are cut, for a while and for good
(benchmarks.chaos_hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.chaos_hosts import LINK_SECONDS, HostsCluster, run_on_hosts
from benchmarks.drafts import realistic_draft
from orchestrator.cluster.connect import free_port, ray_environment
from orchestrator.config import default_model_path
from orchestrator.serving.deployment import COORDINATOR_TITLE

FAULTS = ("stage", "replica", "node", "stall", "stranger")
DRAFTER_FAULTS = ("drafter", "drafter-stall", "drafter-node")  # with a draft model (--speculator model)
HOST_FAULTS = ("stage", "replica", "link", "stall", "stranger", "link-lost")  # --hosts: links cut, no node removed
HOST_DRAFTER_FAULTS = ("drafter", "drafter-stall")  # --hosts with a draft model: no drafter-only node there
ONCE = ("drafter-node", "link-lost")  # each takes a machine away for good: injected once a soak
DRAFTER_NODE = "127.0.2.1"  # the node that drafts in place of stage 0's machine (--drafter-node), no stage there
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "List three colors:", "The best way to learn a language is")
MAX_TOKENS = 32
STALL_SECONDS = 4.0
BACK_SECONDS = 120.0  # a fault the service does not answer again from within this is a failure


@dataclass
class Outcome:
    request: int
    kind: str  # equal, wrong, retryable, cut
    detail: str
    ended: float  # monotonic


@dataclass
class Fault:
    kind: str
    at: float  # monotonic
    detail: str = ""
    recovered_seconds: float | None = None


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


def request_body(model: str, index: int) -> dict:
    """Request ``index``'s body: a prompt and a seed of its own, sampled, streamed."""
    return {"model": model, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0.8, "seed": 1000 + index % 20}


def stream_text(base: str, body: dict) -> tuple[str, str]:
    """(kind, text or why): the streamed request's text ("done"), or how it ended otherwise."""
    text = ""
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as reply:
            if reply.status_code != 200:
                reply.read()
                return refusal(reply.status_code, reply.headers, reply.text), f"{reply.status_code} {reply.text[:200]}"
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done", text
                event = json.loads(line[6:])
                if "error" in event:
                    return "retryable", event["error"]["message"][:200]
                text += event["choices"][0]["text"]
    except httpx.HTTPError as error:
        return "cut", f"{type(error).__name__}: {error}"[:200]
    return "cut", "the stream ended without [DONE]"


def refusal(status: int, headers, body: str) -> str:
    """How a refused request ended: ``retryable`` (429 or 503 with
    Retry-After, the service's own), ``cut`` (Serve's proxy's bare 500: the
    replica died holding the request before it answered), else ``failed``."""
    if status in (429, 503) and "Retry-After" in headers:
        return "retryable"
    return "cut" if (status, body.strip()) == (500, "Internal Server Error") else "failed"


def solo_outputs(base: str, model: str, count: int) -> dict[tuple[str, int], str]:
    """Each distinct request run alone, before any fault: (prompt, seed) -> text."""
    solo = {}
    for index in range(count):
        body = request_body(model, index)
        key = (body["prompt"], body["seed"])
        if key not in solo:
            kind, text = stream_text(base, body)
            if kind != "done":
                raise SystemExit(f"chaos: the solo run of request {index} failed: {text}")
            solo[key] = text
    return solo


def load(base: str, model: str, solo: dict, total: int, clients: int, soak: Soak) -> None:
    """CLIENTS threads streaming requests 0..total-1, each outcome judged against its solo text."""
    counter = iter(range(total))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            body = request_body(model, index)
            kind, text = stream_text(base, body)
            if kind == "done":
                kind = "equal" if text == solo[(body["prompt"], body["seed"])] else "wrong"
            with lock:
                soak.outcomes.append(Outcome(index, kind, "" if kind == "equal" else text, time.monotonic()))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    soak.done.set()


def health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=30).json()


def served_again(base: str, model: str, since: float) -> float:
    """Seconds from ``since`` until a short greedy request is answered."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    while time.monotonic() - since < BACK_SECONDS:
        try:
            if httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"chaos: the service did not answer again within {BACK_SECONDS:.0f} s")


def replica_pid() -> int:
    import psutil

    return next(process.pid for process in psutil.process_iter(["cmdline"])
                if any(COORDINATOR_TITLE in part for part in process.info["cmdline"] or ()))


def stage_addresses() -> list[tuple[str, int]]:
    """Every live stage actor's listening address (asked through Ray)."""
    import ray

    addresses = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("specpipe-stage-"):
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            description = ray.get(actor.describe.remote(), timeout=10)
            addresses.append((description.host, description.port))
    return addresses


def inject(kind: str, cluster, base: str, rng: random.Random) -> str:
    """Inject one fault; what was hit."""
    stages = health(base)["stages"]
    index = rng.randrange(len(stages))
    if kind == "stage":
        os.kill(stages[index]["process"], signal.SIGKILL)
        return f"stage {index} process {stages[index]['process']}"
    if kind == "replica":
        pid = replica_pid()
        os.kill(pid, signal.SIGKILL)
        return f"replica process {pid}"
    if kind == "node":
        [node] = [node for node in cluster.list_all_nodes() if node.node_id == stages[index]["node"]]
        cluster.remove_node(node, allow_graceful=False)
        return f"stage {index}'s node {node.node_id[:8]}"
    if kind in ("stall", "drafter-stall"):
        pid, what = (stages[index]["process"], f"stage {index}") if kind == "stall" else drafter_process(rng)
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(STALL_SECONDS, os.kill, (pid, signal.SIGCONT)).start()
        return f"{what} process {pid} stopped {STALL_SECONDS:.0f} s"
    if kind in ("link", "link-lost"):
        return cut_link(kind, cluster, stages, rng)
    if kind == "drafter-node":
        [node] = [node for node in cluster.list_all_nodes() if node.node_ip_address == DRAFTER_NODE]
        cluster.remove_node(node, allow_graceful=False)
        return f"the drafter-only node {node.node_id[:8]}"
    if kind == "drafter":
        pid, what = drafter_process(rng)
        os.kill(pid, signal.SIGKILL)
        return f"{what} process {pid}"
    for host, port in stage_addresses():
        for payload in (os.urandom(256), b"SPECPIPE" + os.urandom(64), b"GET / HTTP/1.1\r\n\r\n"):
            with socket.create_connection((host, port), timeout=5) as stranger:
                stranger.sendall(payload)
    return "every stage's port"


def cut_link(kind: str, cluster: HostsCluster, stages: list[dict], rng: random.Random) -> str:
    """Take the link of a stage's host (not the head's) down: for LINK_SECONDS (``link``: it returns once
    the link is up again, or raises if it cannot be put up), or for good."""
    hosts = {index: cluster.stage_host(stage["node"]) for index, stage in enumerate(stages)}
    away = [index for index, host in hosts.items() if host != cluster.head]
    if not away:
        raise SystemExit(f"chaos: no stage off the head's host to cut the link of ({hosts})")
    index = away[rng.randrange(len(away))]
    cluster.link(hosts[index], "down")
    if kind == "link-lost":
        return f"stage {index}'s host {hosts[index]}: link down for good"
    time.sleep(LINK_SECONDS)
    cluster.link(hosts[index], "up")
    return f"stage {index}'s host {hosts[index]}: link down {LINK_SECONDS:.0f} s"


def drafter_process(rng: random.Random) -> tuple[int, str]:
    """(the process id, its name) of one live drafter actor, asked through Ray."""
    import ray

    names = sorted((entry["name"], entry["namespace"]) for entry in ray.util.list_named_actors(all_namespaces=True)
                   if entry["name"].startswith("specpipe-drafter-"))
    if not names:
        raise SystemExit("chaos: no drafter to hit (run with --speculator model)")
    name, namespace = names[rng.randrange(len(names))]
    *_, process_id = ray.get(ray.get_actor(name, namespace=namespace).address.remote(), timeout=10)
    return process_id, name


def inject_faults(cluster, base: str, model: str, pause: float, soak: Soak, seed: int, kinds: tuple[str, ...]) -> None:
    """One fault after another, ``kinds`` in turn, until the load is done."""
    rng = random.Random(seed)
    turn = 0
    while not soak.done.wait(pause):
        kind = kinds[turn % len(kinds)]
        turn += 1
        if kind in ONCE and any(fault.kind == kind for fault in soak.faults):
            continue  # its machine is gone
        fault = Fault(kind, time.monotonic())
        fault.detail = inject(kind, cluster, base, rng)
        soak.faults.append(fault)
        fault.recovered_seconds = served_again(base, model, fault.at)
        print(f"chaos: {kind} ({fault.detail}): answering again after {fault.recovered_seconds:.1f} s; "
              f"{len(soak.outcomes)} requests done", flush=True)
        if kind == "node":  # a machine comes back (the stage stays where it moved)
            add_worker(cluster, 3 + turn)


def process_state(pids: list[int]) -> dict[int, dict]:
    import psutil

    state = {}
    for pid in pids:
        process = psutil.Process(pid)
        state[pid] = {"fds": process.num_fds(), "sockets": len(process.net_connections()),
                      "rss_mb": process.memory_info().rss / 1024**2}
    return state


def leaks(before: dict[int, dict], after: dict[int, dict]) -> list[str]:
    """Each surviving process that holds more descriptors or sockets than after warm-up, or >10 % more memory."""
    found = []
    for pid in set(before) & set(after):
        then, now = before[pid], after[pid]
        if now["fds"] > then["fds"] or now["sockets"] > then["sockets"] or now["rss_mb"] > then["rss_mb"] * 1.10:
            found.append(f"process {pid}: {then} -> {now}")
    return found


def percentile(values: list[float], q: float) -> float | None:
    return None if not values else sorted(values)[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def report(soak: Soak, kv: list, leaked: list[str], seconds: float, faults: tuple[str, ...] = FAULTS) -> dict:
    kinds = ("equal", "wrong", "retryable", "cut", "failed")
    by_fault: dict[str, dict[str, int]] = {kind: {} for kind in faults}
    for outcome in soak.outcomes:
        if outcome.kind != "equal":
            before = [fault for fault in soak.faults if fault.at <= outcome.ended]
            cause = before[-1].kind if before else "none"
            by_fault.setdefault(cause, {})[outcome.kind] = by_fault.get(cause, {}).get(outcome.kind, 0) + 1
    recovery = {kind: [fault.recovered_seconds for fault in soak.faults if fault.kind == kind] for kind in faults}
    return {
        "requests": len(soak.outcomes),
        "outcomes": {kind: sum(outcome.kind == kind for outcome in soak.outcomes) for kind in kinds},
        "faults": {kind: len(recovery[kind]) for kind in faults},
        "not_equal_by_fault": by_fault,
        "recovery_seconds": {kind: {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}
                             for kind, values in recovery.items()},
        "kv_cells_at_end": kv,
        "leaks": leaked,
        "seconds": round(seconds, 1),
        "fault_log": [asdict(fault) for fault in soak.faults],
        "not_equal": [asdict(outcome) for outcome in soak.outcomes if outcome.kind != "equal"],
    }


def passed(result: dict) -> bool:
    """No wrong token, nothing failed unclearly or cut off, nothing held or leaked."""
    outcomes = result["outcomes"]
    return (outcomes["wrong"] == 0 and outcomes["failed"] == 0 and outcomes.get("cut", 0) == 0
            and not result["leaks"] and not any(result["kv_cells_at_end"]))


def add_worker(cluster, number: int) -> None:
    """A one-CPU node at an address of its own on this machine's loopback
    (127.0.0.<number + 2>), as another host would have one: Serve's
    replica, which asks for the driver's address, stays on the head, and the
    stages' chain runs between addresses (nodes sharing one address would
    also share Serve's HTTP port, and a stream would end with the proxy of
    a node the replica left)."""
    cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2, node_ip_address=f"127.0.0.{number + 2}")


def start_cluster():
    """A head without CPUs (no stage can use it), three one-CPU nodes (two
    stages and a spare), and one without CPUs that drafts (DRAFTER_NODE)."""
    import ray
    from ray.cluster_utils import Cluster


    ray_environment()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * 1024**2,
                                                            "include_dashboard": False})
    for number in range(3):
        add_worker(cluster, number)
    # no CPU: no stage goes there, as to a laptop that only drafts
    cluster.add_node(num_cpus=0, object_store_memory=80 * 1024**2, node_ip_address=DRAFTER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def settled_kv(base: str, seconds: float = 30) -> list[int]:
    """Each stage's KV cells once no request decodes (or when ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while True:
        stages = health(base)
        cells = [stage["kv_cells"] for stage in stages["stages"]]
        if (stages["requests_decoding"] == 0 and not any(cells)) or time.monotonic() > deadline:
            return cells
        time.sleep(0.5)


def soak(cluster, base: str, arguments, kinds: tuple[str, ...]) -> dict:
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    solo = solo_outputs(base, model, arguments.requests)
    warm = Soak()
    load(base, model, solo, 2 * arguments.clients, arguments.clients, warm)  # warm-up: the level to hold
    if any(outcome.kind != "equal" for outcome in warm.outcomes):
        raise SystemExit("chaos: a warm-up request (no fault yet) did not equal its solo output")
    pids = [stage["process"] for stage in health(base)["stages"]]
    before = process_state(pids)
    state = Soak()
    started = time.monotonic()
    # the faults from this thread: Ray adds a node only from the main one
    requests = threading.Thread(target=load, args=(base, model, solo, arguments.requests, arguments.clients, state),
                                daemon=True)
    requests.start()
    inject_faults(cluster, base, model, arguments.pause, state, arguments.seed, kinds)
    requests.join()
    kv = settled_kv(base)
    alive = [stage["process"] for stage in health(base)["stages"]]
    return report(state, kv, leaks(before, process_state([pid for pid in pids if pid in alive])),
                  time.monotonic() - started, kinds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for chaos.json")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--pause", type=float, default=8.0, help="seconds between a recovery and the next fault")
    parser.add_argument("--seed", type=int, default=0, help="which stage each fault hits")
    parser.add_argument("--speculator", choices=("model", "ngram"), default="model",
                        help="model: the bench's draft of realistic agreement beside each stage; ngram: prompt lookup")
    parser.add_argument("--hosts", action="store_true",
                        help="across three network namespace hosts, cutting links (as root; benchmarks.chaos_hosts)")
    parser.add_argument("--on-hosts", help=argparse.SUPPRESS)  # the soak inside the head's host (run_on_hosts)
    argv = list(argv if argv is not None else sys.argv[1:])
    arguments = parser.parse_args(argv)
    if arguments.hosts and arguments.on_hosts is None:
        sys.exit(run_on_hosts(argv))
    arguments.out.mkdir(parents=True, exist_ok=True)
    drafts = tempfile.TemporaryDirectory()  # the draft is made for the soak, not kept
    try:
        result = soak_on_a_cluster(arguments, drafts.name)
    finally:
        drafts.cleanup()
    shown = argv[:argv.index("--on-hosts")] if arguments.on_hosts else argv
    result["command"] = "python -m benchmarks.chaos " + " ".join(shown)
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    result["passed"] = passed(result)
    (arguments.out / "chaos.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({key: result[key] for key in ("requests", "outcomes", "faults", "not_equal_by_fault",
                                                   "recovery_seconds", "kv_cells_at_end", "leaks", "passed")},
                     indent=1))
    if not result["passed"]:
        sys.exit(1)


def soak_on_a_cluster(arguments, drafts: str) -> dict:
    """The cluster (this process's own, or the hosts' it was handed), serve on
    it, the soak; everything this started is stopped after."""
    import ray

    from benchmarks.serve_bench import start_specpipe_server
    from benchmarks.serve_load import stop_server

    on_hosts, drafts_model = arguments.on_hosts is not None, arguments.speculator == "model"
    speculation = ["--speculator", "ngram"] if not drafts_model else [
        "--speculator", "model", "--draft", realistic_draft(str(default_model_path()), Path(drafts))]
    if drafts_model and not on_hosts:  # across hosts each drafter is beside its stage
        speculation += ["--drafter-node", DRAFTER_NODE]
    drafting = (HOST_DRAFTER_FAULTS if on_hosts else DRAFTER_FAULTS) if drafts_model else ()
    kinds = (HOST_FAULTS if on_hosts else FAULTS) + drafting
    if on_hosts:
        cluster = HostsCluster.from_json(arguments.on_hosts)
        ray_environment()
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        cluster = start_cluster()
    try:
        port, log = free_port(), arguments.out / "serve.log"
        server = start_specpipe_server(["--address", cluster.address, "--model", str(default_model_path()),
                                        "--stages", "2", "--max-sequences", str(arguments.clients), "--n-ctx", "512",
                                        *speculation], port, log)
        try:
            return soak(cluster, f"http://127.0.0.1:{port}", arguments, kinds)
        finally:
            stop_server(server, timeout=60)
    finally:
        ray.shutdown()
        if not on_hosts:
            cluster.shutdown()


if __name__ == "__main__":
    main()
