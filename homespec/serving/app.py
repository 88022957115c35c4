"""The HTTP face of the daemon: an OpenAI-compatible API on localhost, plus health, metrics and
the stats and admin endpoints the dashboard uses.

`create_app(daemon)` is a factory; the app holds no globals. It keeps the daemon and the
advertised address on `app.state`, adds the middleware, maps every error to an OpenAI-style JSON
body, and includes the routers of `homespec.serving.routes` (health, openai, admin), whose
handlers read what they need from `request.app.state`.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from homespec.serving import openai_api as oa
from homespec.serving.daemon import Daemon
from homespec.serving.routes import admin, health, openai
from homespec.serving.routes.common import error_response, validation_error

log = logging.getLogger("homespec.serving.app")

OPEN_PATHS = ("/health", "/ready", "/docs", "/openapi.json")


def create_app(daemon: Daemon, api_key: str | None = None, address: str = "") -> FastAPI:
    cfg = daemon.cfg
    app = FastAPI(title="homespec", version=daemon.version(), docs_url="/docs", redoc_url=None)
    app.state.daemon = daemon
    app.state.address = address  # as advertised in /v1/homespec/stats

    if cfg.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.server.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(_BodyLimit, max_bytes=cfg.server.max_body_bytes)
    if api_key:
        # Pure ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware wraps `receive`
        # so that Request.is_disconnected() never sees the client leave, and a non-streaming
        # request whose client hung up would generate on until its timeout.
        app.add_middleware(_Auth, api_key=api_key)

    app.add_exception_handler(oa.ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)

    # In this order, the paths appear in /openapi.json as they always have.
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(admin.router)
    return app


async def _api_error(_: Request, e: oa.ApiError) -> JSONResponse:
    return error_response(e)


async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(e))


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if e.status_code == 404 else None
    return error_response(oa.ApiError(e.status_code, str(e.detail), code=kind, headers=e.headers))  # e.g. 405's Allow


async def _crash(_: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(oa.ApiError(500, f"internal error: {type(e).__name__}", type="server_error", code="internal_error"))


class _Auth:
    """401 for requests without the right bearer key, except the open paths (pure ASGI)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS) or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            msg = "missing API key (send 'Authorization: Bearer <key>')" if not token else "invalid API key"
            return await error_response(oa.ApiError(401, msg, code="invalid_api_key"))(scope, receive, send)
        return await self.app(scope, receive, send)


class _BodyLimit:
    """413 for bodies over max_bytes, by Content-Length or while streaming in (pure ASGI)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = oa.ApiError(413, f"request body larger than {self.max_bytes} bytes", code="body_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_big)(scope, receive, send)
        seen = 0
        cut = started = False

        async def limited():
            nonlocal seen, cut
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    cut = True
                    raise _TooBig()
            return message

        async def guarded(message) -> None:
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
            await error_response(too_big)(scope, receive, send)


class _TooBig(Exception):
    pass
