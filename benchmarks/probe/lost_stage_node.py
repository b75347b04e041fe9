"""`orchestrate serve` losing a stage's machine under load, on a cluster
shaped as real ones are (a head with CPUs, workers with several):

    python -m benchmarks.probe lost-stage-node [--head-cpus 2] [--worker-cpus 2] [--repetitions 3]

Each repetition starts a Ray cluster of its own on this machine
(``ray.cluster_utils.Cluster``: the head and three workers, one a spare),
`orchestrate serve --model` (the default model) `--stages 2 --max-sequences
4` under the 405B setup's emulated curve at 40 ms, asks four greedy chat
questions at once, and once they decode kills the process of the stage
that is not on Ray's head (which cannot be lost here), off the Serve
replica's node where one is, and removes its node without a drain (as a
machine dies); then asks two more. Each answer is compared
with the whole model's greedy answer to the same question (llama.cpp on
the unsplit file). Reported: answers that succeeded and were exact, by
repetition, and which stage was lost."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from pathlib import Path

import click

from benchmarks.probe.harness import Report, probe, table
from benchmarks.reference import WholeModel
from orchestrator.cluster.connect import free_port, ray_environment
from orchestrator.config import default_model_path

QUESTIONS = ("Why is the sky blue?", "Name three rivers.", "What is a prime number?", "Say hello in French.",
             "What is 2 + 2?", "Who wrote Hamlet?")
MAX_TOKENS = 32
CURVE = "benchmarks/setups/llama-405b-two-machines.toml@40"


def _ask_all(base: str, lose) -> list[str | None]:
    """The questions' answers (None: failed): four at once, ``lose()`` once
    they decode, then two more."""
    import httpx
    import openai

    async def ask(client, model: str, question: str) -> str | None:
        try:
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0)
            return reply.choices[0].message.content
        except openai.OpenAIError:
            return None

    async def main() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id
        asks = [asyncio.create_task(ask(client, model, question)) for question in QUESTIONS[:4]]
        while httpx.get(base + "/health", timeout=30).json()["requests_decoding"] == 0:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(lose)
        return [*await asyncio.gather(*asks), *[await ask(client, model, question) for question in QUESTIONS[4:]]]

    return asyncio.run(main())


def _one_repetition(head_cpus: int, worker_cpus: int) -> tuple[int, bool, list[str | None]]:
    """(the lost stage, whether the replica ran on its node, each question's
    answer) on a fresh cluster."""
    import httpx
    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.serve_bench import replica_node, start_specpipe_server, stop_server

    ray_environment()
    os.environ["SPECPIPE_STAGE_CACHE"] = tempfile.mkdtemp(prefix="specpipe-lost-node-")  # the nodes share it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False,
                                                            "object_store_memory": 100 * 1024**2})
    for _ in range(3):
        cluster.add_node(num_cpus=worker_cpus, object_store_memory=100 * 1024**2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port, log = free_port(), Path(tempfile.mkdtemp()) / "serve.log"
    try:
        server = start_specpipe_server(["--address", cluster.address, "--model", str(default_model_path()),
                                        "--stages", "2", "--max-sequences", "4", "--n-ctx", "512",
                                        "--cost-curve", CURVE], port, log)
        try:
            base = f"http://127.0.0.1:{port}"
            stages = httpx.get(base + "/health", timeout=30).json()["stages"]
            coordinator, head = replica_node(cluster).node_id, cluster.head_node.node_id
            # Ray's head cannot be lost here (nor survived); a stage off the replica's node where there is one
            index = min((index for index, stage in enumerate(stages) if stage["node"] != head),
                        key=lambda index: stages[index]["node"] == coordinator)
            with_replica = stages[index]["node"] == coordinator
            [node] = [node for node in cluster.list_all_nodes() if node.node_id == stages[index]["node"]]

            def lose() -> None:  # a machine's death takes its processes with it
                os.kill(stages[index]["process"], signal.SIGKILL)
                cluster.remove_node(node, allow_graceful=False)

            return index, with_replica, _ask_all(base, lose)
        finally:
            stop_server(server, timeout=60)
    finally:
        ray.shutdown()
        cluster.shutdown()


@probe("lost-stage-node", repetitions=3)
@click.option("--head-cpus", default=2, show_default=True, type=click.IntRange(0), help="CPUs of Ray's head.")
@click.option("--worker-cpus", default=2, show_default=True, type=click.IntRange(1), help="CPUs of each worker.")
def lost_stage_node(repetitions: int, head_cpus: int, worker_cpus: int) -> Report:
    """serve loses a stage's machine under four requests, on a cluster with
    a CPU'd head and several-CPU workers: how many of six answers are exact."""
    from stages.tokenizer import Tokenizer

    model = str(default_model_path())
    whole, tokenizer = WholeModel(model), Tokenizer(model)
    wanted = [whole.llama.detokenize(whole.greedy(tokenizer.chat_prompt(question), MAX_TOKENS).tokens)
              .decode("utf-8", "replace") for question in QUESTIONS]
    rows, outcomes = [], []
    for repetition in range(repetitions):
        lost, with_replica, answers = _one_repetition(head_cpus, worker_cpus)
        exact = sum(answer == want for answer, want in zip(answers, wanted))
        answered = sum(answer is not None for answer in answers)
        rows.append([str(repetition + 1), str(lost), "yes" if with_replica else "no", f"{answered} of {len(QUESTIONS)}",
                     f"{exact} of {len(QUESTIONS)}"])
        outcomes.append({"lost_stage": lost, "replica_on_its_node": with_replica, "answered": answered,
                         "exact": exact})
    lines = table(["repetition", "stage lost", "the replica on its node", "answered",
                   "exact (the whole model's answer)"], rows)
    lines += ["", f"A head with {head_cpus} CPUs and three workers with {worker_cpus} each (one a spare); "
              f"`orchestrate serve --model` (the default model) `--stages 2` under `{CURVE}`; four chat questions "
              f"at once, a stage's node lost mid-decode (not Ray's head; off the Serve replica's node where a stage is), "
              f"then two more; {MAX_TOKENS} tokens each, greedy. Where the replica ran on the lost node, the "
              f"questions it held end with it (no answer) and the later ones go to the replica Serve starts anew."]
    return Report("A stage's machine lost under serve's load", lines, {}, {"outcomes": outcomes})
