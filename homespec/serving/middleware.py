"""The daemon's ASGI middleware, pure ASGI throughout: Starlette's BaseHTTPMiddleware wraps
`receive` so that Request.is_disconnected() never sees the client leave, and a non-streaming
request whose client hung up would generate on until its timeout.

Host names (DNS rebinding), same-origin state changes, JSON-only bodies, the API key and the body
size limit; every refusal is an OpenAI-style JSON error.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from typing import Any

from starlette._utils import parse_host_header
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from homespec.config import ServerConfig
from homespec.serving import openai_api as oa
from homespec.serving.routes.common import error_response

# Open without the API key: a service manager or load balancer probes them without one.
OPEN_PATHS = ("/health", "/ready", "/docs", "/openapi.json")


class ApiKeyAuth:
    """401 for requests without the right bearer key, except the open paths (pure ASGI)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # "/" answers "Ollama is running" (the ollama CLI's heartbeat) and nothing else.
        if scope["type"] != "http" or scope["path"] == "/" or scope["path"].startswith(OPEN_PATHS) or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        # Bytes against bytes: the key is ASCII (config.py checks), so no decoding can differ.
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(token, self.api_key.encode()):
            msg = "missing API key (send 'Authorization: Bearer <key>')" if not token else "invalid API key"
            return await error_response(oa.ApiError(401, msg, code="invalid_api_key"), scope.get("path", ""))(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
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
            return await error_response(too_big, scope.get("path", ""))(scope, receive, send)
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
            await error_response(too_big, scope.get("path", ""))(scope, receive, send)


class _TooBig(Exception):
    pass


# -- Host, Origin and Content-Type checks (DNS rebinding and cross-site requests) -------------------

LOOPBACK_NAMES = ("localhost", "*.localhost")


def trusted_hosts(server: ServerConfig) -> list[str]:
    """Host names accepted besides IP literals: loopback, this machine, server.host and the
    configured server.allowed_hosts (patterns as Starlette's TrustedHostMiddleware takes them)."""
    name = socket.gethostname().lower()
    return [*LOOPBACK_NAMES, name, f"{name}.local", server.host.lower(), *(h.lower() for h in server.allowed_hosts)]


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class TrustedHost:
    """400 for a Host that names none of the trusted hosts (pure ASGI). Names are matched by
    Starlette's TrustedHostMiddleware; IP literals always pass, since a DNS-rebinding page can
    only bring its own *name* in Host. The error is OpenAI-style, not Starlette's plain text."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        parsed = parse_host_header(raw)
        if parsed is not None and _ip_literal(parsed.host):
            return await self.app(scope, receive, send)
        trusted = False

        async def passed(*_: Any) -> None:
            nonlocal trusted
            trusted = True

        async def dropped(_: Message) -> None:
            pass

        await TrustedHostMiddleware(passed, allowed_hosts=self.allowed_hosts, www_redirect=False)(scope, receive, dropped)
        if trusted:
            return await self.app(scope, receive, send)
        msg = f"Host {raw!r} is not trusted; add it to server.allowed_hosts if clients really use that name"
        return await error_response(oa.ApiError(400, msg, code="untrusted_host"), scope.get("path", ""))(scope, receive, send)


class SameOrigin:
    """403 for a browser POST from another site (an Origin that is neither this host nor one of
    server.cors_origins); clients that are not browsers send no Origin (pure ASGI)."""

    def __init__(self, app: ASGIApp, cors_origins: list[str]) -> None:
        self.app, self.cors_origins = app, {o.rstrip("/").lower() for o in cors_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        o = origin.decode("latin-1").rstrip("/").lower()
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if o in self.cors_origins or "*" in self.cors_origins or o.split("://", 1)[-1] == host:
            return await self.app(scope, receive, send)
        msg = f"cross-origin POST from {o!r} refused; list the origin in server.cors_origins or set an API key"
        return await error_response(oa.ApiError(403, msg, code="cross_origin_refused"), scope.get("path", ""))(scope, receive, send)


class JsonOnly:
    """415 for a POST whose body is not declared as JSON (pure ASGI). A browser form can post
    text/plain or urlencoded data cross-site without a preflight; JSON cannot be. That holds for
    a POST without a body too: a cross-site form can send one, and every endpoint takes `{}`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type")
        mime = (ctype or b"").split(b";", 1)[0].strip().lower().decode("latin-1")
        if mime == "application/json":
            return await self.app(scope, receive, send)
        got = f"Content-Type {mime!r}" if mime else "no Content-Type"
        msg = f"{got} is not supported: send the body as JSON with 'Content-Type: application/json'"
        return await error_response(oa.ApiError(415, msg, code="unsupported_media_type"), scope.get("path", ""))(scope, receive, send)


# -- the HTTP server: connection limits uvicorn does not have ------------------------------------
