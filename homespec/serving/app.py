"""The HTTP face of the daemon: an OpenAI-compatible API on localhost, plus health, metrics and
the stats and admin endpoints the dashboard uses.

`create_app(daemon)` is a factory; the app holds no globals. Generation runs on the daemon's
worker thread; each request gets a `Job` whose events are handed back into the event loop
(`call_soon_threadsafe`) and relayed as JSON or server-sent events, so the loop never blocks.
A client that goes away cancels its job, which stops at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from homespec.serving import openai_api as oa
from homespec.serving.daemon import Daemon, Job, JobEvent, NotReady, QueueFull
from homespec.errors import UserError
from homespec.speculation.sampling import SamplingParams
from homespec.serving.host import GenerationRequest
from homespec.serving.stats_view import build_stats_view

log = logging.getLogger("homespec.serving.app")

OPEN_PATHS = ("/health", "/ready", "/docs", "/openapi.json")


class ModeBody(BaseModel):
    mode: str


class _Bridge:
    """Worker-thread events -> an asyncio queue in the request's loop."""

    CHECK_S = 0.5  # how often a waiting handler asks whether its client is still there

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._checked = self.loop.time()

    def sink(self, ev: JobEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    async def next(self, request: Request, job: Job) -> JobEvent:
        """The next event, cancelling the job if the client disconnects meanwhile. The check
        runs every CHECK_S whether or not events keep arriving: a fast generation that never
        lets the queue run dry must notice a hang-up too."""
        while True:
            if self.loop.time() - self._checked >= self.CHECK_S:
                self._checked = self.loop.time()
                if await request.is_disconnected():
                    job.cancel()
                    raise asyncio.CancelledError("client disconnected")
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=self.CHECK_S)
            except asyncio.TimeoutError:
                continue


def create_app(daemon: Daemon, api_key: str | None = None, address: str = "") -> FastAPI:
    cfg = daemon.cfg
    app = FastAPI(title="homespec", version=daemon.version(), docs_url="/docs", redoc_url=None)
    app.state.daemon = daemon

    if cfg.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.server.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(_BodyLimit, max_bytes=cfg.server.max_body_bytes)
    if api_key:
        # Pure ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware wraps `receive`
        # so that Request.is_disconnected() never sees the client leave, and a non-streaming
        # request whose client hung up would generate on until its timeout.
        app.add_middleware(_Auth, api_key=api_key)

    @app.exception_handler(oa.ApiError)
    async def api_error(_: Request, e: oa.ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else None
        return _error(oa.ApiError(e.status_code, str(e.detail), code=kind, headers=e.headers))  # e.g. 405's Allow

    @app.exception_handler(Exception)
    async def crash(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(oa.ApiError(500, f"internal error: {type(e).__name__}", type="server_error", code="internal_error"))

    def model_id() -> str:
        if cfg.server.model_alias:
            return cfg.server.model_alias
        ref = cfg.models.target
        return ref.name or (ref.path.stem if ref.path else "homespec")

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_id(), "homespec"):
            raise oa.ApiError(404, f"model {name!r} not found; this server serves {model_id()!r}", param="model", code="model_not_found")

    def to_request(body: oa._Common, limit: int | None) -> GenerationRequest:
        s = cfg.sampling
        pick = lambda v, d: d if v is None else v  # noqa: E731
        try:
            params = SamplingParams(
                temperature=pick(body.temperature, s.temperature),
                top_p=pick(body.top_p, s.top_p),
                top_k=pick(body.top_k, s.top_k),
                min_p=pick(body.min_p, s.min_p),
                repetition_penalty=pick(body.repetition_penalty, s.repetition_penalty),
                presence_penalty=pick(body.presence_penalty, s.presence_penalty),
                frequency_penalty=pick(body.frequency_penalty, s.frequency_penalty),
                # OpenAI's seed is a signed int64; numpy wants a non-negative one: map it 1:1.
                seed=None if body.seed is None else body.seed % 2**64,
            )
        except ValueError as e:
            raise oa.ApiError(400, str(e)) from None
        h = body.homespec or oa.HomespecOptions()
        if h.speculation and h.speculation not in daemon.available_modes():
            raise oa.ApiError(400, f"speculation mode {h.speculation!r} is not available (choose from {', '.join(daemon.available_modes())})", param="homespec.speculation")
        return GenerationRequest(params, limit or s.max_tokens, body.stops(), h.speculation or "auto", h.k)

    async def run(request: Request, body: oa._Common, job: Job, kind: str) -> Any:
        bridge = _Bridge()
        job.sink = bridge.sink
        try:
            daemon.submit(job)
        except QueueFull as e:
            raise oa.ApiError(429, "too many requests waiting; retry later", type="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
        except NotReady as e:
            raise oa.ApiError(503, f"not ready: models are {e.state}", type="server_error", code="not_ready",
                              headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
        first = await bridge.next(request, job)
        if first.kind == "error":
            raise _job_error(first)
        rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
        meta = first.extra
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(_stream(bridge, job, kind, rid, model_id(), meta, include_usage), sep="\n", ping=15)
        text: list[str] = []
        while True:
            ev = await bridge.next(request, job)
            if ev.kind == "delta":
                text.append(ev.text)
            elif ev.kind == "error":
                raise _job_error(ev)
            elif ev.kind == "done":
                extra = _extra(daemon, ev, meta)
                build = oa.chat_body if kind == "chat" else oa.completion_body
                return build(rid, model_id(), "".join(text), ev.finish_reason, ev.stats, extra)

    async def _stream(bridge: _Bridge, job: Job, kind: str, rid: str, model: str, meta: dict, include_usage: bool) -> AsyncIterator[dict]:
        created = None
        chunk = (lambda t, f=None: oa.chat_chunk(rid, model, {"content": t} if t else {}, f, created)) if kind == "chat" else (
            lambda t, f=None: oa.completion_chunk(rid, model, t, f, created))
        try:
            if kind == "chat":
                yield {"data": json.dumps(oa.chat_chunk(rid, model, {"role": "assistant", "content": ""}))}
            while True:
                ev = await bridge.queue.get()
                if ev.kind == "delta" and ev.text:
                    yield {"data": json.dumps(chunk(ev.text))}
                elif ev.kind == "error":
                    yield {"data": json.dumps(_job_error(ev).body())}
                    break
                elif ev.kind == "done":
                    yield {"data": json.dumps(chunk("", oa.openai_finish(ev.finish_reason)))}
                    if include_usage:
                        tail = {**chunk(""), "choices": [], "usage": oa.usage(ev.stats), "homespec": _extra(daemon, ev, meta)}
                        yield {"data": json.dumps(tail)}
                    break
            yield {"data": "[DONE]"}
        finally:
            job.cancel()  # a no-op when finished; stops the generation when the client left

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "state": daemon.state}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": daemon.ready, "state": daemon.state}, status_code=200 if daemon.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id(), "object": "model", "created": int(daemon.started), "owned_by": "homespec"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: oa.ChatRequest) -> Any:
        check_model(body.model)
        job = Job(to_request(body, body.limit()), sink=lambda ev: None, messages=body.chat_messages(),
                  timeout_s=cfg.server.request_timeout_s)
        return await run(request, body, job, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request, body: oa.CompletionRequest) -> Any:
        check_model(body.model)
        job = Job(to_request(body, body.limit()), sink=lambda ev: None, prompt=body.text(),
                  timeout_s=cfg.server.request_timeout_s)
        return await run(request, body, job, "completion")

    @app.get("/v1/homespec/stats")
    async def stats() -> dict:
        return build_stats_view(daemon, address).model_dump(mode="json")

    @app.post("/v1/homespec/mode")
    async def set_mode(body: ModeBody) -> dict:
        try:
            daemon.set_mode(body.mode)
        except UserError as e:
            raise oa.ApiError(400, str(e), param="mode") from None
        return {"mode": daemon.mode}

    @app.post("/v1/homespec/reset")
    async def reset() -> dict:
        daemon.live.reset()
        return {"reset": True}

    return app


def _extra(daemon: Daemon, ev: JobEvent, meta: dict) -> dict:
    baseline = daemon.session.controller.view.baseline_tps if daemon.session else None
    return oa.homespec_stats(ev.stats, meta.get("mode", "auto"), bool(meta.get("cold")), baseline)


def _job_error(ev: JobEvent) -> oa.ApiError:
    return oa.ApiError(ev.status, ev.text, type="server_error" if ev.status >= 500 else "invalid_request_error", code=ev.code)


def _error(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_error(e: RequestValidationError) -> oa.ApiError:
    errs = e.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return oa.ApiError(400, "request body is not valid JSON", code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = f"missing required field {param!r}"
    elif param:
        msg = f"{param}: {msg}"
    return oa.ApiError(400, msg, param=param)


class _Auth:
    """401 for requests without the right bearer key, except the open paths (pure ASGI)."""

    def __init__(self, app, api_key: str) -> None:  # noqa: ANN001 - ASGI app
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS) or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            msg = "missing API key (send 'Authorization: Bearer <key>')" if not token else "invalid API key"
            return await _error(oa.ApiError(401, msg, code="invalid_api_key"))(scope, receive, send)
        return await self.app(scope, receive, send)


class _BodyLimit:
    """413 for bodies over max_bytes, by Content-Length or while streaming in (pure ASGI)."""

    def __init__(self, app, max_bytes: int) -> None:  # noqa: ANN001 - ASGI app
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = oa.ApiError(413, f"request body larger than {self.max_bytes} bytes", code="body_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _error(too_big)(scope, receive, send)
        seen = 0
        cut = started = False

        async def limited():  # noqa: ANN202
            nonlocal seen, cut
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    cut = True
                    raise _TooBig()
            return message

        async def guarded(message) -> None:  # noqa: ANN001
            # FastAPI turns any error while reading the body into its own 400 ("error parsing
            # the body"): once the body was cut, drop whatever the app answers and send the 413.
            nonlocal started
            if cut:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except _TooBig:
            pass
        if cut and not started:
            await _error(too_big)(scope, receive, send)


class _TooBig(Exception):
    pass
