"""`orchestrate serve --speculator model`: a drafter beside every stage (the
actors `orchestrate run` uses, a KV sequence per request in each), driven by
the one decoding loop; concurrent requests get the whole model's text, and
each the same as alone. The draft is SmolLM2 requantized (benchmarks.drafts),
so drafts are accepted and rejected within every request."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import free_port
from test_serve import KEY, Server, ask, whole_model_text

WORK = [(True, True, "Tell me about the moon.", 32), (False, False, "The capital of France is", 24),
        (True, False, "What makes a good friend?", 28), (False, True, "Once upon a time", 20)]


@pytest.fixture(scope="module")
def server(splits, realistic_draft, tmp_path_factory):
    from benchmarks.serve_bench import start_specpipe_server

    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-drafters") / "serve.log"
    arguments = ["--model-split", *splits[2], "--max-sequences", "4", "--n-ctx", "512", "--speculator", "model",
                 "--draft", realistic_draft, "--draft-threads", "1"]
    process = start_specpipe_server(arguments, port, log_path, api_key=KEY)
    yield Server(process, port, log_path)
    process.terminate()
    process.wait(60)


def test_a_drafter_beside_every_stage_and_concurrent_requests_equal_the_whole_model_and_alone(
        server, reference, splits):
    from stages.tokenizer import Tokenizer

    tokenizer = Tokenizer(splits[2][0])
    model = httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    expected = []
    for chat, _, prompt, max_tokens in WORK:
        tokens = tokenizer.chat_tokens([{"role": "user", "content": prompt}]) if chat else tokenizer.tokenize(prompt)
        expected.append(whole_model_text(reference, tokens, max_tokens)[0])

    async def together(**extra):
        client = server.client()
        return await asyncio.gather(*(ask(client, model, chat=chat, stream=stream, prompt=prompt,
                                          max_tokens=max_tokens, **extra)
                                      for chat, stream, prompt, max_tokens in WORK))

    async def alone(index, **extra):
        chat, stream, prompt, max_tokens = WORK[index]
        return await ask(server.client(), model, chat=chat, stream=stream, prompt=prompt, max_tokens=max_tokens,
                         **extra)

    greedy = asyncio.run(together(temperature=0))
    assert [text for text, _, _ in greedy] == expected, server.log()
    seeded = dict(temperature=0.9, seed=11)
    assert asyncio.run(together(**seeded))[2] == asyncio.run(alone(2, **seeded))
    health = server.settled()
    drafters = health["drafters"]
    assert [drafter["index"] for drafter in drafters] == [0, 1] and all(drafter["alive"] for drafter in drafters)
    assert all(drafter["busy_seconds"] > 0 for drafter in drafters)  # both machines drafted (requests sharing passes spread over them)
    assert health["status"] == "ok" and [stage["kv_cells"] for stage in health["stages"]] == [0, 0]
