"""`orchestrate serve` as users reach it: a real server (its own local Ray, Ray
Serve, two stage actors) on loopback, the official `openai` client, the real
model. Outputs equal llama-cpp-python's on the whole model under load; errors
are OpenAI-shaped 4xx; a client that goes away frees its KV sequence; a soak
of a few hundred requests leaves nothing held; SIGTERM stops it cleanly.

The tests share one server (starting one takes ~30 s on 2 cores) and run in
file order; the last one stops it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time

import httpx
import openai
import pytest

from conftest import PROMPTS, free_port
from orchestrator.serving.deployment import COORDINATOR_TITLE

KEY = "test-key-0123"
MAX_SEQUENCES = 8
QUEUE = 8
CONTEXT = 512


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log_path):
        self.process, self.port, self.log_path = process, port, log_path
        self.base = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=30).json()

    def settled(self, seconds: float = 10) -> dict:
        """/health once no request holds a sequence any more (or the last one seen)."""
        deadline = time.monotonic() + seconds
        while True:
            health = self.health()
            held = [stage["kv_cells"] for stage in health["stages"]] + [stage["sequences"] for stage in health["stages"]]
            if (health["requests_decoding"] == 0 and not any(held)) or time.monotonic() > deadline:
                return health
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(splits, tmp_path_factory):
    from benchmarks.serve_bench import start_specpipe_server

    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    arguments = ["--model-split", *splits[2], "--max-sequences", str(MAX_SEQUENCES), "--queue", str(QUEUE),
                 "--n-ctx", str(CONTEXT)]
    process = start_specpipe_server(arguments, port, log_path, api_key=KEY)
    running = Server(process, port, log_path)
    yield running
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def tokenizer(splits):
    from stages.tokenizer import Tokenizer

    return Tokenizer(splits[2][0])


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


def whole_model_text(reference, tokens: list[int], max_tokens: int) -> tuple[str, int]:
    """What the whole model says after tokens, and how many tokens that is."""
    produced = reference.greedy(tokens, max_tokens).tokens
    return reference.llama.detokenize(produced).decode("utf-8", errors="replace"), len(produced)


async def ask(client, model: str, *, chat: bool, stream: bool, prompt: str, max_tokens: int, **extra):
    """(text, finish_reason, completion tokens) of one request, streamed or not."""
    if chat:
        arguments = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, **extra)
        call = client.chat.completions.create
    else:
        arguments = dict(model=model, prompt=prompt, max_tokens=max_tokens, **extra)
        call = client.completions.create
    if not stream:
        reply = await call(**arguments)
        choice = reply.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason, reply.usage.completion_tokens
    text, finish, usage = "", None, None
    async for chunk in await call(stream=True, stream_options={"include_usage": True}, **arguments):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


WORK = [  # (chat, stream, prompt, max_tokens): 8 requests at once, different prompts and lengths
    (False, False, PROMPTS[0], 12), (False, True, PROMPTS[1], 40), (True, False, "Name a colour.", 30),
    (True, True, "Why is the sky blue?", 24), (False, True, PROMPTS[2], 20), (False, False, "1, 2, 3, 4,", 33),
    (True, True, "Say hello.", 16), (True, False, "What is 2 + 2?", 28),
]


def test_eight_requests_at_once_equal_the_whole_model(server, model_name, reference, tokenizer):
    expected = []
    for chat, _, prompt, max_tokens in WORK:
        tokens = tokenizer.chat_tokens([{"role": "user", "content": prompt}]) if chat else tokenizer.tokenize(prompt)
        expected.append(whole_model_text(reference, tokens, max_tokens))

    async def main():
        client = server.client()
        return await asyncio.gather(*(ask(client, model_name, chat=chat, stream=stream, prompt=prompt,
                                          max_tokens=max_tokens, temperature=0)
                                      for chat, stream, prompt, max_tokens in WORK))

    got = asyncio.run(main())
    for (chat, stream, prompt, max_tokens), (text, count), (got_text, finish, usage) in zip(WORK, expected, got):
        assert got_text == text, (chat, stream, prompt)
        assert usage == count and finish == ("length" if count == max_tokens else "stop")
    health = server.settled()
    assert health["status"] == "ok" and health["requests_decoding"] == 0
    assert [stage["kv_cells"] for stage in health["stages"]] == [0, 0]


def test_a_seeded_sampled_request_gets_the_same_text_alone_and_under_load(server, model_name):
    sampled = dict(chat=True, stream=True, prompt="Tell me a story about a lamp.", max_tokens=24,
                   temperature=0.9, top_p=0.95, seed=11)

    async def main():
        client = server.client()
        alone = await ask(client, model_name, **sampled)
        others = [ask(client, model_name, chat=False, stream=index % 2 == 0, prompt=prompt, max_tokens=20,
                      temperature=1.0, seed=index) for index, prompt in enumerate(PROMPTS * 2)]
        beside = (await asyncio.gather(ask(client, model_name, **sampled), *others))[0]
        greedy = await ask(client, model_name, **{**sampled, "temperature": 0})
        return alone, beside, greedy

    alone, beside, greedy = asyncio.run(main())
    assert beside == alone and alone[0] != greedy[0]  # and the temperature really changed the draw


def test_a_stop_string_cuts_the_text_exactly(server, model_name, reference, tokenizer):
    text, _ = whole_model_text(reference, tokenizer.tokenize(PROMPTS[1]), 40)
    stop = text[10:14]  # four characters from inside the text: it stops before their first occurrence
    cut = text[: text.index(stop)]

    async def main():
        client = server.client()
        return [await ask(client, model_name, chat=False, stream=stream, prompt=PROMPTS[1], max_tokens=40,
                          temperature=0, stop=[stop, "never appears"]) for stream in (False, True)]

    for got_text, finish, _ in asyncio.run(main()):
        assert got_text == cut and finish == "stop"
    assert server.settled()["stages"][0]["kv_cells"] == 0


def test_the_official_client_gets_a_parsed_pydantic_reply_n_choices_and_logprobs(server, model_name):
    """What agents and evaluation harnesses ask: structured output parsed into
    a pydantic model, several choices, each token's logprobs."""
    from pydantic import BaseModel

    class Ship(BaseModel):
        name: str
        crew: int

    async def main():
        client = server.client()
        parsed = await client.chat.completions.parse(
            model=model_name, messages=[{"role": "user", "content": "Describe a ship as JSON."}],
            response_format=Ship, max_tokens=60, temperature=0)
        several = await client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Tell me about lamps."}], max_tokens=8,
            n=3, temperature=1.0, seed=2, logprobs=True, top_logprobs=2)
        return parsed, several

    parsed, several = asyncio.run(main())
    ship = parsed.choices[0].message.parsed
    assert isinstance(ship, Ship) and parsed.choices[0].finish_reason == "stop"
    assert [choice.index for choice in several.choices] == [0, 1, 2]
    assert len({choice.message.content for choice in several.choices}) == 3  # each choice draws with its own seed
    assert several.usage.completion_tokens == 24
    for choice in several.choices:
        entries = choice.logprobs.content
        assert "".join(entry.token for entry in entries) == choice.message.content and len(entries) == 8
        assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob for entry in entries)
    assert server.settled()["stages"][0]["kv_cells"] == 0


def test_a_chats_second_turn_reuses_the_first_from_the_prefix_cache(server, model_name, reference, tokenizer):
    turn = [{"role": "system", "content": "You keep the harbour's log. " * 20},
            {"role": "user", "content": "Which ships came in today?"}]

    async def ask_turn(messages):
        reply = await server.client().chat.completions.create(model=model_name, messages=messages, max_tokens=12,
                                                               temperature=0)
        return reply.choices[0].message.content

    first = asyncio.run(ask_turn(turn))
    kept = server.settled()["stages"]
    second_turn = [*turn, {"role": "assistant", "content": first}, {"role": "user", "content": "And yesterday?"}]
    second = asyncio.run(ask_turn(second_turn))
    expected, _ = whole_model_text(reference, tokenizer.chat_tokens(second_turn), 12)
    assert second == expected
    assert all(stage["prefix_cache_tokens"] > 100 for stage in kept)  # the first turn was kept in every stage


def post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base + path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("path, body, key, status, message", [
    ("/v1/completions", {"model": "M", "prompt": "hi"}, None, 401, "a valid API key is needed"),
    ("/v1/completions", {"model": "M", "prompt": "hi"}, "wrong", 401, "a valid API key is needed"),
    ("/v1/completions", b'{"model": "M", "prompt": ', KEY, 400, "not valid JSON"),
    ("/v1/completions", b'{"model": "M", "prompt": "\xff"}', KEY, 400, "not UTF-8"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "n": 9}, KEY, 400, "n must be between 1 and 8"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "foo"}}}}}}, KEY, 400, "response_format.json_schema.schema.properties.a"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": -5}, KEY, 400, "at least 1, not -5"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 10**9}, KEY, 400,
     f"max_tokens (1000000000) exceed the context of {CONTEXT}"),
    ("/v1/completions", {"model": "M", "prompt": "word " * 600}, KEY, 400, f"exceed the context of {CONTEXT}"),
    ("/v1/completions", {"model": "M", "prompt": [1, 10**7]}, KEY, 400, "beyond the vocabulary"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, KEY, 404, "model 'gpt-4' is not served here"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, KEY, 400, "messages must not be empty"),
    ("/v1/chat/completions", {"model": "M", "messages": "hi"}, KEY, 400, "messages must be a list"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, KEY, 400,
     "tool calls are not supported"),
])
def test_bad_requests_get_one_clear_openai_error(server, model_name, path, body, key, status, message):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model_name}
    elif isinstance(body, bytes):
        body = body.replace(b'"M"', json.dumps(model_name).encode())
    reply = post(server, path, body, key)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_after_bad_requests_the_server_serves_and_holds_nothing(server, model_name):
    health = server.settled()
    assert health["status"] == "ok" and [stage["kv_cells"] for stage in health["stages"]] == [0, 0]
    reply = post(server, "/v1/completions", {"model": model_name, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_the_official_client_sees_auth_and_model_errors(server, model_name):
    async def main():
        with pytest.raises(openai.AuthenticationError):
            await server.client("wrong").completions.create(model=model_name, prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="is not served here"):
            await server.client().completions.create(model="nope", prompt="hi", max_tokens=2)
        models = await server.client().models.list()
        assert [model.id for model in models.data] == [model_name]

    asyncio.run(main())


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server, model_name):
    body = {"model": model_name, "prompt": PROMPTS[2], "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as reply:
        lines = reply.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
        during = server.health()
        assert during["requests_decoding"] == 1 and all(stage["kv_cells"] > 0 for stage in during["stages"])
        assert all(0 < stage["busy_fraction"] <= 1 for stage in during["stages"])  # computing for the stream
    health = server.settled(seconds=5)  # the generation had 400 tokens to go: only the disconnect ends it now
    assert health["requests_decoding"] == 0
    assert [(stage["kv_cells"], stage["sequences"]) for stage in health["stages"]] == [(0, 0), (0, 0)]
    # and says where each stage computes (this build: the CPU, nothing offloaded)
    assert [(stage["backend"], stage["offloaded_layers"]) for stage in health["stages"]] == [("cpu", 0), ("cpu", 0)]


def test_a_full_queue_answers_429_with_retry_after(server, model_name):
    body = {"model": model_name, "prompt": "Count: 1, 2, 3,", "max_tokens": 24, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body)
                                          for _ in range(MAX_SEQUENCES + QUEUE + 8)))

    replies = asyncio.run(main())
    statuses = sorted(reply.status_code for reply in replies)
    refused = [reply for reply in replies if reply.status_code == 429]
    assert statuses.count(200) >= MAX_SEQUENCES + QUEUE and set(statuses) == {200, 429}, statuses
    assert all(reply.headers["retry-after"] == "1" and reply.json()["error"]["code"] == "queue_full" for reply in refused)
    texts = {reply.json()["choices"][0]["text"] for reply in replies if reply.status_code == 200}
    assert len(texts) == 1  # the same greedy request: the same text, however busy
    assert server.settled()["requests_queued"] == 0


def test_dozens_of_requests_with_random_disconnects(server, model_name):
    """64 requests at concurrency 8, a quarter of them dropped by their
    client mid-stream: every other one completes or gets an error, none hangs
    (a minute without a byte is a client timeout, an outcome the test
    refuses; the overall limit only keeps a deadlock from stalling the suite);
    afterwards no sequence is held and no stage grew. (The long soak, hundreds
    of requests with faults, is a benchmark: benchmarks/chaos.py.)"""
    rng = random.Random(7)
    plan = [(rng.choice(PROMPTS) + f" ({index})", rng.randint(1, 10), rng.random() < 0.25) for index in range(64)]
    before = [stage["rss_mb"] for stage in server.health()["stages"]]
    outcomes: list[str] = []

    async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, disconnect: bool) -> None:
        body = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.7,
                "seed": max_tokens}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    outcomes.append(f"status {reply.status_code}")
                    return
                async for line in reply.aiter_lines():
                    if disconnect and line.startswith("data: {"):
                        outcomes.append("dropped")
                        return  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        outcomes.append("done")
                        return
                    if line.startswith('data: {"error"'):
                        outcomes.append("error")
                        return
            outcomes.append("no [DONE]")
        except httpx.HTTPError as error:
            outcomes.append(f"{type(error).__name__}")

    async def main():
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.base, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            async def paced(item):
                async with gate:
                    await one(client, *item)
            await asyncio.wait_for(asyncio.gather(*(paced(item) for item in plan)), timeout=900)

    asyncio.run(main())
    assert len(outcomes) == len(plan)
    assert set(outcomes) <= {"done", "dropped", "error"}, sorted(set(outcomes))
    assert outcomes.count("dropped") == sum(disconnect for *_, disconnect in plan)
    health = server.settled()
    assert health["requests_decoding"] == 0 and health["requests_queued"] == 0
    assert [(stage["kv_cells"], stage["sequences"]) for stage in health["stages"]] == [(0, 0), (0, 0)]
    after = [stage["rss_mb"] for stage in health["stages"]]
    assert all(now <= then * 1.05 for then, now in zip(before, after)), (before, after)


def test_a_stage_killed_while_four_requests_stream_loses_no_request_and_no_token(server, model_name, reference,
                                                                               tokenizer):
    """SIGKILL stage 1 once four streams are under way: the stage is restarted
    and every request's cache replayed; each stream completes with the text it
    gets alone (the whole model's), and /health reports the restart."""
    work = [(chat, prompt, 40) for chat, _, prompt, _ in WORK[:4]]
    expected = []
    for chat, prompt, max_tokens in work:
        tokens = tokenizer.chat_tokens([{"role": "user", "content": prompt}]) if chat else tokenizer.tokenize(prompt)
        expected.append(whole_model_text(reference, tokens, max_tokens))
    victim = server.health()["stages"][1]["process"]
    chunks_seen = 0

    async def stream(client, chat, prompt, max_tokens):
        nonlocal chunks_seen
        arguments = dict(model=model_name, max_tokens=max_tokens, temperature=0, stream=True)
        if chat:
            replies = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **arguments)
        else:
            replies = await client.completions.create(prompt=prompt, **arguments)
        text = ""
        async for chunk in replies:
            for choice in chunk.choices:
                text += (choice.delta.content or "") if chat else choice.text
            chunks_seen += 1
            if chunks_seen == 8:  # every stream has begun: kill the stage mid-generation
                os.kill(victim, signal.SIGKILL)
        return text

    async def main():
        client = server.client()
        return await asyncio.gather(*(stream(client, *item) for item in work))

    texts = asyncio.run(main())
    assert chunks_seen > 8
    assert texts == [text for text, _ in expected]
    health = server.settled()
    assert health["status"] == "ok", health
    assert [stage["restarts"] for stage in health["stages"]] == [0, 1]
    assert health["stages"][1]["process"] != victim
    assert [stage["kv_cells"] for stage in health["stages"]] == [0, 0]


def replica_process(server: Server):
    """This server's Serve replica process (the coordinator): Ray titles it
    ``ray::ServeReplica:specpipe:coordinator``. Only the server's own descendants are
    searched: a test beside this one (another pytest worker) may run a service."""
    import psutil

    def titled(process) -> bool:
        try:
            return any(COORDINATOR_TITLE in part for part in process.cmdline())
        except psutil.Error:  # gone since the listing
            return False

    [replica] = [process for process in psutil.Process(server.process.pid).children(recursive=True) if titled(process)]
    return replica


def test_the_coordinator_killed_mid_stream_loses_no_request_and_takes_over_the_same_stage_processes(
        server, model_name, reference, tokenizer):
    """SIGKILL the coordinator's replica while three requests stream (two
    greedy, one seeded and sampled): Serve starts a new one, which takes over
    the loaded stages (the same processes, no reload), the front asks it each
    request again, and every stream ends with the text it gets alone (greedy:
    the whole model's; seeded: its text asked before the kill), within
    REPLICA_BACK_SECONDS (the bound docs/architecture.md states) and the 30 s
    the three take to generate their tokens again on two loaded cores."""
    from orchestrator.config import REPLICA_BACK_SECONDS

    seeded = {"temperature": 0.9, "seed": 11}
    asked = [(PROMPTS[0], {"temperature": 0}), (PROMPTS[1], {"temperature": 0}), (PROMPTS[2], seeded)]
    expected = [whole_model_text(reference, tokenizer.tokenize(PROMPTS[0]), 60)[0],
                whole_model_text(reference, tokenizer.tokenize(PROMPTS[1]), 60)[0],
                post(server, "/v1/completions", {"model": model_name, "prompt": PROMPTS[2], "max_tokens": 60,
                                                 **seeded}).json()["choices"][0]["text"]]
    before = server.settled()["stages"]
    replica = replica_process(server)
    lines: list[list[str]] = [[], [], []]
    at_kill: list[int] = []

    async def stream(client, prompt, sampling, mine):
        body = {"model": model_name, "prompt": prompt, "max_tokens": 60, "stream": True, **sampling}
        async with client.stream("POST", server.base + "/v1/completions", json=body, timeout=REPLICA_BACK_SECONDS,
                                 headers={"Authorization": f"Bearer {KEY}"}) as reply:
            async for line in reply.aiter_lines():
                if line:  # not the blank lines between events
                    mine.append(line)
                if sum(len(each) >= 2 for each in lines) == len(lines) and replica.is_running():
                    at_kill.extend(len(each) for each in lines)
                    killed.append(time.monotonic())
                    replica.kill()  # every stream under way: each holds a KV sequence
        chunks = [json.loads(line[len("data: "):]) for line in mine if line.startswith("data: {")]
        return "".join(choice["text"] for chunk in chunks for choice in chunk.get("choices", []))

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(stream(client, prompt, sampling, mine)
                                          for (prompt, sampling), mine in zip(asked, lines)))

    killed: list[float] = []
    texts = asyncio.run(main())
    assert at_kill and all(2 <= count < len(mine) for count, mine in zip(at_kill, lines)), (at_kill, lines)
    assert [mine[-1] for mine in lines] == ["data: [DONE]"] * 3, lines
    assert texts == expected
    # a new coordinator within REPLICA_BACK_SECONDS, then the three requests' tokens generated again
    assert time.monotonic() - killed[0] < REPLICA_BACK_SECONDS + 30
    assert replica_process(server).pid != replica.pid
    health = server.settled()
    assert health["status"] == "ok", health
    assert health["requests_asked_again"] >= 3  # the front's count of them
    assert [stage["process"] for stage in health["stages"]] == [stage["process"] for stage in before]  # not reloaded
    assert [(stage["kv_cells"], stage["sequences"]) for stage in health["stages"]] == [(0, 0), (0, 0)]


def test_sigterm_lets_the_request_in_flight_finish_then_stops_cleanly(server, model_name):
    body = {"model": model_name, "prompt": PROMPTS[0], "max_tokens": 60, "stream": True, "temperature": 0}
    lines = []
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as reply:
        for line in filter(None, reply.iter_lines()):  # without the blank lines between events
            lines.append(line)
            if len(lines) == 2:
                os.kill(server.process.pid, signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in "".join(lines)  # it was allowed to finish
    assert server.process.wait(timeout=60) == 0, server.log()
    log = server.log()
    assert "stopping" in log and log.rstrip().endswith("stopped") and "Traceback" not in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base + "/health", timeout=5)
