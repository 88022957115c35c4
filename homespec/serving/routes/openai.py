"""The OpenAI-compatible endpoints: GET /v1/models, POST /v1/chat/completions and
POST /v1/completions, answered as one JSON body or as server-sent events.

Generation runs on the daemon's worker thread; each request gets a `Job` whose events are handed
back into the event loop by a `Bridge` and relayed, so the loop never blocks. A client that goes
away cancels its job, which stops at the next step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from homespec.config import Config, Mode
from homespec.errors import UserError
from homespec.models.loader import ModelSet
from homespec.serving import openai_api as oa
from homespec.serving.daemon import Daemon, Job, JobEvent
from homespec.serving.host import GenerationRequest, build_request
from homespec.serving.routes.common import (
    Bridge,
    ClientGone,
    daemon_of,
    job_error,
    shutting_down_error,
    submit,
)

Kind = Literal["chat", "completion"]

router = APIRouter()
log = logging.getLogger("homespec.serving.openai")
# nginx's "client closed request": logged nowhere but our line; the client is gone anyway.
CLIENT_GONE_STATUS = 499


@router.get("/v1/models")
async def models(request: Request) -> dict:
    daemon = daemon_of(request)
    return {"object": "list", "data": [{"id": model_id(daemon.cfg), "object": "model", "created": int(daemon.started), "owned_by": "homespec"}]}


@router.post("/v1/chat/completions")
async def chat(request: Request, body: oa.ChatRequest) -> Any:
    messages = body.chat_messages()
    return await _complete(request, body, "chat", lambda models: models.encode_chat(messages))


@router.post("/v1/completions")
async def completions(request: Request, body: oa.CompletionRequest) -> Any:
    text, suffix = body.text(), body.suffix
    if suffix is None:
        return await _complete(request, body, "completion", lambda models: models.encode_text(text))
    # Fill in the middle: the prompt is the code before the gap, the suffix the code after it.
    # The prompt's budget leaves room for as many tokens as this answer may write.
    n_predict = body.limit() or daemon_of(request).cfg.sampling.max_tokens
    return await _complete(request, body, "completion",
                           lambda models: models.encode_infill(text, suffix, n_predict=n_predict))


async def _complete(request: Request, body: oa._Common, kind: Kind, encode: Callable[[ModelSet], list[int]]) -> Any:
    """encode: the prompt's tokens from the loaded models (run on the worker thread)."""
    daemon = daemon_of(request)
    check_model(daemon.cfg, body.model)
    job = Job(to_request(daemon, body, body.limit()), sink=lambda ev: None, timeout_s=daemon.cfg.server.request_timeout_s, encode=encode)
    return await run(request, body, job, kind)


def model_id(cfg: Config) -> str:
    if cfg.server.model_alias:
        return cfg.server.model_alias
    ref = cfg.models.target
    return ref.name or (ref.path.stem if ref.path else "homespec")


def check_model(cfg: Config, name: str | None) -> None:
    if name is not None and name not in (model_id(cfg), "homespec"):
        raise oa.ApiError(404, f"model {name!r} not found; this server serves {model_id(cfg)!r}", param="model", code="model_not_found")


def to_request(daemon: Daemon, body: oa._Common, limit: int | None) -> GenerationRequest:
    h = body.homespec or oa.HomespecOptions()
    if h.speculation and h.speculation not in daemon.available_modes():
        raise oa.ApiError(400, f"speculation mode {h.speculation.value!r} is not available (choose from {', '.join(daemon.available_modes())})", param="homespec.speculation")
    try:
        return build_request(
            daemon.cfg,
            mode=h.speculation or Mode.AUTO,  # auto: the daemon's current mode
            k=h.k,
            max_tokens=limit,
            stop=body.stops(),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            # OpenAI's seed is a signed int64; numpy wants a non-negative one: map it 1:1.
            seed=None if body.seed is None else body.seed % 2**64,
        )
    except UserError as e:
        raise oa.ApiError(400, str(e)) from None


async def run(request: Request, body: oa._Common, job: Job, kind: Kind) -> Any:
    """Queue the job and answer: one JSON body, or an event stream once the job has started."""
    bridge = submit(request, job)
    try:
        return await _answer(request, body, job, kind, bridge)
    except ClientGone:
        log.info("request %s: client disconnected, generation cancelled", job.id)
        return Response(status_code=CLIENT_GONE_STATUS)


async def _answer(request: Request, body: oa._Common, job: Job, kind: Kind, bridge: Bridge) -> Any:
    daemon = daemon_of(request)
    first = await bridge.next(request, job)
    if first.kind == "error":
        raise job_error(first)
    rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
    model = model_id(daemon.cfg)
    meta = first.extra
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(request, daemon, bridge, job, kind, rid, model, meta, include_usage)
        return EventSourceResponse(events, sep="\n", ping=15)
    text: list[str] = []
    while True:
        ev = await bridge.next(request, job)
        if ev.kind == "delta":
            text.append(ev.text)
        elif ev.kind == "error":
            raise job_error(ev)
        elif ev.kind == "done":
            extra = _extra(daemon, ev, meta)
            build = oa.chat_body if kind == "chat" else oa.completion_body
            return build(rid, model, "".join(text), ev.finish_reason, ev.stats, extra)


async def _next_or_cut(request: Request, bridge: Bridge) -> JobEvent | None:
    """The next event, or None once SIGTERM's drain bound has passed."""
    return await bridge.next_or_cut(request)


async def _stream(request: Request, daemon: Daemon, bridge: Bridge, job: Job, kind: Kind, rid: str, model: str, meta: dict,
                  include_usage: bool) -> AsyncIterator[dict]:
    created = None
    chunk = (lambda t, f=None: oa.chat_chunk(rid, model, {"content": t} if t else {}, f, created)) if kind == "chat" else (
        lambda t, f=None: oa.completion_chunk(rid, model, t, f, created))
    try:
        if kind == "chat":
            yield {"data": json.dumps(oa.chat_chunk(rid, model, {"role": "assistant", "content": ""}))}
        while True:
            ev = await _next_or_cut(request, bridge)
            if ev is None:
                # End the stream as an error the client can read, then [DONE], rather than let
                # uvicorn cut the connection mid-chunk at its own bound.
                job.cancel()
                log.warning("request %s: stream cut at the drain timeout (server.drain_timeout_s)", job.id)
                yield {"data": json.dumps(shutting_down_error().body())}
                break
            if ev.kind == "delta" and ev.text:
                yield {"data": json.dumps(chunk(ev.text))}
            elif ev.kind == "error":
                yield {"data": json.dumps(job_error(ev).body())}
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


def _extra(daemon: Daemon, ev: JobEvent, meta: dict) -> dict:
    """The `homespec` extension object of a finished request."""
    baseline = daemon.session.controller.view.baseline_tps if daemon.session else None
    return oa.homespec_stats(ev.stats, meta.get("mode", "auto"), bool(meta.get("cold")), baseline)
