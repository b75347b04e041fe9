"""A draft model on a host that holds no stage (llama_duo's laptop drafting
for the machine with the model), side by side with the same draft beside
the stages and with no draft.

    sudo .venv/bin/python -m benchmarks.probe drafter-host [--repetitions 3] [--cost-curve SETUP@MS]

Run from the repository root, as root. Two network namespace hosts
(tests/support/network_hosts.py, a 1 Gbit/s link), Ray's head and the
driver on the first, a worker on the second; SmolLM2 in two stages, both on
the head (`--place`), every stage pass held to the emulated curve (default:
the 405B roofline at 40 ms). The draft is the bench's draft of realistic
agreement (benchmarks.drafts: SmolLM2 requantized), made here. Modes, each
one `orchestrate run` of the prompt per repetition, tokens checked against
the whole model:

* plain: no draft;
* draft beside the stages: a drafter beside each stage, on the head;
* drafter-only host: drafter 0 on the worker (`--drafter-node`, the draft
  shipped there), drafter 1 beside stage 1.

Both hosts share this machine's cores: the figure shows the layout works
and what it does here, not what a second machine adds.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

from benchmarks.probe.harness import Report, probe, table
from benchmarks.reference import WholeModel
from benchmarks.side_by_side import Outcome, side_by_side, spread
from orchestrator.config import default_model_path
from tests.support import network_hosts

PROMPT = "Explain in a few sentences why the sky is blue."
CURVE = "benchmarks/setups/llama-405b-two-machines.toml@40"
MODES = ("plain", "draft beside the stages", "drafter-only host")


@probe("drafter-host", repetitions=3)
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(2))
@click.option("--cost-curve", "curve", default=CURVE, show_default=True)
def drafter_host(repetitions: int, max_tokens: int, curve: str) -> Report:
    """A draft model on a host without a stage, beside the stages, and none,
    side by side (root; the tests' namespace hosts)."""
    from benchmarks.drafts import realistic_draft
    from stages.split import split_model
    from stages.tokenizer import Tokenizer

    model = str(default_model_path())
    work = Path(tempfile.mkdtemp(prefix="specpipe-drafter-host-"))
    stages = [str(work / "stage-0.gguf"), str(work / "stage-1.gguf")]
    split_model(model, stages)
    draft = realistic_draft(model, work)
    reference = WholeModel(model)
    expected = reference.greedy(Tokenizer(model).chat_prompt(PROMPT), max_tokens).tokens
    hosts = network_hosts.TwoHosts(f"draft{os.getpid()}").open()
    try:
        cluster = network_hosts.RayAcrossHosts(hosts)
        try:
            cluster.start()
            head, worker = hosts.first.address, hosts.second.address
            options = {"plain": [],
                       "draft beside the stages": ["--speculator", "model", "--draft", draft],
                       "drafter-only host": ["--speculator", "model", "--draft", draft, "--drafter-node", worker]}

            def run(mode: str, repetition: int) -> Outcome:
                result = cluster.driver(
                    ["-m", "orchestrator.cli", "run", "--model-split", *stages, "--address", cluster.address,
                     "--place", f"0={head},1={head}", "--prompt", PROMPT, "--chat", "--max-tokens", str(max_tokens),
                     "--cost-curve", curve, "--json", *options[mode]], timeout=600)
                if result is None or result.returncode != 0:
                    raise click.ClickException(f"orchestrate run failed: {result.stderr if result else 'timed out'}")
                report = json.loads(result.stdout)
                if report["tokens"] != expected:
                    raise click.ClickException(f"{mode}: the tokens differ from the whole model's")
                click.echo(f"{mode}, repetition {repetition + 1}: {report['tokens_per_second']:.1f} tokens/s",
                           err=True)
                return Outcome({"tokens/s": report["tokens_per_second"],
                                "per pass": report["committed_tokens_per_pass"]}, report["tokens"])

            samples = side_by_side(list(MODES), repetitions, run)
        finally:
            cluster.close()
    finally:
        hosts.close()
    def over_plain(mode: str) -> str:  # repetition by repetition: the modes of one repetition ran back to back
        return spread([mine / plain for mine, plain in zip(samples.of(mode, "tokens/s"), samples.of("plain", "tokens/s"))])

    rows = [[mode, samples.spread(mode, "tokens/s", 1, 1), over_plain(mode), samples.spread(mode, "per pass", 1, 2)]
            for mode in MODES]
    lines = table([f"{max_tokens} tokens of chat, emulated {curve}", "tokens/s", "over plain",
                   "committed a pass"], rows)
    return Report(f"A drafter-only host; link: {'; '.join(hosts.link_notes)}", lines, {"": samples}, {})
