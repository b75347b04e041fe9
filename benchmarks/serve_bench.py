"""`orchestrate bench --serve`: servers under concurrent load, side by side in one run.

Three OpenAI-compatible servers on this machine, one at a time, the same
prompts, the same total threads:

* ``specpipe-2-stages``: ``orchestrate serve`` over the model split in two,
  one thread per stage;
* ``specpipe-whole``: ``orchestrate serve`` over the unsplit model as one
  stage with both threads;
* ``specpipe-2-stages-draft`` (under an emulated curve only): the same with
  a draft model beside every stage (``--speculator model``, the draft of
  realistic agreement, benchmarks.drafts), against ``specpipe-2-stages``;
* ``specpipe-2-stages-no-http``: the same pipeline and service loop
  (orchestrator.decoding.service) driven in this process, without HTTP, Serve or the
  client: what the pipeline itself gives, and so what the serving layers on
  the same two cores take from it;
* ``llama-cpp-server``: llama-cpp-python's own server (``python -m
  llama_cpp.server``, the unsplit model, both threads). It serves one request
  at a time; its default (``interrupt_requests``) ends a running stream early
  whenever another request waits, so it runs with ``--interrupt_requests
  False`` (it queues instead);
* ``cpp-llama-server``, when `make peers` has built it (benchmarks.peers):
  llama.cpp's own ``llama-server`` on the unsplit model, both threads, with
  8 parallel slots (continuous batching: the slots' tokens share batches).
  It is a peer, not held to this project's exactness: whether its output
  under load equals its solo run is reported, not required.

For each server, each repetition and each concurrency level, the load
generator (benchmarks.serve_load, the official ``openai`` async client) sends
every prompt once, at most ``concurrency`` at a time, greedy and streamed, and
records aggregate tokens/s, time to first token and inter-token latency. Each
output is compared with the same server's at concurrency 1 (its solo run) and
with llama-cpp-server's. Results: medians and ranges over the repetitions, and
ratios: concurrency c over concurrency 1, and each server over
llama-cpp-server at the same concurrency.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from benchmarks.drafts import realistic_draft
from benchmarks.peers import built, start, tool
from benchmarks.serve_load import (DEFAULT_PROMPTS, LoadResult, RequestOutcome, run_load, start_llama_cpp_server,
                                   stop_server)
from orchestrator.cluster.connect import free_port, ray_session
from orchestrator.decoding.service import Progress, Service, ServiceRequest, ServiceSettings
from orchestrator.output import write_whole
from orchestrator.planning.curves import load_cost_curve
from orchestrator.serving.deployment import COORDINATOR_TITLE
from speculators.draft_length import curve_step
from speculators.sampling import SamplingSettings
from stages.errors import SpecpipeError
from stages.settings import StageSettings

SERVERS = ("specpipe-2-stages", "specpipe-whole", "llama-cpp-server")
IN_PROCESS = "specpipe-2-stages-no-http"
DRAFTED = "specpipe-2-stages-draft"
START_SECONDS = 300.0
CONTEXT = 1024


class ServeBenchError(SpecpipeError):
    """A server of the benchmark did not start or answer; the message is one line."""


def start_specpipe_server(arguments: list[str], port: int, log_path: Path, *, api_key: str | None = None,
                          deadline_seconds: float = START_SECONDS) -> subprocess.Popen:
    """``orchestrate serve ARGUMENTS`` on 127.0.0.1:port (its own local Ray unless
    ARGUMENTS give --address, no dashboard), once it says it is serving; its output goes to log_path."""
    command = [sys.executable, "-m", "orchestrator.cli", "serve", *arguments, "--port", str(port), "--no-dashboard"]
    if api_key:
        command += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + deadline_seconds
    while "serving" not in log_path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(process)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise ServeBenchError(f"orchestrate serve did not start: {tail[0]}")
        time.sleep(0.5)
    return process


def replica_node(cluster):
    """The node of a ``ray.cluster_utils.Cluster`` that runs `orchestrate
    serve`'s replica (the coordinator): its process's title names it, and
    Ray's workers are their raylet's children (another server may run beside it)."""
    import psutil

    raylets = {info.process.pid: node for node in cluster.list_all_nodes()
               for info in node.all_processes.get("raylet", [])}
    [node] = [raylets[process.ppid()] for process in psutil.process_iter(["cmdline"])
              if any(COORDINATOR_TITLE in part for part in process.info["cmdline"] or [])
              and process.ppid() in raylets]
    return node


def _model_name(port: int) -> str:

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
        return json.load(reply)["data"][0]["id"]


PEER = "cpp-llama-server"
PEER_SLOTS = 8


def servers_here() -> tuple[str, ...]:
    """The servers this machine runs: llama.cpp's llama-server joins where it is built."""
    return SERVERS + ((PEER,) if built() else ())


def _start(server: str, stage_paths: list[str], whole_path: str, threads: int, port: int, workdir: Path,
           more: list[str], address: str | None = None):
    if server == PEER:
        return start([tool("llama-server"), "-m", whole_path, "-t", str(threads), "-tb", str(threads),
                      "-c", str(CONTEXT * PEER_SLOTS), "--parallel", str(PEER_SLOTS), "-fa", "off",
                      "--host", "127.0.0.1", "--port", str(port)], port, workdir / f"{server}.log")
    joining = ["--address", address] if address else []  # this project's servers join it: no Ray of their own
    if server in ("specpipe-2-stages", DRAFTED):
        if server == DRAFTED:
            more = [*more, "--speculator", "model", "--draft", realistic_draft(whole_path, workdir)]
        return start_specpipe_server(["--model-split", *stage_paths, "--threads", str(max(1, threads // 2)),
                                      "--n-ctx", str(CONTEXT), "--max-sequences", "8", *more, *joining], port,
                                     workdir / f"{server}.log")
    if server == "specpipe-whole":
        return start_specpipe_server(["--model-split", whole_path, "--threads", str(threads), "--n-ctx", str(CONTEXT),
                                      "--max-sequences", "8", *joining], port, workdir / f"{server}.log")
    try:
        return start_llama_cpp_server(whole_path, port, threads, n_ctx=CONTEXT * 8,
                                      extra_args=["--interrupt_requests", "False"], deadline_s=START_SECONDS)
    except RuntimeError as error:
        raise ServeBenchError(f"llama_cpp.server did not start: {str(error).splitlines()[0]}") from None


def _summary(runs: list[LoadResult]) -> dict:
    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "tokens_per_second": spread([run.tokens_per_s for run in runs]),
        "ttft_p50": spread([run.ttft_p50 for run in runs]), "ttft_p95": spread([run.ttft_p95 for run in runs]),
        "itl_p50": spread([run.itl_p50 for run in runs]), "itl_p95": spread([run.itl_p95 for run in runs]),
        "errors": sum(run.error_count for run in runs),
        # what went wrong, so a failed request is diagnosable from the results alone
        "error_examples": sorted({outcome.error[:200] for run in runs for outcome in run.outcomes if outcome.error})[:3],
        "truncated": sum(run.truncated_count for run in runs),
        "tokens": sum(run.completion_tokens for run in runs),
    }


def run_serve_bench(stage_paths: list[str], whole_path: str, *, threads: int = 2,
                    concurrencies: tuple[int, ...] = (1, 2, 4, 8), repetitions: int = 3, max_tokens: int = 64,
                    prompts: list[str] | None = None, workdir: Path,
                    progress: Callable[[int, int], None] | None = None, cost_curve: str | None = None,
                    address: str | None = None) -> dict:
    """Every server under every concurrency level; see the module docstring.
    cost_curve: a --cost-curve CURVE every stage is held to (emulated figures):
    then only this project's 2-stage servers run, with and without a draft
    model (no curve holds the peers, and the 2-stage curve does not fit the
    whole model as one stage). address: a Ray cluster this project's servers
    and the in-process run join (default: each starts a local Ray of its own)."""
    prompts = list(prompts or DEFAULT_PROMPTS)
    servers = servers_here() if cost_curve is None else ("specpipe-2-stages", DRAFTED)
    total = (len(servers) + 1) * repetitions * len(concurrencies)
    done = 0
    runs: dict[str, dict[int, list[LoadResult]]] = {server: {level: [] for level in concurrencies} for server in servers}

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    runs[IN_PROCESS] = _in_process(stage_paths, prompts, concurrencies, repetitions, max_tokens, step, cost_curve,
                                   address)
    for server in servers:
        port = free_port()
        process = _start(server, stage_paths, whole_path, threads, port, workdir,
                         ["--cost-curve", cost_curve] if cost_curve else [], address)
        try:
            base_url, model = f"http://127.0.0.1:{port}/v1", _model_name(port)
            # llama_cpp.server penalises repeats by default (1.1): greedy without it is the whole model's output
            extra = {"repeat_penalty": 1.0} if server in ("llama-cpp-server", PEER) else None
            asyncio.run(run_load(base_url, model, prompts[:2], 2, 4, extra_body=extra))  # warm-up
            for _ in range(repetitions):
                for level in concurrencies:
                    runs[server][level].append(
                        asyncio.run(run_load(base_url, model, prompts, level, max_tokens, extra_body=extra)))
                    step()
        finally:
            stop_server(process, timeout=60)
    return _results(runs, concurrencies, repetitions, max_tokens, threads, prompts, servers)


def _in_process(stage_paths: list[str], prompts: list[str], concurrencies: tuple[int, ...], repetitions: int,
                max_tokens: int, step: Callable[[], None], cost_curve: str | None,
                address: str | None) -> dict[int, list[LoadResult]]:
    """The service loop over the 2-stage pipeline in this process (a local Ray, or the cluster at ``address``):
    at most ``level`` requests submitted at a time, as the HTTP load generator
    does; its passes priced as orchestrate serve prices them (measured at start)."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings
    from stages.tokenizer import Tokenizer

    tokenizer = Tokenizer(stage_paths[0])
    runs: dict[int, list[LoadResult]] = {level: [] for level in concurrencies}

    settings = StageSettings(n_ctx=CONTEXT, sequences=max(concurrencies),
                             cost_curve=load_cost_curve(cost_curve) if cost_curve else None)
    with ray_session(address), PipelineSettings(stage_paths, settings).start(overlapping=True) as pipeline:
        pass_curve = pipeline.pass_curve()
        batch_step = curve_step(pass_curve)
        for _ in range(repetitions):
            for level in concurrencies:
                service = Service(pipeline, tokenizer.is_end,
                                  ServiceSettings(max_sequences=level, queue_limit=len(prompts), context=CONTEXT,
                                                  stage_count=pipeline.stage_count, batch_step=batch_step,
                                                  pass_curve=pass_curve))
                outcomes = [RequestOutcome(index, usage_received=True) for index in range(len(prompts))]
                tokens: list[list[int]] = [[] for _ in prompts]
                last = [0.0] * len(prompts)
                ended = threading.Semaphore(0)

                def sink(index: int, sent: float):
                    def receive(progress: Progress) -> None:
                        now = time.perf_counter()
                        if progress.tokens:
                            if not tokens[index]:
                                outcomes[index].ttft_s = now - sent
                            else:
                                outcomes[index].itl_s.append(now - last[index])
                            last[index] = now
                            tokens[index].extend(progress.tokens)
                        if progress.finished is not None:
                            outcomes[index].total_s = now - sent
                            outcomes[index].finish_reason = progress.finished
                            outcomes[index].error = progress.error
                            ended.release()
                    return receive

                def submit(index: int) -> None:
                    request = ServiceRequest(tokenizer.tokenize(prompts[index]), max_tokens, SamplingSettings())
                    service.submit(request, sink(index, time.perf_counter()))

                started = time.perf_counter()
                for index in range(min(level, len(prompts))):  # at most `level` at a time, as the HTTP client
                    submit(index)
                for index in range(len(prompts)):
                    ended.acquire()
                    if index + level < len(prompts):
                        submit(index + level)
                wall = time.perf_counter() - started
                service.close(drain_seconds=1)
                for outcome, produced in zip(outcomes, tokens):
                    outcome.completion_tokens = len(produced)
                    outcome.text = b"".join(tokenizer.piece(token) for token in produced).decode("utf-8", "replace")
                runs[level].append(LoadResult(outcomes, wall, level))
                step()
    return runs


def _results(runs: dict[str, dict[int, list[LoadResult]]], concurrencies: tuple[int, ...], repetitions: int,
             max_tokens: int, threads: int, prompts: list[str], servers: tuple[str, ...] = SERVERS) -> dict:
    baseline = "llama-cpp-server"
    solo = {server: [outcome.text for outcome in levels[concurrencies[0]][0].outcomes] for server, levels in runs.items()}
    rows = []
    for server in (IN_PROCESS, *servers):
        levels = runs[server]
        for level, level_runs in levels.items():
            texts = [[outcome.text for outcome in run.outcomes] for run in level_runs]
            rates = [run.tokens_per_s for run in level_runs]
            first_rates = [run.tokens_per_s for run in levels[concurrencies[0]]]
            baseline_rates = [run.tokens_per_s for run in runs[baseline][level]] if baseline in runs else None
            rows.append({
                "server": server, "concurrency": level, **_summary(level_runs),
                # the same repetition's runs paired: ratios within a repetition, then their median
                "over_concurrency_1": statistics.median(rate / first for rate, first in zip(rates, first_rates)),
                # under an emulated curve llama-cpp-server does not run (run_serve_bench): no ratio to it
                "over_llama_cpp_server": None if baseline_rates is None else
                statistics.median(rate / other for rate, other in zip(rates, baseline_rates)),
                "matches_solo": all(text == solo[server] for text in texts),
                # with a draft model: against the same pipeline without one, at the same concurrency
                "over_specpipe_2_stages": None if server != DRAFTED else
                statistics.median(rate / plain.tokens_per_s
                                  for rate, plain in zip(rates, runs["specpipe-2-stages"][level])),
                "matches_llama_cpp_server": None if baseline not in solo else
                all(text == solo[baseline] for text in texts),
            })
    return {"servers": [IN_PROCESS, *servers], "concurrencies": list(concurrencies), "repetitions": repetitions,
            "max_tokens": max_tokens, "threads": threads, "prompts": len(prompts), "rows": rows}


def write_serve_results(results: dict, out_dir: Path) -> list[Path]:
    """serve.json, serve.md (the table) and serve.png (tokens/s by concurrency), each written whole."""

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "serve.json", out_dir / "serve.md", out_dir / "serve.png"]
    write_whole(paths[0], lambda path: path.write_text(json.dumps(results, indent=2)))
    write_whole(paths[1], lambda path: path.write_text(serve_table(results)))
    write_whole(paths[2], lambda path: _chart(results, path))
    return paths


def serve_table(results: dict) -> str:
    emulated = results.get("cost_curve")
    lines = [
        *([f"**Emulated**: every stage pass lasts at least the time of the cost curve \"{emulated['name']}\".", ""]
          if emulated else []),
        f"Command: `{results.get('command', 'orchestrate bench --serve')}`; {results['prompts']} prompts per run, "
        f"max_tokens {results['max_tokens']}, greedy, streamed; {results['threads']} threads in all per server; "
        f"median [min–max] over {results['repetitions']} repetitions.",
        "",
        "| server | concurrency | tokens/s | × concurrency 1 | × llama-cpp-server | × without a draft "
        "| TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | errors | same as solo | same as llama-cpp-server |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in results["rows"]:
        rate = row["tokens_per_second"]
        lines.append(
            f"| {row['server']} | {row['concurrency']} | {rate['median']:.1f} [{rate['min']:.1f}–{rate['max']:.1f}] "
            f"| {row['over_concurrency_1']:.2f} | {_ratio(row['over_llama_cpp_server'])} "
            f"| {_ratio(row['over_specpipe_2_stages'])} "
            f"| {row['ttft_p50']['median']:.3f} / {row['ttft_p95']['median']:.3f} "
            f"| {row['itl_p50']['median'] * 1e3:.1f} / {row['itl_p95']['median'] * 1e3:.1f} "
            f"| {row['errors']} | {'yes' if row['matches_solo'] else 'NO'} "
            f"| {_same(row['matches_llama_cpp_server'])} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _same(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def _chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for server in results["servers"]:
        rows = [row for row in results["rows"] if row["server"] == server]
        levels = [row["concurrency"] for row in rows]
        medians = [row["tokens_per_second"]["median"] for row in rows]
        lows = [row["tokens_per_second"]["median"] - row["tokens_per_second"]["min"] for row in rows]
        highs = [row["tokens_per_second"]["max"] - row["tokens_per_second"]["median"] for row in rows]
        axes.errorbar(levels, medians, yerr=[lows, highs], marker="o", capsize=3, label=server)
    axes.set_xscale("log", base=2)
    axes.set_xticks(results["concurrencies"], [str(level) for level in results["concurrencies"]])
    axes.set_xlabel("concurrent requests")
    axes.set_ylabel("aggregate generated tokens/s")
    axes.set_title("orchestrate bench --serve (median, min–max)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


