"""The OpenAI-compatible endpoints: GET /v1/models, POST /v1/chat/completions and
POST /v1/completions, answered as one JSON body or as server-sent events.

Generation runs on the daemon's worker thread; each request gets a `Job` whose events are handed
back into the event loop by a `Bridge` and relayed, so the loop never blocks. A client that goes
away cancels its job, which stops at the next step.
"""

from __future__ import annotations

import json
import logging
import time
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
    CLIENT_GONE_STATUS,
    Bridge,
    ClientGone,
    check_speculation,
    daemon_of,
    homespec_extra,
    job_error,
    model_id,
    shutting_down_error,
    submit,
    tool_use,
)
from homespec.serving.tool_calls import ChatDeltas, ToolUse, call_grammar, chat_message
from homespec.speculation.constraints import GrammarError, json_schema_grammar, lark_grammar
from homespec.speculation.sampling import TokenLogprob

Kind = Literal["chat", "completion"]

router = APIRouter()
log = logging.getLogger("homespec.serving.openai")


@router.api_route("/v1/models", methods=["GET", "HEAD"])
@router.api_route("/models", methods=["GET", "HEAD"])  # llama-server serves its routes with and without /v1, and clients use both
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(daemon_of(request))]}


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str) -> dict:
    """One model (the openai client's models.retrieve): the served one, by its id or `homespec`."""
    daemon = daemon_of(request)
    check_model(daemon.cfg, name)
    return _model_card(daemon)


def _model_card(daemon: Daemon) -> dict:
    # context_length (OpenRouter's field; llama.vscode and other clients read it): the tokens a
    # request may hold, so a client sizes its prompts to it instead of guessing (8192, say).
    return {"id": model_id(daemon.cfg), "object": "model", "created": int(daemon.started), "owned_by": "homespec",
            "context_length": daemon.n_ctx}


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat(request: Request, body: oa.ChatRequest) -> Any:
    daemon = daemon_of(request)
    messages = body.chat_messages()
    tools = _tool_use(daemon, body)
    defs = [f.template() for f in body.tool_defs()] or None
    return await _complete(request, body, "chat", lambda models: models.encode_chat(messages, tools=defs),
                           grammar=_chat_grammar(body, tools), tools=tools)


def _tool_use(daemon: Daemon, body: oa.ChatRequest) -> ToolUse | None:
    if not body.tool_defs():
        return None
    # Under "none" the tools stay in the prompt but nothing the model writes is a call.
    return tool_use(daemon, body.tool_names() if body.choice() != "none" else [], body.legacy_functions)


def _chat_grammar(body: oa.ChatRequest, tools: ToolUse | None) -> str | None:
    """The constraint the request asks for: tool calls and/or response_format's JSON, or a grammar
    (alone; the request model refuses it with either). Under tool_choice "none" with a grammar,
    the grammar is the answer's."""
    answer = body.answer_schema()
    param = "grammar"
    try:
        if body.grammar is not None:
            return lark_grammar(body.grammar)
        param = "response_format"
        alone = json_schema_grammar(answer) if answer is not None else None  # its own errors name it
        if tools is None:
            return alone
        param = "tools"
        params = {f.name: f.parameters or {} for f in body.tool_defs()}
        return call_grammar(tools.fmt, params, body.choice(), body.parallel_tool_calls and not tools.legacy, answer=answer)
    except GrammarError as e:
        raise oa.ApiError(400, str(e), param=param) from None


@router.post("/v1/completions")
@router.post("/completions")
async def completions(request: Request, body: oa.CompletionRequest) -> Any:
    text, suffix = body.text(), body.suffix
    if suffix is None:
        return await _complete(request, body, "completion", lambda models: models.encode_text(text))
    # Fill in the middle: the prompt is the code before the gap, the suffix the code after it.
    # The prompt's budget leaves room for as many tokens as this answer may write.
    n_predict = daemon_of(request).cfg.sampling.max_tokens  # the budget /infill uses (llama/fim.py); no extra context here
    return await _complete(request, body, "completion",
                           lambda models: models.encode_infill(text, suffix, n_predict=n_predict))


async def _complete(request: Request, body: oa._Common, kind: Kind, encode: Callable[[ModelSet], list[int]],
                    grammar: str | None = None, tools: ToolUse | None = None) -> Any:
    """encode: the prompt's tokens from the loaded models (run on the worker thread)."""
    daemon = daemon_of(request)
    check_model(daemon.cfg, body.model)
    job = Job(to_request(daemon, body, body.limit(), grammar), sink=lambda ev: None,
              timeout_s=daemon.cfg.server.request_timeout_s, encode=encode, prompt_param="messages" if kind == "chat" else "prompt")
    return await run(request, body, job, kind, tools)


def check_model(cfg: Config, name: str | None) -> None:
    # "" is no name: llama.vim and llama.vscode send it when their model setting is empty.
    if name and name not in (model_id(cfg), "homespec"):
        raise oa.ApiError(404, f"model {name!r} not found; this server serves {model_id(cfg)!r}", param="model", code="model_not_found")


def to_request(daemon: Daemon, body: oa._Common, limit: int | None, grammar: str | None = None) -> GenerationRequest:
    h = check_speculation(daemon, body.homespec)
    try:
        sampling = body.with_llama_options({
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
        })
        return build_request(
            daemon.cfg,
            mode=h.speculation or Mode.AUTO,  # auto: the daemon's current mode
            k=h.k,
            max_tokens=limit,
            stop=body.stops(),
            grammar=grammar,
            # OpenAI's seed is a signed int64; numpy wants a non-negative one: map it 1:1.
            seed=None if body.seed is None else body.seed % 2**64,
            logit_bias=body.token_bias(),
            logprobs=body.logprobs_top(),
            samplers=body.chain(),
            **sampling,
        )
    except UserError as e:
        raise oa.ApiError(400, str(e)) from None


async def run(request: Request, body: oa._Common, job: Job, kind: Kind, tools: ToolUse | None = None) -> Any:
    """Queue the job and answer: one JSON body, or an event stream from its first token on."""
    bridge = submit(request, job)
    try:
        return await _answer(request, body, job, kind, bridge, tools)
    except ClientGone:
        log.info("request %s: client disconnected, generation cancelled", job.id)
        return Response(status_code=CLIENT_GONE_STATUS)


async def _answer(request: Request, body: oa._Common, job: Job, kind: Kind, bridge: Bridge, tools: ToolUse | None) -> Any:
    daemon = daemon_of(request)
    first = await bridge.next(request, job)
    if first.kind == "error":
        raise job_error(first)
    rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
    model = model_id(daemon.cfg)
    meta = first.extra
    lps = _Logprobs(kind) if job.request.logprobs is not None else None
    if body.stream:
        await bridge.first_output(request, job, pings=daemon.cfg.server.sse_ping_s > 0)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(request, daemon, bridge, job, kind, rid, model, meta, include_usage, tools, lps)
        return EventSourceResponse(events, sep="\n", ping=daemon.cfg.server.sse_ping_s)  # 0: no ": ping" lines
    text: list[str] = []
    while True:
        ev = await bridge.next(request, job)
        if ev.kind == "delta":
            text.append(ev.text)
            if lps:
                lps.add(ev)
        elif ev.kind == "error":
            raise job_error(ev)
        elif ev.kind == "done":
            extra = homespec_extra(daemon, ev.stats, meta)
            if kind == "completion":
                out = oa.completion_body(rid, model, "".join(text), ev.finish_reason, ev.stats, extra)
            else:
                message, finish = chat_message("".join(text), oa.openai_finish(ev.finish_reason), tools)
                out = oa.chat_body(rid, model, message, finish, ev.stats, extra)
            out["choices"][0]["logprobs"] = lps.body() if lps else None
            return out


class _Logprobs:
    """A request's logprobs in OpenAI's shape (chat or completions): of the whole answer, as the
    deltas bring them (add, body), or of one delta at a time (chunk)."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.entries: list[TokenLogprob] = []
        self.pieces: dict[int, bytes] = {}
        self.offset = 0  # characters of the completion already streamed (text_offset)

    def add(self, ev: JobEvent) -> None:
        self.entries += ev.logprobs
        self.pieces.update(ev.pieces)

    def body(self) -> dict:
        return self._shape(self.entries, self.pieces, 0)

    def chunk(self, ev: JobEvent) -> dict:
        out = self._shape(ev.logprobs, ev.pieces, self.offset)
        if self.kind == "completion":
            self.offset += sum(len(t) for t in out["tokens"])
        return out

    def _shape(self, entries: list[TokenLogprob], pieces: dict[int, bytes], offset: int) -> dict:
        if self.kind == "chat":
            return oa.chat_logprobs(entries, pieces)
        return oa.completion_logprobs(entries, pieces, offset)


async def _next_or_cut(request: Request, bridge: Bridge) -> JobEvent | None:
    """The next event, or None once SIGTERM's drain bound has passed."""
    return await bridge.next_or_cut(request)


async def _stream(request: Request, daemon: Daemon, bridge: Bridge, job: Job, kind: Kind, rid: str, model: str, meta: dict,
                  include_usage: bool, tools: ToolUse | None, lps: _Logprobs | None = None) -> AsyncIterator[dict]:
    created = int(time.time())  # every chunk of a stream carries the same one
    deltas = ChatDeltas(tools)
    if kind == "chat":
        def empty() -> dict:
            return oa.chat_chunk(rid, model, {}, None, created)

        def chunks(text: str) -> list[dict]:
            return [oa.chat_chunk(rid, model, d, None, created) for d in deltas.push(text)]

        def last(reason: str) -> list[dict]:
            held, reason = deltas.finish(reason)
            return [oa.chat_chunk(rid, model, d, None, created) for d in held] + [oa.chat_chunk(rid, model, {}, reason, created)]
    else:
        def empty() -> dict:
            return oa.completion_chunk(rid, model, "", None, created)

        def chunks(text: str) -> list[dict]:
            return [oa.completion_chunk(rid, model, text, None, created)] if text else []

        def last(reason: str) -> list[dict]:
            return [oa.completion_chunk(rid, model, "", reason, created)]
    try:
        if kind == "chat":
            yield {"data": json.dumps(oa.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, created))}
        while True:
            ev = await _next_or_cut(request, bridge)
            if ev is None:
                # End the stream as an error the client can read, then [DONE], rather than let
                # uvicorn cut the connection mid-chunk at its own bound.
                job.cancel()
                log.warning("request %s: stream cut at the drain timeout (server.drain_timeout_s)", job.id)
                yield {"data": json.dumps(shutting_down_error().body())}
                break
            if ev.kind == "delta" and (ev.text or (lps and ev.logprobs)):
                out = chunks(ev.text)
                if lps and ev.logprobs:
                    out = out or [empty()]  # text held back: its logprobs still go now
                    out[0]["choices"][0]["logprobs"] = lps.chunk(ev)
                for c in out:
                    yield {"data": json.dumps(c)}
            elif ev.kind == "error":
                yield {"data": json.dumps(job_error(ev).body())}
                break
            elif ev.kind == "done":
                final = last(oa.openai_finish(ev.finish_reason))
                for c in final:
                    yield {"data": json.dumps(c)}
                if include_usage:
                    tail = {**final[-1], "choices": [], "usage": oa.usage(ev.stats), "homespec": homespec_extra(daemon, ev.stats, meta)}
                    yield {"data": json.dumps(tail)}
                break
        yield {"data": "[DONE]"}
    finally:
        job.cancel()  # a no-op when finished; stops the generation when the client left
