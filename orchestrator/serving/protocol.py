"""The OpenAI API's requests and replies, as pure functions: no HTTP, no Ray.

``parse_request`` checks a decoded JSON body of ``/v1/completions`` or
``/v1/chat/completions`` and returns a ``CompletionRequest`` or raises an
``ApiError`` (status, one-line message, the offending field): the HTTP layer
(orchestrator.serving.app) only turns it into OpenAI's error JSON. Fields that
would change the result and are not supported (``n`` > 8, ``tools``,
``logit_bias``, ...) are refused, never
silently ignored. ``TextAssembler`` turns committed tokens into text and
cuts it exactly before a stop string; the ``*_chunk`` and ``*_response``
functions build the replies.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import COMPLETION_DEFAULT_MAX_TOKENS, MAX_CHOICES, MAX_COMPLETION_LOGPROBS, MAX_STOP_STRINGS
from speculators.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from speculators.sampling import SamplingSettings

ROLES = ("system", "user", "assistant", "developer")

# Fields that change what is generated and are not supported: refused with a 400.
UNSUPPORTED = {
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (insertion) is not supported",
    "echo": "echo is not supported",
    "presence_penalty": "presence_penalty is not supported",
    "frequency_penalty": "frequency_penalty is not supported",
    "audio": "audio is not supported",
    "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
}
# Fields read elsewhere or harmless (they do not change the tokens): accepted.
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
         "stop", "n", "stream", "logprobs", "top_logprobs", "stream_options", "user", "response_format", "best_of", "store", "metadata",
         "parallel_tool_calls", "service_tier", "reasoning_effort"}


class ApiError(Exception):
    """An error reply: HTTP status, one-line message, OpenAI error type and code, the field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's error JSON shape."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request. prompt: text (completions), or messages (chat);
    prompt_tokens: token ids given instead of text; max_tokens None: the rest of the context."""

    chat: bool
    model: str
    prompt: str | None
    prompt_tokens: list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    sampling: SamplingSettings
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    choices: int = 1
    logprobs: int | None = None  # None: none; else each token's logprob and this many alternatives
    response_format: dict | None = None  # None or text; else JSON (stages.grammar.grammar_of makes its grammar)


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad(f"the request body is not UTF-8 (byte {error.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise bad(f"the request body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, not {json.dumps(value)[:40]}", name)
    if value < low or (high is not None and value > high):
        raise bad(f"{name} must be between {low} and {high}, not {value}" if high is not None
                  else f"{name} must be at least {low}, not {value}", name)
    return value


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"{name} must be a number, not {json.dumps(value)[:40]}", name)
    if not low <= value <= high:
        raise bad(f"{name} must be between {low:g} and {high:g}, not {value:g}", name)
    return float(value)


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{index}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("messages must be a list of {role, content} objects", "messages")
    if not messages:
        raise bad("messages must not be empty", "messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{index}].role must be one of {', '.join(ROLES)}, not {json.dumps(role)[:40]}",
                      "messages")
        checked.append({"role": "system" if role == "developer" else role, "content": _content(message, index)})
    return checked


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt must not be empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) and not isinstance(token, bool)
                                                   and token >= 0 for token in prompt):
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(item, (str, list)) for item in prompt):
        raise bad("one prompt per request: a list of prompts is not supported", "prompt")
    raise bad("prompt must be a non-empty string or a list of token ids", "prompt")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(item, str) and item for item in strings):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings, not {len(strings)}", "stop")
    return tuple(strings)


def parse_request(body: dict[str, Any], *, chat: bool, random_seed: Callable[[], int] = lambda: secrets.randbits(31)
                  ) -> CompletionRequest:
    """Check a completions (chat or not) request body; raises ApiError."""
    for name, reason in UNSUPPORTED.items():
        value = body.get(name)
        if value not in (None, False, 0, [], {}):
            raise bad(f"{name}: {reason}", name, "unsupported_parameter")
    unknown = sorted(set(body) - KNOWN - set(UNSUPPORTED))
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}", unknown[0], "unknown_parameter")
    response_format = _response_format(body)
    choices = _integer(body, "n", 1, MAX_CHOICES) or 1
    if _integer(body, "best_of", 1) not in (None, 1):
        raise bad("best_of: only 1 is supported", "best_of", "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be the name of the served model (GET /v1/models)", "model")
    if chat:
        messages, prompt, prompt_tokens = _messages(body), None, None
        if "prompt" in body:
            raise bad("a chat completion takes messages, not prompt", "prompt")
    else:
        if "messages" in body:
            raise bad("a completion takes prompt, not messages (use /v1/chat/completions)", "messages")
        messages = None
        prompt, prompt_tokens = _prompt(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None and not chat:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise bad("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    if options is not None and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    sampling = SamplingSettings(
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),  # OpenAI's default: 1
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0) or 1e-9,  # top_p 0 keeps the likeliest token only
        # OpenAI's seeds are signed 64-bit; the draws take them as unsigned (a negative one wraps around)
        seed=seed % 2**64 if seed is not None else random_seed(),
    )
    return CompletionRequest(chat, model, prompt, prompt_tokens, messages, max_tokens, sampling, _stop(body), stream,
                             bool(options and options.get("include_usage")), choices, _logprobs(body, chat),
                             response_format)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs carry, or None: chat's
    ``logprobs`` (true or false) and ``top_logprobs`` (0..20), or the completions'
    ``logprobs`` (0..5, the alternatives)."""
    if not chat:
        return _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs must be true or false", "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _response_format(body: dict) -> dict | None:
    """The request's response_format, None for text; its schema is checked where its grammar is made."""
    response_format = body.get("response_format")
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                     "json_schema"):
        raise bad("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {...}}", "response_format")
    return None if response_format["type"] == "text" else response_format


class TextAssembler:
    """Committed tokens -> text, held back while it may be the start of a stop
    string, and cut exactly before the first stop string found.

    piece: a token's bytes (the tokenizer's). A character split across tokens
    is given out once complete (invalid UTF-8 becomes U+FFFD)."""

    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...]):
        self.piece = piece
        self.stop = stop
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""  # decoded text not given out yet
        self.stopped = False

    def push(self, tokens: tuple[int, ...] | list[int]) -> str:
        """Text now safe to give out (nothing once stopped)."""
        if self.stopped:
            return ""
        for token in tokens:
            self.pending += self.decoder.decode(self.piece(token))
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, at the end of the generation."""
        if self.stopped:
            return ""
        self.pending += self.decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = min((index for stop in self.stop if (index := self.pending.find(stop)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self.pending = self.pending[:cut], ""
            return text
        hold = 0 if final else self._held_back()
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return text

    def _held_back(self) -> int:
        """Characters at the end of pending that begin some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest


@dataclass
class Reply:
    """What one request produced, for the reply: each choice's text and why it
    ended, and the tokens generated over every choice; with logprobs
    (``piece``: a token's bytes, the tokenizer's), each choice's entries,
    in OpenAI's form for chat or for completions."""

    identifier: str
    model: str
    chat: bool
    prompt_tokens: int
    choices: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    piece: Callable[[int], bytes] | None = None
    scores: list[list[dict]] | None = None  # each choice's logprobs entries (chat's form), when asked

    def __post_init__(self):
        self.texts = self.texts or [""] * self.choices
        self.finish_reasons = self.finish_reasons or [None] * self.choices
        self.scores = [[] for _ in range(self.choices)] if self.piece is not None else None

    def scored(self, index: int, tokens: tuple[int, ...], logprobs: TokenLogprobs) -> list[dict]:
        """Keep the entries of a choice's new tokens (chat's form); returns them."""
        entries = [self._entry(int(token), float(logprob), [(int(other), float(value)) for other, value in
                                                             zip(top_tokens, top_logprobs)])
                   for token, logprob, top_tokens, top_logprobs in
                   zip(tokens, logprobs.logprobs, logprobs.top_tokens, logprobs.top_logprobs)]
        self.scores[index].extend(entries)  # type: ignore[index]
        return entries

    def cut_scores(self, index: int, characters: int) -> int:
        """A stop string cut choice ``index``'s text at ``characters``: drop the
        entries of the tokens that begin at or after the cut; how many went."""
        scores = self.scores[index]  # type: ignore[index]
        starts = itertools.accumulate((len(entry["token"]) for entry in scores), initial=0)
        kept = sum(1 for start, _ in zip(starts, scores) if start < characters)
        dropped = len(scores) - kept
        del scores[kept:]
        return dropped

    def _entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        def described(token: int, logprob: float) -> dict:
            piece = self.piece(token)  # type: ignore[misc]
            return {"token": piece.decode(errors="replace"), "logprob": logprob, "bytes": list(piece)}
        return {**described(token, logprob), "top_logprobs": [described(other, value) for other, value in top]}

    def logprobs_of(self, entries: list[dict] | None, offset: int = 0) -> dict | None:
        """A choice's ``logprobs`` field: chat's {"content": [...]}, or the
        completions' lists (text_offset counted from ``offset`` characters, by
        the tokens' texts: a character split across tokens counts in each)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries}
        offsets = list(itertools.accumulate((len(entry["token"]) for entry in entries[:-1]), initial=offset))
        return {"tokens": [entry["token"] for entry in entries],
                "token_logprobs": [entry["logprob"] for entry in entries],
                "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
                "text_offset": offsets[:len(entries)]}

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.identifier, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    def response(self) -> dict:
        """The non-streaming reply."""
        choices = []
        for index, (text, finish_reason) in enumerate(zip(self.texts, self.finish_reasons)):
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                      "logprobs": self.logprobs_of(self.scores[index] if self.scores else None)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._envelope(False), "choices": choices, "usage": self.usage}

    def chunk(self, text: str, *, index: int = 0, first: bool = False, finish_reason: str | None = None,
              entries: list[dict] | None = None, offset: int = 0) -> dict:
        """One streamed chunk of choice ``index``: new text (and, for chat, the
        role first) with its tokens' logprobs entries, or its end."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                  "logprobs": self.logprobs_of(entries, offset)}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(True), "choices": [], "usage": self.usage}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


FINISH_REASONS = {"end": "stop", "cancelled": "stop", "length": "length"}
