"""The HTTP face of the daemon: an OpenAI-compatible API on localhost, plus health, metrics and
the stats and admin endpoints the dashboard uses, and Ollama's API beside it.

`create_app(daemon)` is a factory; the app holds no globals. It keeps the daemon and the
advertised address on `app.state`, adds the middleware, maps every error to an OpenAI-style JSON
body (Ollama's `{"error": ...}` under /api/), and includes the routers of
`homespec.serving.routes` (health, openai, admin, infill, ollama), whose handlers read what they
need from `request.app.state`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from homespec.serving import openai_api as oa
from homespec.serving.daemon import Daemon
from homespec.serving.middleware import ApiKeyAuth, BodyLimit, JsonOnly, SameOrigin, TrustedHost, trusted_hosts
from homespec.serving.routes import admin, health, infill, ollama, openai, tokens
from homespec.serving.routes.common import error_response, validation_error

log = logging.getLogger("homespec.serving.app")

def create_app(daemon: Daemon, api_key: str | None = None, address: str = "") -> FastAPI:
    cfg = daemon.cfg
    app = FastAPI(title="homespec", version=daemon.version(), docs_url="/docs", redoc_url=None)
    app.state.daemon = daemon
    app.state.address = address  # as advertised in /v1/homespec/stats

    app.state.drain_deadline = None  # monotonic time at which open answers are cut (set on SIGTERM)

    # The last one added runs first: host, auth, origin, content type, body size, CORS.
    if cfg.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.server.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(BodyLimit, max_bytes=cfg.server.max_body_bytes)
    app.add_middleware(JsonOnly)
    if not api_key:
        # With a key, a cross-site page cannot forge the request anyway (it lacks the key).
        app.add_middleware(SameOrigin, cors_origins=cfg.server.cors_origins)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)  # pure ASGI (see middleware.py for why)
    app.add_middleware(TrustedHost, allowed_hosts=trusted_hosts(cfg.server))

    app.add_exception_handler(oa.ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)

    # In this order, the paths appear in /openapi.json as they always have.
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(infill.router)  # llama.cpp's /infill, for editor plugins
    app.include_router(tokens.router)  # llama.cpp's /tokenize and /detokenize
    app.include_router(ollama.router)  # Ollama's /api/*, for apps that speak only Ollama
    return app


async def _api_error(request: Request, e: oa.ApiError) -> Response:
    return error_response(e, request.url.path)


async def _invalid(request: Request, e: RequestValidationError) -> Response:
    return error_response(validation_error(e), request.url.path)


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    kind = "not_found" if e.status_code == 404 else None
    message = str(e.detail)
    if e.status_code == 404 and message == "Not Found":  # no such route (not a handler's own 404)
        message = f"no endpoint {request.method} {request.url.path}: GET /docs lists this server's API"
    # e.g. 405's Allow
    return error_response(oa.ApiError(e.status_code, message, code=kind, headers=e.headers), request.url.path)


async def _crash(request: Request, e: Exception) -> Response:
    log.exception("unhandled error")
    err = oa.ApiError(500, f"internal error: {type(e).__name__}", type="server_error", code="internal_error")
    return error_response(err, request.url.path)
