"""What Ray Serve's HTTP proxy and streaming cost per streamed token.

One FastAPI app, with no model work at all, served three ways side by side:

* plain: uvicorn in a subprocess on 127.0.0.1 (the client runs alone in this
  process, as it would against a real server, so the two share no GIL);
* serve: a Ray Serve deployment with the same app as ingress
  (``@serve.deployment`` + ``@serve.ingress``), behind Serve's HTTP proxy, on a
  local ``ray.init(num_cpus=2)``;
* front: as ``orchestrate serve`` runs, an ingress deployment (at ``/front``)
  whose app takes each event from a second deployment through a streaming
  Serve handle (the front and the coordinator, orchestrator.serving.deployment).

``POST /stream`` sends N server-sent events (``data: {"i": k, "t": ...}``, then
``data: [DONE]``) from an async generator. ``t`` is the server's
``time.perf_counter()`` when it yields the event (CLOCK_MONOTONIC, one clock
for every process on a Linux machine), so the client also gets each event's
delivery latency: arrival minus yield. Two pacings:

* fast: ``await asyncio.sleep(0)`` between events, as fast as possible. Serve's
  replica hands the proxy whatever ASGI messages have queued up in one batch,
  so here it ships many events per hop: throughput, not per-token latency.
* paced: ``await asyncio.sleep(pace)`` between events (``--pace-ms``, like a
  model emitting a token every few ms): every event makes its own trip through
  the proxy, and the extra delivery latency is Serve's cost per token.

A stdlib ``http.client`` client on one keep-alive connection per mode reads
the streams; the modes alternate within every repetition, the order rotating
(benchmarks.side_by_side), so drift hits both alike. Per mode and pacing, over the repetitions: median and range (min-max)
of the mean time per event (whole stream / N), of the time to the first event,
and of the median delivery latency per event; the server side's CPU time per
event (the uvicorn process; for Serve every Ray process this run started:
GCS, raylet, agents, controller, proxy, replica; the client excluded; from
/proc/PID/task/TID/schedstat, so other load on the machine does not count),
net of what those processes use when idle (measured for 3 s first);
serve minus plain per event; plus the median round-trip of a non-streaming
``POST /ping``. Linux only (/proc).

    python -m benchmarks.probe serve-overhead [--tokens 200] [--repetitions 5] [--pace-ms 5] [--json PATH]
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import os
import statistics
import time

import click

from benchmarks.probe.harness import Report, probe, table
from benchmarks.side_by_side import Outcome, Samples, side_by_side
from orchestrator.cluster.connect import free_port

MODES = ("plain", "serve", "front")
PREFIX = {"plain": "", "serve": "", "front": "/front"}  # the front's app, under Serve's proxy beside serve's
STREAM_FIGURES = ("per_event", "first_event", "delivery")
PINGS = 50
IDLE_S = 3.0  # how long the server side's idle CPU use is measured
APP_NAME = "serve_overhead"
JSON_HEADERS = {"Content-Type": "application/json"}
DIFFERENCES = (("serve", "plain"), ("front", "serve"))  # Serve's cost; the front's hop to the coordinator


async def events(tokens: int, pace: float):
    """The stream's events: each its number and the moment it is made."""
    for k in range(tokens):
        yield f'data: {{"i": {k}, "t": {time.perf_counter()!r}}}\n\n'
        await asyncio.sleep(pace)
    yield "data: [DONE]\n\n"


def build_app(source=None):
    """The FastAPI app every mode serves; its events from ``source`` (a
    Serve handle to a deployment with ``events``), else made here."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/stream")
    async def stream(body: dict) -> StreamingResponse:
        tokens, pace = int(body.get("tokens", 200)), float(body.get("pace_ms", 0.0)) / 1e3
        made = events(tokens, pace) if source is None else source.options(stream=True).events.remote(tokens, pace)
        return StreamingResponse(made, media_type="text/event-stream")

    @app.post("/ping")
    async def ping() -> dict:
        return {"ok": True} if source is None else await source.ping.remote()

    return app


def _serve_plain(port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(), host="127.0.0.1", port=port, access_log=False, log_level="warning")


def _wait_ready(port: int, timeout: float) -> None:
    """Poll ``/ping`` until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("POST", "/ping", body=b"{}", headers=JSON_HEADERS)
            status = connection.getresponse().status
            connection.close()
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"nothing answered on port {port} within {timeout} s")


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def _cpu_seconds(pids: set[int]) -> float:
    """CPU time the live threads of ``pids`` have run (/proc/PID/task/TID/schedstat, in ns)."""
    total = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                    total += int(schedstat.read().split()[0])
        except OSError:
            continue
    return total / 1e9


def read_stream(connection: http.client.HTTPConnection, tokens: int, pace_ms: float, prefix: str = "") -> dict:
    """Read one stream; its timings in seconds."""
    body = json.dumps({"tokens": tokens, "pace_ms": pace_ms}).encode()
    started = time.perf_counter()
    connection.request("POST", prefix + "/stream", body=body, headers=JSON_HEADERS)
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"/stream answered {response.status}: {response.read()[:200]!r}")
    arrivals, sent = [], []
    while True:
        line = response.readline()
        if not line:
            raise RuntimeError("stream ended before [DONE]")
        if line.startswith(b"data: "):
            now = time.perf_counter()
            if line.startswith(b"data: [DONE]"):
                break
            arrivals.append(now)
            sent.append(json.loads(line[6:])["t"])
    response.read()  # the chunked terminator, so the connection can be reused
    if len(arrivals) != tokens:
        raise RuntimeError(f"expected {tokens} events, got {len(arrivals)}")
    return {
        "per_event": (arrivals[-1] - started) / tokens,
        "first_event": arrivals[0] - started,
        "delivery": statistics.median(a - s for a, s in zip(arrivals, sent)),
    }


def ping_round_trip(connection: http.client.HTTPConnection, prefix: str = "") -> float:
    started = time.perf_counter()
    connection.request("POST", prefix + "/ping", body=b"{}", headers=JSON_HEADERS)
    response = connection.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"/ping answered {response.status}")
    return time.perf_counter() - started


def _summary(values: list[float]) -> dict:
    """Median, min and max, in milliseconds."""
    return {
        "median_ms": statistics.median(values) * 1e3,
        "min_ms": min(values) * 1e3,
        "max_ms": max(values) * 1e3,
    }


def start_serve(port: int) -> float:
    """Start Ray, Serve's proxy on ``port`` and the app; the seconds serve.run took."""
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment
    @serve.ingress(build_app())
    class StreamIngress:
        pass

    @serve.deployment(ray_actor_options={"num_cpus": 0})  # the first deployment holds one of Ray's two CPUs
    class Events:
        async def events(self, tokens: int, pace: float):
            async for event in events(tokens, pace):
                yield event

        def ping(self) -> dict:
            return {"ok": True}

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class Front:
        def __init__(self, source):
            self.source = source

        def __serve_build_asgi_app__(self):
            return build_app(self.source)

    started = time.perf_counter()
    serve.run(StreamIngress.bind(), name=APP_NAME, route_prefix="/")
    serve.run(Front.bind(Events.bind()), name=APP_NAME + "_front", route_prefix="/front")
    return time.perf_counter() - started


def stop_serve() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def measure(ports: dict[str, int], server_pids: dict[str, set[int]], tokens: int, repetitions: int,
            pacings: dict[str, float]) -> tuple[dict, dict[str, Samples]]:
    """The summary (milliseconds) and the samples (seconds) of each pacing and of the pings."""
    connections = {mode: http.client.HTTPConnection("127.0.0.1", port, timeout=60) for mode, port in ports.items()}
    for mode in MODES:  # warm-up
        read_stream(connections[mode], tokens, 0.0, PREFIX[mode])
        for _ in range(5):
            ping_round_trip(connections[mode], PREFIX[mode])
    idle_before = {mode: _cpu_seconds(server_pids[mode]) for mode in MODES}
    time.sleep(IDLE_S)
    idle_cores = {mode: (_cpu_seconds(server_pids[mode]) - idle_before[mode]) / IDLE_S for mode in MODES}
    results = {"idle_cores": idle_cores}
    samples: dict[str, Samples] = {}
    for pacing, pace_ms in pacings.items():
        def run(mode: str, repetition: int, pace_ms: float = pace_ms) -> Outcome:
            cpu_before, wall_before = _cpu_seconds(server_pids[mode]), time.perf_counter()
            stream = read_stream(connections[mode], tokens, pace_ms, PREFIX[mode])
            wall = time.perf_counter() - wall_before
            busy = _cpu_seconds(server_pids[mode]) - cpu_before - idle_cores[mode] * wall
            return Outcome({**stream, "cpu": busy})

        runs = samples[pacing] = side_by_side(list(MODES), repetitions, run)
        results[pacing] = {"pace_ms": pace_ms}
        for mode in MODES:
            results[pacing][mode] = {key: _summary(runs.of(mode, key)) for key in STREAM_FIGURES}
            results[pacing][mode]["cpu_per_event_ms"] = sum(runs.of(mode, "cpu")) / (tokens * repetitions) * 1e3
        for more, less in DIFFERENCES:
            results[pacing][f"{more}_minus_{less}_ms"] = {
                **{key: statistics.median(m - n for m, n in zip(runs.of(more, key), runs.of(less, key))) * 1e3
                   for key in STREAM_FIGURES},
                "cpu_per_event": results[pacing][more]["cpu_per_event_ms"] - results[pacing][less]["cpu_per_event_ms"]}
    pings = samples["ping"] = side_by_side(
        list(MODES), PINGS,
        lambda mode, repetition: Outcome({"round_trip": ping_round_trip(connections[mode], PREFIX[mode])}))
    results["ping"] = {mode: _summary(pings.of(mode, "round_trip")) for mode in MODES}
    for more, less in DIFFERENCES:
        results["ping"][f"{more}_minus_{less}_ms"] = results["ping"][more]["median_ms"] - results["ping"][less]["median_ms"]
    for connection in connections.values():
        connection.close()
    return results, samples


def report_lines(results: dict, samples: dict[str, Samples], pacings: dict[str, float]) -> list[str]:
    rows = []
    for pacing, pace_ms in pacings.items():
        label = f"{pacing} ({pace_ms:g} ms)"
        runs = samples[pacing]
        for mode in MODES:
            rows.append([label, mode, *(runs.spread(mode, key, 1e3, 3) for key in STREAM_FIGURES),
                         f"{results[pacing][mode]['cpu_per_event_ms']:.3f}"])
        for more, less in DIFFERENCES:
            d = results[pacing][f"{more}_minus_{less}_ms"]
            rows.append([label, f"{more} - {less}", f"{d['per_event']:+.3f}", f"{d['first_event']:+.3f}",
                         f"{d['delivery']:+.3f}", f"{d['cpu_per_event']:+.3f}"])
    idle = results["idle_cores"]
    pings = samples["ping"]
    return [
        *table(["pacing", "mode", "ms per event (total / N)", "first event ms", "delivery latency ms",
                "server CPU ms per event"], rows, labels=2),
        "",
        f"Server CPU per event is net of idle use: plain {idle['plain'] * 100:.1f} % of a core, "
        f"serve and front (all Ray processes) {idle['serve'] * 100:.1f} % of a core; a difference is the "
        "median of the repetitions' differences (CPU: of the means).",
        "",
        *table(["non-streaming POST /ping", *MODES, *(f"{more} - {less}" for more, less in DIFFERENCES)],
               [["round-trip ms", *(pings.spread(mode, "round_trip", 1e3, 3) for mode in MODES),
                 *(f"{results['ping'][f'{more}_minus_{less}_ms']:+.3f}" for more, less in DIFFERENCES)]]),
        "", f"{PINGS} pings each, in turn.",
    ]


@probe("serve-overhead", repetitions=5)
@click.option("--tokens", default=200, show_default=True, type=click.IntRange(1), help="Events per stream.")
@click.option("--pace-ms", default=5.0, show_default=True, type=click.FloatRange(0),
              help="Gap between events in the paced run, like a model's time per token.")
def serve_overhead(repetitions: int, tokens: int, pace_ms: float) -> Report:
    """What Ray Serve's HTTP proxy and streaming cost per streamed token: one
    FastAPI app with no model behind plain uvicorn and behind Serve (Linux)."""
    pacings = {"fast": 0.0, "paced": pace_ms}
    ports = {"plain": free_port(), "serve": free_port()}
    ports["front"] = ports["serve"]
    plain = multiprocessing.get_context("spawn").Process(target=_serve_plain, args=(ports["plain"],), daemon=True)
    plain.start()
    ray_started = False
    try:
        _wait_ready(ports["plain"], timeout=30)
        ray_started = True
        serve_run_s = start_serve(ports["serve"])
        _wait_ready(ports["serve"], timeout=60)
        plain_pids = {plain.pid} | _descendants(plain.pid)
        ray_pids = _descendants(os.getpid()) - plain_pids
        server_pids = {"plain": plain_pids, "serve": ray_pids, "front": ray_pids}
        results, samples = measure(ports, server_pids, tokens, repetitions, pacings)
    finally:
        if ray_started:
            stop_serve()
        plain.terminate()
        plain.join(timeout=10)
    results["config"] = {"tokens": tokens, "pace_ms": pace_ms, "pings": PINGS, "serve_run_s": serve_run_s}
    return Report(f"{tokens} events per stream, plain uvicorn against Ray Serve's proxy; serve.run took "
                  f"{serve_run_s:.1f} s", report_lines(results, samples, pacings), samples, {"results": results})
