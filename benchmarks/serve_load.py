"""Load generator for OpenAI-compatible servers, plus llama-cpp-python's own
server as a baseline.

Pure client: imports only the standard library, numpy and ``openai``. The
baseline server runs in a subprocess (``python -m llama_cpp.server``), so
nothing of llama.cpp is loaded in this process.

    python -m benchmarks.serve_load --model PATH.gguf [--threads 2]
        [--concurrency 1 2 4 8] [--max-tokens 48] [--no-interrupt]

Note: llama_cpp.server serves one request at a time (an asyncio lock), and by
default (``--interrupt_requests True``) it *ends a running stream early*
(sends ``[DONE]``) as soon as another request is waiting. Such cut-short
outcomes have ``finish_reason is None`` (``LoadResult.truncated_count``);
pass ``--interrupt_requests False`` (here: ``--no-interrupt``) to make it
queue requests instead. It also ignores ``stream_options`` (no usage chunk),
so token counts fall back to counting streamed content chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import openai

__all__ = [
    "RequestOutcome",
    "LoadResult",
    "run_load",
    "start_llama_cpp_server",
    "stop_server",
    "DEFAULT_PROMPTS",
]

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\n\n# compute the mean of a list",
    "Water boils at a temperature of",
]


@dataclass
class RequestOutcome:
    """One request's result. ``error`` is '' when the request succeeded."""

    index: int
    text: str = ""
    completion_tokens: int = 0  # from the final usage chunk; 0 if none came
    ttft_s: float = float("nan")  # request sent -> first chunk with content
    itl_s: list[float] = field(default_factory=list)  # between content chunks
    total_s: float = 0.0
    error: str = ""
    finish_reason: str | None = None  # None: the stream ended without one
    usage_received: bool = False  # False: server ignored stream_options
    content_chunks: int = 0  # streamed chunks that carried text

    @property
    def tokens(self) -> int:
        """Usage completion tokens, or the content-chunk count when the
        server sent no usage (llama_cpp.server streams one chunk per token,
        but may merge a multi-byte character's tokens into one chunk)."""
        return self.completion_tokens if self.usage_received else self.content_chunks

    @property
    def ok(self) -> bool:
        return not self.error


def _percentile(values: Sequence[float], q: float) -> float:
    data = [v for v in values if v == v]  # drop NaN
    return float(np.percentile(data, q)) if data else float("nan")


@dataclass
class LoadResult:
    outcomes: list[RequestOutcome]
    wall_s: float
    concurrency: int = 0

    @property
    def completion_tokens(self) -> int:
        """Sum of usage completion tokens (chunk counts where usage is missing)."""
        return sum(o.tokens for o in self.outcomes)

    @property
    def usage_missing_count(self) -> int:
        return sum(1 for o in self.outcomes if o.ok and not o.usage_received)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate generated tokens/s: completion_tokens / wall."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def _ttfts(self) -> list[float]:
        return [o.ttft_s for o in self.outcomes if o.ok]

    @property
    def _itls(self) -> list[float]:
        return [x for o in self.outcomes if o.ok for x in o.itl_s]

    @property
    def ttft_p50(self) -> float:
        return _percentile(self._ttfts, 50)

    @property
    def ttft_p95(self) -> float:
        return _percentile(self._ttfts, 95)

    @property
    def itl_p50(self) -> float:
        return _percentile(self._itls, 50)

    @property
    def itl_p95(self) -> float:
        return _percentile(self._itls, 95)

    @property
    def error_count(self) -> int:
        return sum(1 for o in self.outcomes if o.error)

    @property
    def truncated_count(self) -> int:
        """Successful streams that ended with no finish_reason (cut short)."""
        return sum(1 for o in self.outcomes if o.ok and o.finish_reason is None)


async def _one_request(
    client: openai.AsyncOpenAI,
    semaphore: asyncio.Semaphore,
    index: int,
    prompt: str,
    model: str,
    max_tokens: int,
    chat: bool,
    extra_body: dict | None = None,
) -> RequestOutcome:
    outcome = RequestOutcome(index=index)
    async with semaphore:
        start = time.perf_counter()
        last_content: float | None = None
        parts: list[str] = []
        try:
            common = dict(
                model=model,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                max_tokens=max_tokens,
                extra_body=extra_body,
            )
            if chat:
                stream = await client.chat.completions.create(
                    messages=[{"role": "user", "content": prompt}], **common
                )
            else:
                stream = await client.completions.create(prompt=prompt, **common)
            async for chunk in stream:
                now = time.perf_counter()
                piece = ""
                for choice in chunk.choices or []:
                    if chat:
                        piece += (choice.delta.content or "") if choice.delta else ""
                    else:
                        piece += choice.text or ""
                    if choice.finish_reason:
                        outcome.finish_reason = choice.finish_reason
                if piece:
                    if last_content is None:
                        outcome.ttft_s = now - start
                    else:
                        outcome.itl_s.append(now - last_content)
                    last_content = now
                    outcome.content_chunks += 1
                    parts.append(piece)
                if chunk.usage is not None:
                    outcome.usage_received = True
                    outcome.completion_tokens = chunk.usage.completion_tokens or 0
        except Exception as exc:  # recorded, never raised
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.text = "".join(parts)
        outcome.total_s = time.perf_counter() - start
    return outcome


async def run_load(
    base_url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    api_key: str = "none",
    chat: bool = False,
    timeout: float = 120,
    extra_body: dict | None = None,
) -> LoadResult:
    """Send every prompt once (request i uses prompts[i]), at most
    ``concurrency`` in flight, each streamed greedily; never raises for a
    failed request (see ``RequestOutcome.error``). extra_body: fields beyond
    OpenAI's (llama_cpp.server needs repeat_penalty 1.0 for plain greedy)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    semaphore = asyncio.Semaphore(concurrency)
    try:
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(
                _one_request(client, semaphore, i, p, model, max_tokens, chat, extra_body)
                for i, p in enumerate(prompts)
            )
        )
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return LoadResult(outcomes=list(outcomes), wall_s=wall, concurrency=concurrency)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def start_llama_cpp_server(
    model_path: str,
    port: int,
    threads: int,
    n_ctx: int = 2048,
    *,
    extra_args: Sequence[str] = (),
    deadline_s: float = 120,
) -> subprocess.Popen:
    """Start ``python -m llama_cpp.server`` on 127.0.0.1:port and wait until
    GET /v1/models answers. Raises RuntimeError (with the stderr tail) if the
    server exits or does not answer within ``deadline_s``.

    ``extra_args`` go to the server verbatim, e.g.
    ``["--interrupt_requests", "False"]``. Its stderr goes to a temporary
    file whose path is ``process.stderr_path``."""
    cmd = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
        "--n_ctx", str(n_ctx),
        *extra_args,
    ]
    # A file, not a pipe: a verbose server would otherwise block on a full pipe.
    err = tempfile.NamedTemporaryFile(prefix="llama_cpp_server_", suffix=".log", delete=False)
    process = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT)
    err.close()
    process.stderr_path = err.name  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}/v1/models"
    deadline = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"llama_cpp.server exited with {process.returncode}:\n{_tail(err.name)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return process
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(
                f"llama_cpp.server did not answer {url} within {deadline_s}s:\n{_tail(err.name)}"
            )
        time.sleep(0.5)


def stop_server(process: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def format_table(results: Sequence[LoadResult]) -> str:
    lines = [
        "| conc | tok/s | TTFT p50 (s) | TTFT p95 (s) | ITL p50 (ms) | ITL p95 (ms) | tokens | no usage | truncated | errors | wall (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.concurrency} | {r.tokens_per_s:.1f} | {r.ttft_p50:.3f} | {r.ttft_p95:.3f} "
            f"| {r.itl_p50 * 1e3:.1f} | {r.itl_p95 * 1e3:.1f} | {r.completion_tokens} "
            f"| {r.usage_missing_count} | {r.truncated_count} | {r.error_count} | {r.wall_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF path (starts llama_cpp.server)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--no-interrupt", action="store_true",
                        help="pass --interrupt_requests False (queue instead of cutting streams short)")
    args = parser.parse_args(argv)

    extra = ["--interrupt_requests", "False"] if args.no_interrupt else []
    process = start_llama_cpp_server(args.model, args.port, args.threads, args.n_ctx, extra_args=extra)
    try:
        base_url = f"http://127.0.0.1:{args.port}/v1"
        model = os.path.basename(args.model)
        # Warm-up (not measured).
        asyncio.run(run_load(base_url, model, DEFAULT_PROMPTS[:1], 1, 4, chat=args.chat))
        results = [
            asyncio.run(run_load(base_url, model, DEFAULT_PROMPTS, c, args.max_tokens, chat=args.chat))
            for c in args.concurrency
        ]
    finally:
        stop_server(process)

    print(format_table(results))
    reference = results[0].outcomes
    for r in results[1:]:
        differ = [o.index for o, ref in zip(r.outcomes, reference) if o.text != ref.text]
        print(f"concurrency {r.concurrency}: texts differing from concurrency "
              f"{results[0].concurrency}: {differ or 'none'}")
    for r in results:
        for o in r.outcomes:
            if o.error:
                print(f"  c={r.concurrency} #{o.index} error: {o.error}")


if __name__ == "__main__":
    main()
