"""The OpenAI-compatible HTTP API over the coordinator's service: a FastAPI app.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/v1/models``, ``GET /health``. The requests are checked by the pure
orchestrator.serving.protocol; this module only does HTTP: the API key, the
event stream, the client going away. Ray Serve runs the app as the ingress of
the front deployment (orchestrator.serving.deployment), which reaches the
coordinator's ``Service`` through serving.resuming; nothing here needs Ray.

Each request's events come to its sink on this event loop (the front's task
that follows the request puts them in its queue). A client that disconnects cancels its request
(``finally``): the service frees its KV sequence within one pass.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.config import RESUME_SECONDS, RETRY_AFTER_SECONDS
from orchestrator.decoding.service import (Progress, QueueFull, RequestTooLong, ServiceError, ServiceRequest,
                                           ShuttingDown, Unavailable)
from orchestrator.serving.protocol import (FINISH_REASONS, ApiError, Reply, TextAssembler, decode_body, parse_request,
                                           sse)
from orchestrator.serving.resuming import CoordinatorLost
from speculators.grammar import MAX_GRAMMAR_TOKENS
from stages.errors import GrammarError


class TokenizerLike(Protocol):
    n_vocab: int

    def tokenize(self, text: str, *, special: bool = False) -> list[int]: ...

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...


class ServiceLike(Protocol):
    """The coordinator's service as the app asks it (serving.resuming.ResumingService)."""

    async def submit(self, request: ServiceRequest, sink) -> int: ...

    def cancel(self, number: int) -> None: ...

    def cancel_choice(self, number: int, choice: int) -> None: ...

    async def health(self) -> tuple[dict, int]: ...


@dataclass
class Backend:
    """What the app serves: the service, the tokenizer, the model's name, one
    sequence's context, the drafts a window may add."""

    service: ServiceLike
    tokenizer: TokenizerLike
    model_name: str
    context: int
    draft_room: int
    api_key: str | None = None


class GenerationFailed(Exception):
    """The service ended a request with an error (a stage failed, or shutdown)."""


def build_app(backend: Backend) -> FastAPI:
    """The FastAPI app over ``backend``. Long because FastAPI's routes are
    closures over the app and the backend: each route is a few lines that
    parse (serving.protocol), submit to the service and answer."""
    app = FastAPI(title="specpipe", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):  # noqa: ARG001
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def authorize(request: Request) -> None:
        if backend.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), backend.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")

    @app.get("/health")
    async def health():
        body, status = await backend.service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [
            {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "specpipe"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    async def complete(request: Request, chat: bool):
        authorize(request)
        parsed = parse_request(decode_body(await request.body()), chat=chat)
        if parsed.model != backend.model_name:
            raise ApiError(404, f"model {parsed.model!r} is not served here; this server serves "
                           f"{backend.model_name!r}", param="model", code="model_not_found")
        service_request = request_for(backend, parsed)
        progress: asyncio.Queue[Progress] = asyncio.Queue()
        number = await submit(backend.service, service_request, progress.put_nowait)
        reply = Reply(("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), backend.model_name, chat,
                      len(service_request.prompt_tokens), parsed.choices,
                      piece=backend.tokenizer.piece if parsed.logprobs is not None else None)
        assemblers = [TextAssembler(backend.tokenizer.piece, parsed.stop) for _ in range(parsed.choices)]
        texts = follow(backend.service, number, progress, assemblers, reply)
        if parsed.stream:
            return StreamingResponse(stream(texts, reply, parsed.include_usage, backend.service, number),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            async for index, text, _ in texts:
                reply.texts[index] += text
        except GenerationFailed as error:
            raise ApiError(503, f"the request failed: {error}", kind="server_error", code="generation_failed",
                           headers={"Retry-After": str(round(RESUME_SECONDS))}) from None
        finally:
            backend.service.cancel(number)  # no-op once ended; frees the sequence if the client went away
        return reply.response()

    return app


def request_for(backend: Backend, parsed) -> ServiceRequest:
    """What the service is asked for a checked request: its prompt's tokens,
    its token limit within the context, its grammar (a 400 naming the part of
    a response_format that cannot be one)."""
    from stages.grammar import grammar_of

    tokens = prompt_tokens(backend, parsed)
    room = backend.context - len(tokens) - backend.draft_room
    try:
        grammar = None if parsed.response_format is None else grammar_of(parsed.response_format)
    except GrammarError as error:
        raise ApiError(400, str(error), param="response_format", code="invalid_response_format") from None
    if grammar is not None:  # every pass carries the tokens generated under it (messages.TokenChoice)
        if (parsed.max_tokens or 0) > MAX_GRAMMAR_TOKENS:
            raise ApiError(400, f"max_tokens: at most {MAX_GRAMMAR_TOKENS} with a response_format",
                           param="max_tokens")
        room = min(room, MAX_GRAMMAR_TOKENS)
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else room
    if room < 1 or max_tokens > room:
        raise ApiError(400, f"the prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed the context "
                       f"of {backend.context - backend.draft_room} tokens", param="max_tokens",
                       code="context_length_exceeded")
    return ServiceRequest(tokens, max_tokens, parsed.sampling, choices=parsed.choices, logprobs=parsed.logprobs,
                          grammar=grammar)


async def submit(service: ServiceLike, request: ServiceRequest, sink) -> int:
    """The request's number in the service, or the API error its refusal is."""
    try:
        return await service.submit(request, sink)
    except QueueFull as error:
        raise ApiError(429, f"the server is busy: {error}", kind="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except Unavailable as error:
        raise ApiError(503, f"the service is degraded: {error}", kind="server_error", code="unavailable",
                       headers={"Retry-After": str(round(RESUME_SECONDS))}) from None
    except ShuttingDown as error:
        raise ApiError(503, str(error), kind="server_error", code="unavailable") from None
    except CoordinatorLost as error:
        raise ApiError(503, f"the service is restarting: {error}", kind="server_error", code="unavailable",
                       headers={"Retry-After": str(round(RESUME_SECONDS))}) from None
    except RequestTooLong as error:
        raise ApiError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
    except ServiceError as error:
        raise ApiError(400, str(error)) from None


def prompt_tokens(backend: Backend, parsed) -> list[int]:
    tokenizer = backend.tokenizer
    if parsed.messages is not None:
        return tokenizer.chat_tokens(parsed.messages)
    if parsed.prompt_tokens is not None:
        if max(parsed.prompt_tokens) >= tokenizer.n_vocab:
            raise ApiError(400, f"prompt: token id {max(parsed.prompt_tokens)} is beyond the vocabulary of "
                           f"{tokenizer.n_vocab}", param="prompt")
        return parsed.prompt_tokens
    return tokenizer.tokenize(parsed.prompt)


async def follow(service: ServiceLike, number: int, progress: asyncio.Queue, assemblers: list[TextAssembler],
                 reply: Reply):
    """Each choice's text as it is committed, as (choice, text, its tokens'
    logprobs entries or None), until every choice has ended; sets reply's
    finish reasons and token count, and keeps the logprobs entries."""
    going = set(range(len(assemblers)))
    while going:
        event: Progress = await progress.get()
        index = event.choice
        if index not in going:  # a choice stopped by its stop string: the rest of it is not wanted
            continue
        assembler = assemblers[index]
        if event.tokens:
            reply.completion_tokens += len(event.tokens)
            entries = None if event.logprobs is None else reply.scored(index, event.tokens, event.logprobs)
            text = assembler.push(event.tokens)
            if assembler.stopped and entries is not None:  # no entries for the tokens past the stop string
                dropped = reply.cut_scores(index, len(reply.texts[index]) + len(text))
                entries = entries[:max(0, len(entries) - dropped)]
            if text or entries:
                yield index, text, entries
            if assembler.stopped:
                service.cancel_choice(number, index)
                reply.finish_reasons[index] = "stop"
                going.discard(index)
                continue
        if event.finished is not None:
            if event.finished == "error":
                raise GenerationFailed(event.error)
            tail = assembler.finish()
            if tail:
                yield index, tail, None
            reply.finish_reasons[index] = FINISH_REASONS[event.finished]
            going.discard(index)


async def stream(texts, reply: Reply, include_usage: bool, service: ServiceLike, number: int):
    """Server-sent events: chunks of each choice's text, each choice's end, usage if asked, [DONE]."""
    try:
        if reply.chat:
            for index in range(reply.choices):
                yield sse(reply.chunk("", index=index, first=True))
        async for index, text, entries in texts:
            yield sse(reply.chunk(text, index=index, entries=entries, offset=len(reply.texts[index])))
            reply.texts[index] += text
        for index, finish_reason in enumerate(reply.finish_reasons):
            yield sse(reply.chunk("", index=index, finish_reason=finish_reason))
        if include_usage:
            yield sse(reply.usage_chunk())
        yield sse("[DONE]")
    except GenerationFailed as error:
        yield sse(ApiError(503, f"the request failed: {error}", kind="server_error", code="generation_failed").body())
    finally:  # also when the client went away mid-stream (the generator is closed)
        service.cancel(number)
