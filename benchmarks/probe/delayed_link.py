"""A plain pipeline across a link with delay, measured beside what
`orchestrate plan` predicts for that link.

    sudo .venv/bin/python -m benchmarks.probe delayed-link [--delay-ms 5] [--repetitions 3] [--profile P.json]

Run from the repository root, as root. Two network namespace hosts
(tests/support/network_hosts.py) joined by the delay line
(tests/support/delay_line.py: every packet DELAY ms one way; tbf 1 Gbit/s),
Ray's head and the driver on the first, a worker on the second; SmolLM2 cut
at block 15, stage 0 beside the coordinator and stage 1 across the link, so
that two of the three hops cross it, as the planner's model of two machines
has them. Each repetition is one `orchestrate run` of the prompts (greedy,
tokens checked against the whole model). The prediction: `orchestrate plan`
of two machines described by this machine's profile (made first unless
given), the link's latency and bandwidth, the same split. Prints measured
tokens/s (median, range) against predicted, as a ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from benchmarks.probe.harness import Report, probe, table
from benchmarks.reference import WholeModel
from benchmarks.side_by_side import Outcome, side_by_side
from orchestrator.config import default_model_path
from tests.support import network_hosts

PROMPT = "Once upon a time, in a small village by the sea,"
LINK_GBIT = 1.0  # network_hosts.LINK_RATE


def setup_text(model: str, profile: str | os.PathLike, delay_ms: float, *, boundaries: list[int],
               max_tokens: int) -> str:
    """An `orchestrate plan` setup: two machines as profiled, joined by the delayed link both ways."""
    return "\n".join([
        f"max_tokens = {max_tokens}",
        f"boundaries = {boundaries}",
        "[model]", f"gguf = {json.dumps(str(model))}",
        "[[machines]]", f"profile = {json.dumps(str(profile))}",
        "[[machines]]", f"profile = {json.dumps(str(profile))}",
        "[[links]]", f"latency_ms = {delay_ms}", f"bandwidth_gbit_per_s = {LINK_GBIT}",
        "[software]", f"profile = {json.dumps(str(profile))}",
        "",
    ])


def _orchestrate(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *arguments], capture_output=True, text=True,
                          timeout=1800)


@probe("delayed-link", repetitions=3)
@click.option("--delay-ms", default=5.0, show_default=True, type=click.FloatRange(0.0, 100.0))
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(2))
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False),
              help="This machine's `orchestrate profile` (default: made now).")
def delayed_link(repetitions: int, delay_ms: float, max_tokens: int, profile_path: str | None) -> Report:
    """A plain pipeline across two namespace hosts joined by a link with delay,
    against `orchestrate plan`'s prediction for that link (root; the tests'
    namespace hosts)."""
    from stages.split import split_model

    model = str(default_model_path())
    work = Path(tempfile.mkdtemp(prefix="specpipe-delayed-"))
    stages = [str(work / "stage-0.gguf"), str(work / "stage-1.gguf")]
    split_model(model, stages, [15])
    if profile_path is None:
        click.echo("profiling this machine (orchestrate profile)...", err=True)
        profile_path = str(work / "profile.json")
        made = _orchestrate("profile", "--out", profile_path)
        if made.returncode != 0:
            raise click.ClickException(f"orchestrate profile failed: {made.stderr.strip()[-500:]}")
    setup = work / "setup.toml"
    setup.write_text(setup_text(model, profile_path, delay_ms, boundaries=[15], max_tokens=max_tokens))
    planned = _orchestrate("plan", str(setup), "--json")
    if planned.returncode != 0:
        raise click.ClickException(f"orchestrate plan failed: {planned.stderr.strip()}")
    predicted = json.loads(planned.stdout)["predictions"]["plain"]["tokens_per_second"]

    reference = WholeModel(model)
    expected = reference.greedy(reference.tokenize(PROMPT), max_tokens).tokens
    hosts = network_hosts.TwoHosts(f"bench{os.getpid()}", delay_ms=delay_ms).open()
    try:
        cluster = network_hosts.RayAcrossHosts(hosts)
        try:
            cluster.start()

            def run(mode: str, repetition: int) -> Outcome:
                result = cluster.driver(
                    ["-m", "orchestrator.cli", "run", "--model-split", *stages, "--address", cluster.address,
                     "--place", f"0={hosts.first.address},1={hosts.second.address}", "--raw", "--prompt", PROMPT,
                     "--max-tokens", str(max_tokens), "--json"], timeout=600)
                if result is None or result.returncode != 0:
                    raise click.ClickException(f"orchestrate run failed: {result.stderr if result else 'timed out'}")
                report = json.loads(result.stdout)
                if report["tokens"] != expected:
                    raise click.ClickException("the tokens differ from the whole model's")
                click.echo(f"repetition {repetition + 1}: {report['tokens_per_second']:.1f} tokens/s", err=True)
                return Outcome({"tokens/s": report["tokens_per_second"], "hop": report["hop_seconds"]},
                               report["tokens"])

            samples = side_by_side(["across the link"], repetitions, run)
        finally:
            cluster.close()
    finally:
        hosts.close()
    measured = samples.of("across the link", "tokens/s")
    median = statistics.median(measured)
    lines = [*table(["plain pipeline, stage 1 across the link", "measured", "orchestrate plan predicted",
                     "measured / predicted", "hop (ms)"],
                    [[f"{max_tokens} tokens a run, tokens identical", samples.spread("across the link", "tokens/s", 1, 1),
                      f"{predicted:.1f}", f"{median / predicted:.2f} ({min(measured) / predicted:.2f}-"
                      f"{max(measured) / predicted:.2f})", samples.spread("across the link", "hop", 1e3, 2)]]),
             "", f"within 20 %: {'yes' if 0.8 <= median / predicted <= 1.2 else 'NO'}"]
    return Report(f"A link with {delay_ms:g} ms one way, against the planner; link: {'; '.join(hosts.link_notes)}",
                  lines, {"": samples}, {"predicted_tokens_per_second": predicted})
