"""The HTTP transport: a FastAPI app answering OpenAI's endpoints with a :class:`CompletionService`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus).
Request bodies are pydantic models (types); the service checks values. Every error, a type error
included, is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.
A client that goes away cancels its request (streaming or not), so its engine slot is freed; past
``max_concurrent_requests`` a request gets a 429 with ``Retry-After``; a stalled body a 408; while the server
stops (the service is draining) a completion request gets a 503 with ``Retry-After``. With ``api_key`` set, every
route but ``/health`` needs ``Authorization: Bearer KEY`` (else a 401; two Authorization headers: a 400); a completion
body sent as another Content-Type than JSON gets a 400 naming it. Parsing and tokenizing run on a worker
thread, so one long prompt never stalls other connections; error messages name a field and the type it
got, never its text (they are logged).
Needs the ``serve`` extra (``pip install 'adaflash-hf[serve]'``); :mod:`.server` runs it on uvicorn.

Example::

    app = build_app(lambda: service, ServeSettings())
    # uvicorn.run(app, port=8000)   -- or make_server(engine, tok).serve_forever()
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from .metrics import CONTENT_TYPE
from .service import APIError, CompletionService, describe
from .settings import ServeSettings

__all__ = ["ChatCompletionRequest", "CompletionRequest", "build_app"]

log = logging.getLogger("adaflash_hf.server")

_COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_ERROR_HEADERS = {429: {"Retry-After": "1"}, 503: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}
_DONE = b"data: [DONE]\n\n"


class _Request(BaseModel):
    """Fields both endpoints take; each ``description`` ends the message a wrong type gets."""

    model_config = ConfigDict(extra="allow", strict=True)  # extra: unsupported fields are checked by value
    model: str | None = Field(None, description="must be a string")
    max_tokens: int | None = Field(None, description="must be a positive integer")
    temperature: float | None = Field(None, description="must be a number >= 0")
    top_p: float | None = Field(None, description="must be a number in (0, 1]")
    top_k: int | None = Field(None, description="must be an integer >= 1 (0 or -1: off)")
    seed: int | None = Field(None, description="must be an integer")
    n: int | None = Field(None, description="must be an integer from 1 to 16")
    stop: str | list[str] | None = Field(None, description="must be a non-empty string or a list of non-empty strings")
    stream: bool | None = Field(None, description="must be true or false")
    stream_options: dict[str, Any] | None = Field(None, description="must be an object")


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt, as text or token ids, or a list of prompts (each its own choices)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="must be a string, a list of token ids, or a list of either (one prompt each)")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: the conversation goes through the tokenizer's chat template."""

    messages: list[dict[str, Any]] = Field(description='must be a non-empty list of {"role", "content"} objects')
    max_completion_tokens: int | None = Field(None, description="must be a positive integer")


_FIELDS = {**CompletionRequest.model_fields, **ChatCompletionRequest.model_fields}


def _validation_error(exc: RequestValidationError) -> APIError:
    """A pydantic / JSON error as the 400 today's clients expect (the first problem, naming the field)."""
    err = exc.errors()[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
    if not loc or not isinstance(loc[0], str):
        return APIError(400, "the request body must be a JSON object")
    field = loc[0]
    if err.get("type") == "missing":
        return APIError(400, f"missing required field `{field}`", field)
    body = exc.body if isinstance(exc.body, dict) else {}
    what = _FIELDS[field].description if field in _FIELDS else "has the wrong type"
    return APIError(400, f"`{field}` {what}, got {describe(body.get(field))}", field)  # the type, never the text


def _json(e: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def build_app(get_service: Callable[[], CompletionService | None], settings: ServeSettings) -> FastAPI:
    """The FastAPI app; ``get_service()`` is None while the model loads (requests then get a 503)."""
    app = FastAPI(title="adaflash-hf", docs_url=None, redoc_url=None)

    def service() -> CompletionService:
        svc = get_service()
        if svc is None:
            raise APIError(503, "the model is still loading")
        return svc

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        request.scope["adaflash.stats"]["error"] = e.message
        return _json(e, _ERROR_HEADERS.get(e.status))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        method, path = request.method, request.url.path
        if exc.status_code == 405:
            allowed = [m for m in (exc.headers or {}).get("Allow", "").split(", ") if m and m != "HEAD"]
            return await api_error(request, APIError(405, f"{path} takes {' or '.join(allowed)}, not {method}"))
        if exc.status_code == 404:
            return await api_error(request, APIError(404, f"no such endpoint: {method} {path}", type_="not_found_error"))
        return await api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(_ClientGone)
    async def gone(request: Request, exc: _ClientGone):
        request.scope["adaflash.stats"]["error"] = "client disconnected"
        return Response(status_code=499)  # nobody reads it: the status is for the log line

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):  # Starlette re-raises it after: _FrontDoor logs the traceback
        return await api_error(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        status, body = service().health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():  # Prometheus text format (names: serve/metrics.py)
        return Response(service().metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return service().models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(service(), request, body, "completion", settings)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _complete(service(), request, body, "chat", settings)

    return _FrontDoor(app, settings, get_service)


async def _until_answered(aw, request: Request, poll_s: float):
    """Await ``aw`` while checking every ``poll_s`` that the client is still connected (else :class:`_ClientGone`)."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()
            # a cancelled gather() finishes with a CancelledError that nobody awaits: read it, so that asyncio does
            # not log it with a traceback for every client that leaves
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _complete(svc: CompletionService, request: Request, body: _Request, kind: str, settings: ServeSettings):
    stats = request.scope["adaflash.stats"]
    # off the event loop: tokenizing (and the chat template) of a long prompt would stall every connection
    req = await asyncio.to_thread(svc.parse, body.model_dump(exclude_unset=True), kind)
    await asyncio.to_thread(svc.score_prompts, req)  # `echo`: the prompts' text and logprobs
    stats.update(prompt_tokens=sum(map(len, req.prompts)), stream=req.stream)
    gens = svc.start(req)  # one engine request per choice (`n`)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    streaming = False
    try:
        # a 400 here if it can never fit
        await _until_answered(asyncio.gather(*(g.admitted() for g in gens)), request, settings.disconnect_poll_s)
        if req.stream:
            streaming = True  # from here the stream owns the requests (and cancels them when the client goes)
            return StreamingResponse(_events(svc, req, gens, rid, stats),  # no "; charset": as OpenAI sends it
                                     headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        answers = await _until_answered(asyncio.gather(*(g.text() for g in gens)), request, settings.disconnect_poll_s)
        _finished(stats, gens)
        return JSONResponse(svc.shapes.response(req, gens, answers, rid))
    finally:
        if not streaming:  # an error or a client that left: free the engine slots
            _cancel(gens)


def _cancel(gens) -> None:
    for gen in gens:
        if not gen.future.done():
            gen.cancel()


def _finished(stats: dict, gens) -> None:
    """The log line's completion tokens (all choices) and finish reasons (comma-separated, one per choice)."""
    stats.update(completion_tokens=sum(g.completion_tokens for g in gens),
                 finish_reason=",".join(str(g.finish_reason) for g in gens))


async def _merged(gens):
    """``(choice index, (text piece, logprob entries))`` from every choice's deltas as they come, ``(index, None)`` when
    that choice has finished; a choice's error is raised here. The pumps are cancelled when the consumer stops early."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for piece in gen.deltas():
                queue.put_nowait((i, piece, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # an APIError mid-stream: reported by the consumer
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            left -= piece is None
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _events(svc: CompletionService, req, gens, rid: str, stats: dict):
    """The SSE stream: OpenAI's chunks, each choice's as they come (its ``index``), ``[DONE]``; an error mid-stream
    is reported in-band."""
    shapes = svc.shapes
    try:
        if req.kind == "chat":
            for i in range(len(gens)):
                yield _sse(shapes.chunk(req, rid, role=True, index=i))
        tools = shapes.tool_streams(req, gens)
        async for i, piece in _merged(gens):
            chunks = (shapes.piece_chunks(req, rid, i, piece, tools[i]) if piece is not None
                      else shapes.finish_chunks(req, rid, i, gens[i], tools[i]))
            for chunk in chunks:
                yield _sse(chunk)
        _finished(stats, gens)
        if req.include_usage:
            yield _sse(shapes.chunk(req, rid, usage=shapes.usage(req, gens)))
        yield _DONE
    except APIError as e:
        stats["error"] = e.message
        yield _sse(e.body())
        yield _DONE
    except (asyncio.CancelledError, GeneratorExit):  # the client went away (Starlette cancels the stream)
        stats["error"] = "client disconnected"
        raise
    finally:
        _cancel(gens)


class _FrontDoor:
    """ASGI middleware in front of the app: the API key (401) and Content-Type (400) checks, the request body
    read whole under a size limit (413) and a per-read timeout (408), the concurrency limit (429), and one
    log line per request."""

    def __init__(self, app, settings: ServeSettings, get_service: Callable[[], CompletionService | None] = lambda: None):
        self.app, self.settings, self.get_service = app, settings, get_service
        self.in_flight = 0  # completion requests inside the app (one event loop: no lock needed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]
        stats = scope["adaflash.stats"] = {}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        limited = scope["path"] in _COMPLETION_PATHS
        try:
            self._check_headers(scope, limited)
            body = await self._read_body(scope, receive)
            svc = self.get_service()
            if limited and svc is not None and svc.draining:
                raise APIError(503, "the server is shutting down; send the request to another instance or retry "
                               "shortly", code="server_shutting_down")
            # counted once the body is in: a client slow to send it holds no place of a request that could run
            if limited and self.in_flight >= self.settings.max_concurrent_requests:
                n = self.settings.max_concurrent_requests
                raise APIError(429, f"the server is at its limit of {n} concurrent requests; retry shortly",
                               type_="rate_limit_error", code="rate_limit_exceeded")
            self.in_flight += limited
            try:
                replay = [{"type": "http.request", "body": body, "more_body": False}]

                async def receive_after_body():
                    return replay.pop() if replay else await receive()

                await self.app(scope, receive_after_body, send_status)
            finally:
                self.in_flight -= limited
        except APIError as e:
            stats["error"] = e.message
            if not isinstance(e, _ClientGoneEarly):
                await _json(e, _ERROR_HEADERS.get(e.status))(scope, receive, send_status)
        except Exception as e:  # noqa: BLE001 - a bug: answer 500 (if nothing was sent yet), keep serving
            log.exception("internal error on %s %s", scope["method"], scope["path"])
            stats.setdefault("error", f"{type(e).__name__}")
            if not status[0]:
                await _json(APIError(500, f"internal error: {type(e).__name__}: {e}"))(scope, receive, send_status)
        finally:
            svc = self.get_service()
            if svc is not None:
                svc.metrics.reject(status[0])
            _log_line(scope, status[0], stats, t0)

    def _check_headers(self, scope, limited: bool) -> None:
        """The API key (every route but /health) and a completion body's Content-Type, before the body is read."""
        headers = dict(scope["headers"])
        key = self.settings.api_key
        if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:  # which one would count is a guess
            raise APIError(400, "more than one Authorization header: send exactly one", code="invalid_api_key")
        if key is not None and scope["path"] != "/health":
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":
                raise APIError(401, "missing API key: send the header `Authorization: Bearer YOUR_KEY`",
                               code="invalid_api_key")
            if not hmac.compare_digest(given.strip(), key.encode()):  # constant time: no timing hints at the key
                raise APIError(401, "incorrect API key", code="invalid_api_key")
        if limited and scope["method"] == "POST":  # as FastAPI and vLLM: no Content-Type is not JSON either
            media = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                raise APIError(400, f"Content-Type must be application/json, got {media[:60] or 'none'}")

    async def _read_body(self, scope, receive) -> bytes:
        limit = self.settings.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body too large ({int(length)} bytes > {limit})")
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.settings.body_timeout_s)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.settings.body_timeout_s:g} s") from None
            if message["type"] == "http.disconnect":
                raise _ClientGoneEarly()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise APIError(413, f"request body too large (over {limit} bytes)")
            more = message.get("more_body", False)
        return b"".join(chunks)


class _ClientGoneEarly(APIError):
    """The client left while sending its body: nothing to answer (the answer goes nowhere)."""

    def __init__(self):
        super().__init__(499, "client disconnected")


def _log_line(scope, status: int, stats: dict, t0: float) -> None:
    extra = "".join(f" {k}={stats[k]}" for k in ("prompt_tokens", "completion_tokens", "finish_reason", "stream") if k in stats)
    if "error" in stats:
        extra += f" error={json.dumps(stats['error'])[:200]}"
    client = (scope.get("client") or ("-",))[0]
    log.info("%s %s %s %d%s %.1fms", client, scope["method"], scope["path"], status, extra,
             1000 * (time.perf_counter() - t0))
