"""OpenAI requests and replies (orchestrator.serving.protocol): checks, stop strings, reply shapes. Pure."""

from __future__ import annotations

import json

import pytest

from orchestrator.serving.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS, ApiError, Reply, TextAssembler, decode_body, parse_request, sse,
)


def completion(**fields):
    return {"model": "m", "prompt": "hello", **fields}


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(body, *, chat_route=None) -> ApiError:
    """The error parsing body gives, on the chat route if it has messages and no prompt (or as told)."""
    if chat_route is None:
        chat_route = "messages" in body and "prompt" not in body
    with pytest.raises(ApiError) as caught:
        parse_request(body, chat=chat_route)
    return caught.value


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe{}", "the request body is not UTF-8 (byte 0)"),
    (b'{"model": ', "the request body is not valid JSON: Expecting value at line 1 column 11"),
    (b"[1, 2]", "the request body must be a JSON object"),
])
def test_a_malformed_body_gets_one_line(raw, message):
    with pytest.raises(ApiError) as caught:
        decode_body(raw)
    assert (caught.value.status, caught.value.message) == (400, message)


@pytest.mark.parametrize("body, field, message", [
    (completion(n=9), "n", "n must be between 1 and 8, not 9"),
    (completion(logprobs=6), "logprobs", "logprobs must be between 0 and 5, not 6"),
    (chat(logprobs=2), "logprobs", "logprobs must be true or false"),
    (chat(top_logprobs=3), "top_logprobs", "top_logprobs needs logprobs: true"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs must be between 0 and 20, not 21"),
    (chat(tools=[{"type": "function"}]), "tools", "tools: tool calls are not supported"),
    (chat(response_format={"type": "xml"}), "response_format", "response_format must be {\"type\": \"text\"}"),
    (completion(best_of=3), "best_of", "best_of: only 1 is supported"),
    (completion(frequency_penalty=0.5), "frequency_penalty", "frequency_penalty is not supported"),
    (completion(temperatur=0), "temperatur", "unknown field 'temperatur'"),
    (completion(max_tokens=-1), "max_tokens", "max_tokens must be at least 1, not -1"),
    (completion(max_tokens="ten"), "max_tokens", "max_tokens must be an integer, not \"ten\""),
    (completion(max_tokens=True), "max_tokens", "max_tokens must be an integer, not true"),
    (completion(temperature=3), "temperature", "temperature must be between 0 and 2, not 3"),
    (completion(top_p="x"), "top_p", "top_p must be a number"),
    (completion(seed=1.5), "seed", "seed must be an integer"),
    (completion(stop=["a", "b", "c", "d", "e"]), "stop", "stop takes at most 4 strings, not 5"),
    (completion(stop=[""]), "stop", "stop must be a non-empty string or a list of them"),
    (completion(stream="yes"), "stream", "stream must be true or false"),
    (completion(stream_options={"include_usage": True}), "stream_options", "only allowed with stream: true"),
    (completion(prompt=["a", "b"]), "prompt", "one prompt per request"),
    (completion(prompt=""), "prompt", "prompt must not be empty"),
    (completion(prompt=[1, -2]), "prompt", "prompt must be a non-empty string or a list of token ids"),
    (completion(model=None), "model", "model must be the name of the served model"),
    (completion(messages=[]), "messages", "a completion takes prompt, not messages"),
])
def test_bad_or_unsupported_fields_are_refused_by_name(body, field, message):
    error = refused(body)
    assert error.status == 400 and error.param == field and message in error.message
    assert error.body()["error"]["param"] == field and error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages, message", [
    ([], "messages must not be empty"),
    ("hi", "messages must be a list"),
    ([{"role": "robot", "content": "x"}], "messages[0].role must be one of"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts are supported"),
])
def test_bad_messages_are_refused(messages, message):
    error = refused(chat(messages=messages), chat_route=True)
    assert error.param == "messages" and message in error.message


def test_defaults_follow_openai():
    parsed = parse_request(completion(), chat=False, random_seed=lambda: 1234)
    assert parsed.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS == 16
    assert (parsed.sampling.temperature, parsed.sampling.top_p, parsed.sampling.seed) == (1.0, 1.0, 1234)
    assert parsed.prompt == "hello" and parsed.stop == () and not parsed.stream
    assert parse_request(chat(), chat=True).max_tokens is None  # chat: the rest of the context
    both = parse_request(chat(max_tokens=5, max_completion_tokens=7, seed=3, stop="x", temperature=0), chat=True)
    assert (both.max_tokens, both.sampling.seed, both.stop, both.sampling.greedy) == (7, 3, ("x",), True)
    assert parse_request(completion(prompt=[5, 6]), chat=False).prompt_tokens == [5, 6]
    assert parse_request(completion(prompt=["one"]), chat=False).prompt == "one"
    streamed = parse_request(completion(stream=True, stream_options={"include_usage": True}), chat=False)
    assert streamed.stream and streamed.include_usage


def test_content_parts_and_developer_role_become_plain_messages():
    parsed = parse_request(chat(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "hi"},
    ]), chat=True)
    assert parsed.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"!", 6: b"\xc3", 7: b"\xa9", 8: b"END", 9: b" E"}


def assemble(tokens: list[int], stop: tuple[str, ...], step: int = 1) -> tuple[list[str], bool]:
    assembler = TextAssembler(PIECES.__getitem__, stop)
    given = [assembler.push(tokens[index : index + step]) for index in range(0, len(tokens), step)]
    given.append(assembler.finish())
    return given, assembler.stopped


def test_text_is_cut_exactly_before_a_stop_string_split_across_tokens():
    given, stopped = assemble([1, 2, 3, 4, 5], ("o wo",))
    assert "".join(given) == "Hell" and stopped


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    given, stopped = assemble([1, 2, 3, 4], ("lo!",))
    # "Hel" ends with "l" and "Hello" with "lo", starts of "lo!": each is held until the next
    # token shows it is not the stop string
    assert given == ["He", "l", "lo wor", "ld", ""] and not stopped


def test_without_stop_strings_text_flows_and_a_split_character_waits_for_its_second_byte():
    given, stopped = assemble([1, 6, 7, 5], ())
    assert given == ["Hel", "", "é", "!", ""] and not stopped


def test_the_earliest_stop_string_wins_and_nothing_follows_it():
    given, stopped = assemble([1, 2, 9, 8, 3, 4], ("world", " E"), step=3)
    assert "".join(given) == "Hello" and stopped


def test_replies_have_openai_shapes():
    reply = Reply("chatcmpl-1", "m", True, prompt_tokens=4, created=7)
    first = reply.chunk("", first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert reply.chunk("Hi")["choices"][0]["delta"] == {"content": "Hi"}
    end = reply.chunk("", finish_reason="stop")["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == "stop"
    reply.texts[0], reply.completion_tokens, reply.finish_reasons[0] = "Hi", 1, "stop"
    response = reply.response()
    assert response["object"] == "chat.completion" and response["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert response["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    assert reply.usage_chunk()["choices"] == [] and reply.usage_chunk()["usage"]["total_tokens"] == 5
    several = Reply("cmpl-2", "m", False, prompt_tokens=2, choices=3)
    several.texts[2], several.finish_reasons = "c", ["stop", "length", "stop"]
    assert [(choice["index"], choice["text"], choice["finish_reason"]) for choice in several.response()["choices"]] \
        == [(0, "", "stop"), (1, "", "length"), (2, "c", "stop")]
    assert several.chunk("x", index=2)["choices"][0]["index"] == 2
    assert parse_request(completion(n=3), chat=False).choices == 3
    assert parse_request(completion(seed=-1), chat=False).sampling.seed == 2**64 - 1  # signed seeds wrap
    text = Reply("cmpl-1", "m", False, prompt_tokens=2)
    assert text.chunk("a")["object"] == "text_completion" and text.chunk("a")["choices"][0]["text"] == "a"
    assert sse("[DONE]") == "data: [DONE]\n\n" and json.loads(sse({"a": "é"})[6:]) == {"a": "é"}


def test_logprobs_and_response_formats_are_read_as_asked():
    assert parse_request(chat(logprobs=True, top_logprobs=3), chat=True).logprobs == 3
    assert parse_request(chat(logprobs=True), chat=True).logprobs == 0
    assert parse_request(chat(logprobs=False), chat=True).logprobs is None
    assert parse_request(completion(logprobs=2), chat=False).logprobs == 2
    assert parse_request(chat(response_format={"type": "text"}), chat=True).response_format is None
    assert parse_request(chat(response_format={"type": "json_object"}), chat=True).response_format == {
        "type": "json_object"}


def test_logprobs_take_openais_chat_and_completion_forms():
    import numpy as np

    from speculators.logprobs import TokenLogprobs

    pieces = {1: b"Hi", 2: b" there", 3: b"!"}
    scores = TokenLogprobs(np.array([-0.5, -1.5], np.float32), np.array([[1, 3], [2, 1]], np.int32),
                           np.array([[-0.5, -2.0], [-1.5, -3.0]], np.float32))
    chat_reply = Reply("chatcmpl-1", "m", True, prompt_tokens=1, piece=pieces.__getitem__)
    entries = chat_reply.scored(0, (1, 2), scores)
    content = chat_reply.response()["choices"][0]["logprobs"]["content"]
    assert content == entries and content[1] == {
        "token": " there", "logprob": -1.5, "bytes": list(b" there"),
        "top_logprobs": [{"token": " there", "logprob": -1.5, "bytes": list(b" there")},
                         {"token": "Hi", "logprob": -3.0, "bytes": list(b"Hi")}]}
    text_reply = Reply("cmpl-1", "m", False, prompt_tokens=1, piece=pieces.__getitem__)
    text_reply.scored(0, (1, 2), scores)
    assert text_reply.response()["choices"][0]["logprobs"] == {
        "tokens": ["Hi", " there"], "token_logprobs": [-0.5, -1.5],
        "top_logprobs": [{"Hi": -0.5, "!": -2.0}, {" there": -1.5, "Hi": -3.0}], "text_offset": [0, 2]}
    assert Reply("cmpl-2", "m", False, prompt_tokens=1).response()["choices"][0]["logprobs"] is None


def test_a_stop_string_drops_the_logprobs_of_the_tokens_past_it():
    import numpy as np

    from speculators.logprobs import TokenLogprobs

    pieces = {1: b"ab", 2: b"cd", 3: b"ef"}
    reply = Reply("cmpl-1", "m", False, prompt_tokens=1, piece=pieces.__getitem__)
    reply.scored(0, (1, 2, 3), TokenLogprobs(np.zeros(3, np.float32), np.zeros((3, 0), np.int32),
                                             np.zeros((3, 0), np.float32)))
    assert reply.cut_scores(0, 3) == 1  # "abc|": the token "cd" began before the cut, "ef" after
    assert reply.response()["choices"][0]["logprobs"]["tokens"] == ["ab", "cd"]
