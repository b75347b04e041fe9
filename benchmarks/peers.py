"""llama.cpp's own C++ tools beside this project, side by side in one run.

`make peers` builds them from the llama.cpp source llama-cpp-python vendors,
with the same kernels off (Makefile). On the bench's rewrite prompts (the
default model, its chat template, greedy, one thread per part), every
repetition runs in turn:

* whole: llama-cpp-python's ``Llama`` on the whole model (the reference tokens);
* cpp-whole: ``llama-server`` on the whole model;
* pipeline: this project's plain pipeline of the default two stages;
* cpp-rpc-split: llama.cpp's own layer split, ``llama-server`` holding the
  first stage's blocks and a ``ggml-rpc-server`` on loopback the rest
  (``-ngl``: the last K repeating blocks go to the RPC device; the output
  head stays with the server, where this project puts it on the last stage);
* sync, async: this project's speculation by prompt lookup (draft max 8);
* cpp-lookup: ``llama-lookup``, llama.cpp's prompt lookup (draft max 8),
  asked for as many tokens as the reference generated (it does not stop at
  an end token, and would count what it generates after it).

The servers get the prompt as token ids (no template of theirs) with
flash attention off, as ``Llama``; their tokens/s is llama-server's own
``predicted_per_second`` and llama-lookup's printed decode speed (both the
generation phase, as this project's). Every mode's output is checked against
the reference: tokens for the servers and this project; for llama-lookup,
which prints text only, its text up to the reference's end (it may print more:
a whole accepted draft past max_tokens or an end token). The C++ processes are not pinned to
CPUs; this project's stages are, by its own rule.

    python -m benchmarks.peers [--repetitions 3]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import click

from benchmarks.reference import WholeModel
from benchmarks.scenarios import SCENARIO_DIR, load_scenario, prompts_of
from benchmarks.side_by_side import draft_steps
from orchestrator.cluster.connect import free_port, ray_session
from orchestrator.config import BENCH_CONTEXT, DRAFT_MAX, default_model_path, default_stage_paths
from stages.gguf_file import stage_info_of
from stages.settings import StageSettings

LLAMA_VERSION = "0.3.36"
PEERS = Path(os.environ.get("SPECPIPE_PEERS", Path.home() / ".cache" / "specpipe" / "peers"
                            / f"llama.cpp-{LLAMA_VERSION}-noamx-nollamafile")) / "bin"
START_SECONDS = 120  # a server loads and answers /health within this (a liveness bound, not a speed figure)
MODES = ["whole", "cpp-whole", "pipeline", "cpp-rpc-split", "sync", "async", "cpp-lookup"]


TOOLS = ("llama-server", "ggml-rpc-server", "llama-lookup")


def tool(name: str) -> str:
    path = PEERS / name
    if not path.is_file():
        raise SystemExit(f"{path} is not built: run `make peers` first")
    return str(path)


def built() -> bool:
    """Whether `make peers` has built the tools (orchestrate bench then adds their modes)."""
    return all((PEERS / name).is_file() for name in TOOLS)


@contextmanager
def servers(model: str, remote_blocks: int | None, folder: Path, context: int):
    """llama-server on the whole model and, given remote_blocks, a second one
    whose last remote_blocks repeating blocks run in a ggml-rpc-server on
    loopback (llama.cpp's own layer split); yields {"cpp-whole": port,
    "cpp-rpc-split": port}, one thread per part, flash attention off."""
    server = [tool("llama-server"), "-m", model, "-t", "1", "-tb", "1", "-c", str(context), "-fa", "off",
              "--parallel", "1", "--host", "127.0.0.1"]
    ports = {"cpp-whole": free_port()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(server + ["--port", str(ports["cpp-whole"])], ports["cpp-whole"],
                                    folder / "server.log"))
        if remote_blocks is not None:
            rpc_port, ports["cpp-rpc-split"] = free_port(), free_port()
            stack.enter_context(running([tool("ggml-rpc-server"), "-t", "1", "-H", "127.0.0.1", "-p", str(rpc_port)],
                                        log=folder / "rpc.log"))
            stack.enter_context(running(server + ["--port", str(ports["cpp-rpc-split"]), "--rpc",
                                                  f"127.0.0.1:{rpc_port}", "-ngl", str(remote_blocks)],
                                        ports["cpp-rpc-split"], folder / "split.log"))
        yield ports


def start(command: list[str], port: int | None = None, log: Path | None = None) -> subprocess.Popen:
    """A C++ tool in the background; with ``port``, once its /health says ok
    (the caller stops it: ``running`` does)."""
    with open(log or os.devnull, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_SECONDS
        while port is not None:
            if process.poll() is not None:
                raise SystemExit(f"{Path(command[0]).name} exited with {process.returncode} (log: {log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if json.load(reply).get("status") == "ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{Path(command[0]).name} did not answer within {START_SECONDS} s (log: {log})")
            time.sleep(0.2)
        if port is None:  # a bare server (rpc): give it its listening socket
            time.sleep(1.0)
    except BaseException:
        stop(process)
        raise
    return process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


@contextmanager
def running(command: list[str], port: int | None = None, log: Path | None = None):
    """A C++ tool in the background until the block ends (see ``start``)."""
    process = start(command, port, log)
    try:
        yield process
    finally:
        stop(process)


def server_completion(port: int, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """Greedy tokens, generation tokens/s and prompt seconds from a llama-server."""
    request = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
               "return_tokens": True, "repeat_penalty": 1.0}
    call = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(request).encode(),
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(call, timeout=600) as reply:
        answer = json.load(reply)
    timings = answer["timings"]
    return list(answer["tokens"]), float(timings["predicted_per_second"]), float(timings["prompt_ms"]) / 1e3


def lookup_completion(model: str, prompt_text: str, max_tokens: int, workdir: Path) -> tuple[str, float, float]:
    """llama-lookup's generated text, its printed decode speed (its tokens
    over its decode time) and its prompt seconds. It does not stop at an end token, and it may
    go on past max_tokens by the rest of an accepted draft: it is asked for
    as many tokens as the reference generated."""
    prompt_file = workdir / "prompt.txt"
    prompt_file.write_text(prompt_text)
    done = subprocess.run([tool("llama-lookup"), "-m", model, "-f", str(prompt_file), "-n", str(max_tokens),
                           "-t", "1", "-tb", "1", "-c", "2048", "-fa", "off", "--temp", "0", "--repeat-penalty", "1.0",
                           "--spec-draft-n-max", str(DRAFT_MAX)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"llama-lookup exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", done.stderr)  # not "encoded" (the prompt)
    encoded = re.search(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds", done.stderr)
    if decoded is None or float(decoded.group(2)) <= 0:
        raise SystemExit("llama-lookup printed no decode time")
    _, found, generated = done.stdout.partition(prompt_text)  # it prints the prompt, then what it generates
    if not found:
        raise SystemExit("llama-lookup did not print the prompt it was given")
    return generated, int(decoded.group(1)) / float(decoded.group(2)), float(encoded.group(2)) if encoded else 0.0


@click.command()
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
def main(repetitions: int) -> None:
    from orchestrator.cluster.drafter_set import start_drafter_set
    from orchestrator.cluster.drafters import DrafterSettings
    from orchestrator.cluster.pipeline_settings import PipelineSettings
    from orchestrator.decoding.loop import generate
    from orchestrator.decoding.schedule import Schedule
    from speculators.prompt_lookup import PromptLookupSpeculator
    from speculators.sampling import SamplingSettings
    from stages.tokenizer import Tokenizer

    for name in TOOLS:
        tool(name)
    model, paths = str(default_model_path()), default_stage_paths()
    tokenizer = Tokenizer(paths[0])
    scenario = load_scenario(SCENARIO_DIR / "rewrite.toml")
    prompts = prompts_of(tokenizer, scenario)
    prompt_texts = [tokenizer.chat_text([{"role": "user", "content": text}]) for text in scenario.prompts]
    assert [tokenizer.tokenize(text, special=True) for text in prompt_texts] == prompts
    remote_blocks = stage_info_of(paths[-1]).block_count
    rates: dict[str, list[float]] = defaultdict(list)
    differ: list[str] = []
    whole = WholeModel(model)
    with tempfile.TemporaryDirectory() as folder, ray_session(None), \
            PipelineSettings(paths, StageSettings(n_ctx=BENCH_CONTEXT, threads=1)).start() as pipeline, \
            servers(model, remote_blocks, Path(folder), BENCH_CONTEXT) as ports:
        workdir = Path(folder)
        drafter_set = start_drafter_set(pipeline, "ngram", PromptLookupSpeculator, DrafterSettings(draft_max=DRAFT_MAX))
        steps = draft_steps(pipeline)
        try:
            def run(mode: str, index: int, max_tokens: int) -> tuple[list[int] | str, float]:
                prompt = prompts[index]
                if mode == "whole":
                    result = whole.greedy(prompt, max_tokens)
                    return result.tokens, result.tokens_per_second
                if mode in ("cpp-whole", "cpp-rpc-split"):
                    tokens, rate, _ = server_completion(ports[mode], prompt, max_tokens)
                    return (tokens[:-1] if tokens and tokenizer.is_end(tokens[-1]) else tokens), rate  # it keeps the end token
                if mode == "cpp-lookup":  # it does not stop at an end token: asked for the reference's length
                    text, rate, _ = lookup_completion(model, prompt_texts[index], min(max_tokens, lengths[index]),
                                                      workdir)
                    return text, rate
                pipeline.pin_stages(overlapping=mode == "async")
                drafting = None if mode == "pipeline" else drafter_set.drafting(Schedule(mode), DRAFT_MAX,
                                                                                step=steps[mode == "async"])
                result = generate(pipeline, prompt, max_tokens, SamplingSettings(), tokenizer.is_end, drafting=drafting)
                return result.tokens, result.tokens_per_second

            lengths = [max(1, len(whole.greedy(prompt, scenario.max_tokens).tokens)) for prompt in prompts]
            for mode in MODES:  # warm-up
                run(mode, 0, 8)
            for repetition in range(repetitions):
                for index in range(len(prompts)):
                    shift = (repetition + index) % len(MODES)
                    outputs = {}
                    for mode in MODES[shift:] + MODES[:shift]:
                        outputs[mode], rate = run(mode, index, scenario.max_tokens)
                        rates[mode].append(rate)
                    reference = outputs["whole"]
                    text = tokenizer_text(tokenizer, reference)
                    for mode, output in outputs.items():
                        same = output.startswith(text) if isinstance(output, str) else output == reference
                        if not same:
                            differ.append(f"{mode} (prompt {index}, repetition {repetition})")
        finally:
            drafter_set.stop()
    first = statistics.median(rates["whole"])
    print(f"| mode | tokens/s median (range) | x whole |  (rewrite prompts, {repetitions} repetitions, "
          f"{len(paths)} parts of 1 thread; rpc split: {remote_blocks} blocks remote)")
    print("| --- | ---: | ---: |")
    for mode in MODES:
        values = rates[mode]
        print(f"| {mode} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) "
              f"| {statistics.median(values) / first:.2f} |")
    if differ:
        raise SystemExit("outputs differ from the whole model's: " + ", ".join(differ))
    print("\nevery mode's output identical to the whole model's")


def tokenizer_text(tokenizer, tokens: list[int]) -> str:
    return b"".join(tokenizer.piece(token) for token in tokens).decode(errors="replace")


if __name__ == "__main__":
    main()
