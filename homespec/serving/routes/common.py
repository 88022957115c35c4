"""What the routers and the app factory share: the daemon on app.state, OpenAI-style error
responses, and the bridge that carries a job's events from the worker thread to its handler."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from homespec.serving import openai_api as oa
from homespec.serving.daemon import Daemon, Job, JobEvent


def daemon_of(request: Request) -> Daemon:
    return request.app.state.daemon


def error_response(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def job_error(ev: JobEvent) -> oa.ApiError:
    return oa.ApiError(ev.status, ev.text, type="server_error" if ev.status >= 500 else "invalid_request_error", code=ev.code)


def validation_error(e: RequestValidationError) -> oa.ApiError:
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


class Bridge:
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
