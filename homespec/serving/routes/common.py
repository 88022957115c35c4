"""What the routers and the app factory share: the daemon on app.state, OpenAI-style error
responses, and the bridge that carries a job's events from the worker thread to its handler."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
import weakref
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.types import Receive

from homespec.config import Config
from homespec.serving import openai_api as oa
from homespec.serving.daemon import Daemon, Job, JobEvent, NotReady, QueueFull
from homespec.serving.tool_calls import ToolUse, tool_format
from homespec.speculation.engine import GenerationStats


def daemon_of(request: Request) -> Daemon:
    return request.app.state.daemon


def model_id(cfg: Config) -> str:
    """The served model's public name: server.model_alias, else the target's name."""
    if cfg.server.model_alias:
        return cfg.server.model_alias
    ref = cfg.models.target
    return ref.name or (ref.path.stem if ref.path else "homespec")


# nginx's "client closed request": logged nowhere but our line; the client is gone anyway.
CLIENT_GONE_STATUS = 499


# A 503 is "try again": say when, so clients and proxies back off instead of hammering.
RETRY_AFTER_503_S = 5


# Ollama's API lives under this prefix; its clients read errors as {"error": "message"}.
OLLAMA_PREFIX = "/api/"


def error_response(e: oa.ApiError, path: str = "") -> Response:
    """The error as JSON: OpenAI's shape, or Ollama's under /api/ (path: the request's)."""
    headers = dict(e.headers or {})
    if e.status == 503 and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(RETRY_AFTER_503_S)
    if path.startswith(OLLAMA_PREFIX):  # no `param` field there: the message names it
        named = not e.param or e.param in e.message
        body: dict = {"error": e.message if named else f"{e.param}: {e.message}"}
    else:
        body = e.body()
    # ASCII JSON: a message that quotes the request (a model name) may hold a lone surrogate,
    # which UTF-8 cannot encode.
    return Response(json.dumps(body), status_code=e.status, headers=headers, media_type="application/json")


def shutting_down_error() -> oa.ApiError:
    return oa.ApiError(503, "the server is shutting down: the answer was cut at server.drain_timeout_s",
                       type="server_error", code="shutting_down")


def drain_deadline_passed(request: Request) -> bool:
    """SIGTERM's drain bound (app.state.drain_deadline, monotonic) is reached: end answers now,
    cleanly, before uvicorn cuts the connections mid-chunk."""
    deadline = getattr(request.app.state, "drain_deadline", None)
    return deadline is not None and time.monotonic() >= deadline


class ClientGone(Exception):
    """The client hung up while its answer was being generated; nobody is left to answer."""


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected: with the request's body read, the only message
    left to receive is http.disconnect (uvicorn sends it when the connection is lost)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def job_error(ev: JobEvent) -> oa.ApiError:
    return oa.ApiError(ev.status, ev.text, type="server_error" if ev.status >= 500 else "invalid_request_error",
                       param=ev.extra.get("param"), code=ev.code)


_UNION_MEMBER = re.compile(r"str|int|float|bool|[a-z][a-z-]*\[.*\]")


def validation_error(e: RequestValidationError) -> oa.ApiError:
    errs = e.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return oa.ApiError(400, "request body is not valid JSON", code="invalid_json")
    # pydantic names the union member it tried in the location (`content.str`, `prompt.list[int]`,
    # `x.function-after[...]`): not a field the client sent, so left out.
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_MEMBER.fullmatch(str(x))]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, oa.FieldError):  # a check across fields, about one of them
        loc.append(cause.param)
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing" and param is None:
        msg = "request body is missing or empty: send a JSON object"
    elif first.get("type") == "missing":
        msg = f"missing required field {param!r}"
    elif first.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}: not supported (homespec's own options go in the `homespec` object)"
    elif param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return oa.ApiError(400, msg, param=param)


def check_speculation(daemon: Daemon, options: oa.HomespecOptions | None) -> oa.HomespecOptions:
    """A request's `homespec` options, refused with a 400 when they name a mode not loaded now."""
    h = options or oa.HomespecOptions()
    if h.speculation and h.speculation not in daemon.available_modes():
        raise oa.ApiError(400, f"speculation mode {h.speculation.value!r} is not available (choose from "
                          f"{', '.join(daemon.available_modes())})", param="homespec.speculation")
    return h


def tool_use(daemon: Daemon, names: list[str], legacy: bool = False) -> ToolUse:
    """How a request with tools may call them: the call format of the target's chat template
    (a 400 naming `tools` when it has none; a 503 before the first load, which reads it)."""
    if daemon.template_source is None:
        raise oa.ApiError(503, "not ready: the model has not been loaded yet", type="server_error", code="not_ready",
                          headers={"Retry-After": str(RETRY_AFTER_503_S)})
    fmt = tool_format(daemon.template_source)
    if fmt is None:
        raise oa.ApiError(400, f"model {model_id(daemon.cfg)!r} has no tool-call format in its chat template; tools are not available with it",
                          param="tools", code="tools_unsupported")
    return ToolUse(fmt, names, legacy)


def homespec_extra(daemon: Daemon, stats: GenerationStats, meta: dict[str, Any]) -> dict[str, Any]:
    """The `homespec` extension object of a finished request (meta: its "started" event's extra)."""
    baseline = daemon.session.controller.view.baseline_tps if daemon.session else None
    return oa.homespec_stats(stats, str(meta.get("mode", "auto")), bool(meta.get("cold")), baseline)


PRIORITY_HEADER = "x-homespec-priority"
PRIORITY_RANGE = range(-10, 11)


def request_priority(request: Request) -> int:
    """The job's priority from its X-Homespec-Priority header (-10..10, higher first; none: 0).
    A voice pipeline sends 5, say, and is admitted and read ahead of chat and autocomplete."""
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value not in PRIORITY_RANGE:
        raise oa.ApiError(400, f"header X-Homespec-Priority must be an integer from {PRIORITY_RANGE[0]} to {PRIORITY_RANGE[-1]}, "
                          f"got {raw!r}", param="X-Homespec-Priority")
    return value


def submit(request: Request, job: Job) -> Bridge:
    """Queue the job; its events arrive on the returned bridge. A full queue is a 429 and models
    that are not loaded a 503, both with the Retry-After the daemon estimates."""
    bridge = Bridge()
    job.sink = bridge.sink
    job.priority = request_priority(request)
    try:
        daemon_of(request).submit(job)
    except QueueFull as e:
        raise oa.ApiError(429, "too many requests waiting; retry later", type="rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
    except NotReady as e:
        raise oa.ApiError(503, f"not ready: models are {e.state}", type="server_error", code="not_ready",
                          headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
    return bridge


class _Mailbox:
    """Events from the worker thread into one event loop, one wake-up for all that arrive together.

    call_soon_threadsafe writes to the loop's self-pipe each time: once per token and request,
    that was 1.3 % of the worker's time with four requests streaming (py-spy). A pass's tokens
    now go over in one wake-up, in the order they were posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[JobEvent], JobEvent]] = []

    def post(self, queue: asyncio.Queue[JobEvent], ev: JobEvent) -> None:
        with self._lock:
            self._items.append((queue, ev))
            if len(self._items) > 1:
                return  # a wake-up is already on its way and will take this one too
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, ev in items:
            queue.put_nowait(ev)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    """The loop's shared mailbox (keyed weakly: tests start and close many loops)."""
    try:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _Mailbox(loop)
        return box
    except TypeError:  # a loop without weak references (uvloop's): a mailbox per request still works
        return _Mailbox(loop)


class Bridge:
    """Worker-thread events -> an asyncio queue in the request's loop."""

    CHECK_S = 0.5  # how often a waiting handler looks at SIGTERM's drain bound

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._mailbox = _mailbox(self.loop)
        self._held: JobEvent | None = None  # read by first_output, not yet taken
        self._gone: asyncio.Future[None] | None = None  # done when the client has disconnected (next)

    def sink(self, ev: JobEvent) -> None:
        self._mailbox.post(self.queue, ev)

    async def next(self, request: Request, job: Job) -> JobEvent:
        """The next event, cancelling the job if the client disconnects meanwhile (ClientGone)
        or the drain bound passes (a 503 ApiError).

        The hang-up is awaited beside the queue, so it is seen as it happens. Asked every half
        second, it left a request whose client had gone running on beside the requests that
        came after it, as an editor's autocomplete abandons one at every keystroke. Between
        events it is looked at before each one, so a generation that never lets the queue run
        dry notices too."""
        if self._held is not None:
            ev, self._held = self._held, None
            return ev
        if self._gone is None:
            self._gone = asyncio.ensure_future(_disconnected(request.receive))
        while True:
            if drain_deadline_passed(request):
                job.cancel()
                raise shutting_down_error()
            if self._gone.done():
                job.cancel()
                raise ClientGone()
            get = asyncio.ensure_future(self.queue.get())
            try:
                done, _ = await asyncio.wait((get, self._gone), timeout=self.CHECK_S, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the handler was (one of n_cmpl's jobs failed): leave nothing waiting
                get.cancel()
                self._unwatch()
                raise
            if get in done:
                ev = get.result()
                if ev.kind in ("done", "error"):
                    self._unwatch()
                return ev
            get.cancel()  # an event it had taken stays queued: Queue.get takes it only once resumed

    def _unwatch(self) -> None:
        """Stop waiting for the hang-up (the answer is complete, or a stream's response, which
        notices it itself, takes over)."""
        if self._gone is not None and not self._gone.done():
            self._gone.cancel()

    async def first_output(self, request: Request, job: Job, pings: bool = False) -> None:
        """Wait for the job's first output (a token, its end or an error) before a stream's
        response starts; the event stays for next().

        A client that hangs up sends only EOF, as one that half-closes does, and the HTTP
        protocol can tell them apart only while no response has started (GuardedH11Protocol).
        Started at once, a stream hid a hang-up until its first token was written: the whole
        prompt was read for nobody while the next request waited (7.7-9.3 s for 750-900 tokens
        here). Waiting also lets an error before the first token be an HTTP status.

        pings: the stream sends keep-alive comments (server.sse_ping_s), so it starts at once:
        they are there to keep a proxy from closing it during a long prefill, and a ping
        written to a client that left draws the reset that shows it gone."""
        if pings:
            return
        if self._held is None:
            self._held = await self.next(request, job)
        self._unwatch()
        if self._held.kind == "error":
            raise job_error(self._held)

    async def next_or_cut(self, request: Request) -> JobEvent | None:
        """The next event, or None once SIGTERM's drain bound has passed (for a stream, whose
        client disconnect the response itself notices)."""
        if self._held is not None:
            ev, self._held = self._held, None
            return ev
        while not drain_deadline_passed(request):
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=self.CHECK_S)
            except asyncio.TimeoutError:
                continue
        return None
