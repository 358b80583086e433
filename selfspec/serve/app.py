"""The FastAPI app: OpenAI routes in front of a runner (an EngineRunner, or engine replicas: serve/replicas.py).

Error statuses (OpenAI's body `{"error": {"message", "type", "param", "code"}}` on every one):
400 invalid_request_error  malformed JSON, wrong types, unknown or unsupported parameters, n > 1, bad sampling
                           values, empty prompt, max_tokens < 1, prompt + max_tokens beyond the context
                           (code `context_length_exceeded`)
404 invalid_request_error  unknown model (code `model_not_found`) or route
413 invalid_request_error  a body over --max-request-bytes (code `request_too_large`)
429 rate_limit_error       the engine's waiting queue is full (code `queue_full`, header Retry-After)
503 server_error           the server is shutting down (code `shutting_down`): a request that arrives during the
                           drain, or one still running when the drain's time is up (a stream then ends with an
                           error event and [DONE])
500 server_error           a failure inside the request (the server and other requests go on)
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from selfspec.config import ModelConfig
from selfspec.engine.engine import Engine, QueueFull, RequestOutput
from selfspec.engine.llm import LLM, encode_prompt
from selfspec.errors import SelfspecError
from selfspec.serve.metrics import ServerMetrics
from selfspec.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from selfspec.serve.runner import SHUTDOWN, EngineRunner, Runner, ServerShuttingDown

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client has gone away
RETRY_AFTER_S = 1
SHUTDOWN_MESSAGE = "the server shut down before this request finished; retry on another instance"
CANCELLED_SEND_S = 1.0  # how long a cancelled request's last words may wait on a client that stopped reading
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI's chat default is the rest of the context; the engine reserves each request's worst case in KV blocks,
# so that default would let only a few chats run at once. Capped here (a client may ask for more).
CHAT_DEFAULT_MAX_TOKENS = 1024
# A whole 8k-token context is ~40 KB of text or ~50 KB of token ids; 1 MiB holds a 128k-token context of text and
# bounds what one body costs to hold and parse on the event loop (a few ms).
DEFAULT_MAX_REQUEST_BYTES = 1 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body = status, ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


@dataclass
class PromptSide:
    """What the routes need of the model: its tokenizer and config (a replicated server's front holds these alone;
    the weights stay in the engine replicas)."""
    tokenizer: Any
    cfg: ModelConfig

    @classmethod
    def of(cls, llm: LLM) -> PromptSide:
        return cls(llm.tokenizer, llm.model.cfg)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.cfg.max_seq_len, prompt)


def create_app(engine: Engine, model_name: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """An app serving `engine` under the model id `model_name`; the lifespan starts and stops the engine thread.
    Bodies over `max_request_bytes` get 413."""
    metrics = ServerMetrics(lambda: runner.latest_stats)  # read at scrape time, once the runner exists
    runner = EngineRunner(engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        await asyncio.to_thread(runner.shutdown)

    return openai_app(runner, PromptSide.of(engine.llm), model_name, metrics, lifespan, max_request_bytes)


def openai_app(runner: Runner, prompts: PromptSide, model_name: str, metrics: ServerMetrics,
               lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI routes in front of `runner` (one engine in this process, or engine replicas elsewhere)."""
    app = FastAPI(title="selfspec", lifespan=lifespan)
    app.state.runner = runner  # the server drains it on SIGINT / SIGTERM
    add_error_handlers(app, metrics)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes,
                       on_reject=lambda: metrics.rejected.labels("413").inc())
    app.add_middleware(AnswerCancelled)  # outermost of ours: it sees every cancelled request

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        status = "engine thread stopped" if not runner.alive else "shutting down" if not runner.accepting else "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=prompts.cfg.max_seq_len)])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def answer(req: CompletionRequest | ChatCompletionRequest, raw: Request, prompt_ids: list[int],
                     request_id: str, default_max_tokens: int, events: Callable[..., AsyncIterator[str]],
                     choice: Callable[[str, str | None], BaseModel], response: type[BaseModel]) -> Response:
        """Both routes' answer: the request submitted, then a stream of `events`, or the whole text as one
        `choice` (text, finish reason) of a `response`."""
        outputs = await submit(runner, prompts, request_id, prompt_ids, req, default_max_tokens)
        if req.stream:
            return event_stream(runner, request_id, events(req, model_name, request_id, len(prompt_ids),
                                                           watch(outputs, raw)))
        text, final, n_tokens = await collect(runner, request_id, watch(outputs, raw))
        return JSONResponse(response(id=request_id, model=model_name, choices=[choice(text, final.finish_reason)],
                                     usage=usage(final, len(prompt_ids), n_tokens)).model_dump())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        # tokenizers run in a worker thread: a long prompt must not hold up every other client on the event loop
        prompt_ids = check_token_ids(prompts, await asyncio.to_thread(prompts.encode, req.prompt))
        return await answer(req, raw, prompt_ids, f"cmpl-{uuid.uuid4().hex}", COMPLETION_DEFAULT_MAX_TOKENS,
                            completion_events, lambda text, why: CompletionChoice(text=text, finish_reason=why),
                            CompletionResponse)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, prompts, req)
        return await answer(req, raw, prompt_ids, f"chatcmpl-{uuid.uuid4().hex}", CHAT_DEFAULT_MAX_TOKENS,
                            chat_events,
                            lambda text, why: ChatChoice(message=AssistantMessage(content=text), finish_reason=why),
                            ChatCompletionResponse)

    return app


class BodySizeLimit:
    """Reads each request body before the app does and answers 413 once it passes `max_bytes`: at once when
    Content-Length says so, else as soon as the streamed (chunked) body does. The app then reads the held body."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None]):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.max_bytes:  # the server already refused non-numbers
            return await self.reject(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self.reject(send)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()  # after the body: disconnect notices
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def reject(self, send: Send) -> None:
        self.on_reject()
        error = ErrorResponse(error=ErrorInfo(
            message=f"the request body is over this server's limit of {self.max_bytes} bytes (--max-request-bytes);"
                    " send a shorter prompt", type="invalid_request_error", code="request_too_large"))
        response = JSONResponse(error.model_dump(), status_code=413, headers={"Connection": "close"})
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


class AnswerCancelled:
    """Ends a request the server cancels (uvicorn does when its graceful-shutdown time is up) with a clean answer
    instead of uvicorn's plain-text 500 and logged traceback: a JSON 503 if nothing was sent yet, an error event
    and [DONE] if an event stream was under way. Only the server cancels a request's task, and only to stop it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = {"started": False, "stream": False, "done": False}

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                sent["started"] = True
                sent["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            if sent["done"] or (sent["started"] and not sent["stream"]):
                return
            try:
                async with asyncio.timeout(CANCELLED_SEND_S):
                    await self.last_words(send, sent["started"])
            except (TimeoutError, OSError):
                pass  # the client is not reading: uvicorn closes the connection

    @staticmethod
    async def last_words(send: Send, stream_started: bool) -> None:
        if stream_started:
            body = (sse(shutdown_error()) + sse("[DONE]")).encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        response = JSONResponse(shutdown_error().model_dump(), status_code=503)
        await send({"type": "http.response.start", "status": 503, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def check_token_ids(prompts: PromptSide, ids: list[int]) -> list[int]:
    vocab = prompts.cfg.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
    return ids


def chat_prompt_ids(prompts: PromptSide, req: ChatCompletionRequest) -> list[int]:
    """The chat template applied to the whole conversation, ending with the assistant's turn."""
    if prompts.tokenizer is None:
        raise SelfspecError("this model has no tokenizer files, so it cannot serve chat completions")
    try:
        text = prompts.tokenizer.apply_chat_template([m.for_template() for m in req.messages],
                                                 add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as e:
        raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from e
    # add_special_tokens=False: the template already wrote them (apply_chat_template(tokenize=True) does the same)
    return prompts.encode(prompts.tokenizer.encode(text, add_special_tokens=False))


def resolve_max_tokens(requested: int | None, default: int, prompt_len: int, context: int) -> int:
    room = context - prompt_len
    if requested is None:
        return min(default, room)
    if requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                       "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    return requested


async def submit(runner: Runner, prompts: PromptSide, request_id: str, prompt_ids: list[int],
                 req: CompletionRequest | ChatCompletionRequest,
                 default_max_tokens: int) -> asyncio.Queue[RequestOutput]:
    max_tokens = resolve_max_tokens(req.requested_max_tokens, default_max_tokens, len(prompt_ids),
                                    prompts.cfg.max_seq_len)
    return await runner.add_request(request_id, prompt_ids, req.sampling_params(max_tokens), req.gamma)


async def watch(outputs: asyncio.Queue[RequestOutput], raw: Request) -> AsyncIterator[RequestOutput]:
    """The request's outputs up to the finished one; stops early if the client disconnects. The client is checked
    every DISCONNECT_POLL_S whether or not outputs arrive (tokens faster than that must not hide a departure)."""
    checked = time.monotonic()
    while True:
        try:
            out = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            out = None
        if out is None or time.monotonic() - checked >= DISCONNECT_POLL_S:
            checked = time.monotonic()
            if await raw.is_disconnected():
                return
        if out is None:
            continue
        yield out
        if out.finished:
            return


async def collect(runner: Runner, request_id: str,
                  outputs: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput, int]:
    """(text, finished output, token count) of a non-streamed request; 500 if it failed."""
    parts, final, n_tokens = [], None, 0
    try:
        async for final in outputs:
            parts.append(final.new_text)
            n_tokens += len(final.new_token_ids)
    finally:
        runner.abort(request_id)  # no-op once finished; frees the sequence if the client left or we were cancelled
    if final is None or not final.finished:
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    if final.finish_reason == SHUTDOWN:
        raise APIError(503, final.error or SHUTDOWN_MESSAGE, type="server_error", code="shutting_down")
    if final.finish_reason == "error":
        raise APIError(500, final.error or "the request failed inside the engine", type="server_error",
                       code="internal_error")
    return "".join(parts), final, n_tokens


def usage(final: RequestOutput, prompt_tokens: int, completion_tokens: int) -> Usage:
    s = final.generation.stats
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, draft_tokens=s.draft_proposed,
                 accepted_tokens=s.draft_accepted, mean_acceptance_length=s.mean_acceptance_length)


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def error_event(out: RequestOutput) -> str:
    if out.finish_reason == SHUTDOWN:
        return sse(shutdown_error())
    return sse(ErrorResponse(error=ErrorInfo(message=out.error or "the request failed inside the engine",
                                             type="server_error", code="internal_error")))


def shutdown_error() -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=SHUTDOWN_MESSAGE, type="server_error", code="shutting_down"))


def event_stream(runner: Runner, request_id: str, events: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            runner.abort(request_id)  # no-op once finished; cancels the sequence of a client that went away
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def completion_events(req: CompletionRequest, model: str, request_id: str, prompt_tokens: int,
                            outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    n_tokens = 0
    async for out in outputs:
        if out.finish_reason in ("error", SHUTDOWN):
            yield error_event(out)
            break
        n_tokens += len(out.new_token_ids)
        if out.new_text or out.finished:
            choice = CompletionChoice(text=out.new_text, finish_reason=out.finish_reason if out.finished else None)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
        if out.finished and req.include_usage:
            yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                         usage=usage(out, prompt_tokens, n_tokens)))
    yield sse("[DONE]")


async def chat_events(req: ChatCompletionRequest, model: str, request_id: str, prompt_tokens: int,
                      outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    def chunk(delta: ChatDelta, finish_reason: str | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model,
                                       choices=[ChatStreamChoice(delta=delta, finish_reason=finish_reason)]))

    yield chunk(ChatDelta(role="assistant", content=""))
    n_tokens = 0
    async for out in outputs:
        if out.finish_reason in ("error", SHUTDOWN):
            yield error_event(out)
            break
        n_tokens += len(out.new_token_ids)
        if out.new_text:
            yield chunk(ChatDelta(content=out.new_text))
        if out.finished:
            yield chunk(ChatDelta(), out.finish_reason)
            if req.include_usage:
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                              usage=usage(out, prompt_tokens, n_tokens)))
    yield sse("[DONE]")


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves as an OpenAI error body; each is counted by status."""
    def reply(status: int, info: ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.rejected.labels(str(status)).inc()
        return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return reply(e.status, e.body, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            return reply(400, ErrorInfo(message=f"the body is not valid JSON: {msg}", type="invalid_request_error"))
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]  # e.g. messages, 0, role (or a union member)
        text = f"{'.'.join(loc)}: {msg}" if loc else msg
        return reply(400, ErrorInfo(message=text, type="invalid_request_error", param=loc[0] if loc else None))

    @app.exception_handler(SelfspecError)
    async def selfspec_error(_: Request, e: SelfspecError) -> JSONResponse:
        return reply(400, ErrorInfo(message=str(e), type="invalid_request_error"))

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return reply(429, ErrorInfo(message=str(e) or "the server's request queue is full; retry later",
                                    type="rate_limit_error", code="queue_full"),
                     {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(ServerShuttingDown)
    async def shutting_down(_: Request, e: ServerShuttingDown) -> JSONResponse:
        return reply(503, ErrorInfo(message=str(e), type="server_error", code="shutting_down"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return reply(e.status_code, ErrorInfo(message=str(e.detail), type="invalid_request_error"), e.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return reply(500, ErrorInfo(message=f"internal error: {type(e).__name__}: {e}", type="server_error",
                                    code="internal_error"))
