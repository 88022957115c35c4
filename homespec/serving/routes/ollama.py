"""Ollama's REST API beside the OpenAI one: GET/HEAD /, /api/version, /api/tags, /api/ps,
POST /api/show, /api/pull, /api/chat and /api/generate (serving/ollama_api.py has the shapes).

Same process, same worker, controller, prefix cache and auth as the OpenAI routes: a chat here
builds the very prompt /v1/chat/completions builds (ModelSet.encode_chat), so greedy answers are
identical. Generation answers stream as NDJSON by default, one object per line, as Ollama does.
The metadata endpoints never wait for the worker: they read the config, the daemon's state and
the GGUF header (cached), so clients polling them with short timeouts get an answer while a long
generation runs.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from homespec.config import Config, Mode
from homespec.errors import ModelError, UserError
from homespec.llama.gguf_info import ModelCard, read_model_card
from homespec.models.fetch import ensure, known_sha256, model_file
from homespec.models.registry import load_registry
from homespec.serving import ollama_api as ol
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
from homespec.serving.tool_calls import CallStream, ToolUse, call_grammar, parse_calls, tool_format
from homespec.speculation.constraints import GrammarError, json_schema_grammar

router = APIRouter()
log = logging.getLogger("homespec.serving.ollama")
NDJSON = "application/x-ndjson"


# -- names and the model's card ------------------------------------------------------------------


def served_names(cfg: Config) -> set[str]:
    """The names a request may use for the one model served (with or without ":latest")."""
    ref = cfg.models.target
    return {model_id(cfg), "homespec", ref.name or (ref.path.stem if ref.path else "homespec")}


def tag(cfg: Config) -> str:
    name = model_id(cfg)
    return name if ":" in name else f"{name}:latest"


def check_name(cfg: Config, name: str) -> None:
    if name.removesuffix(":latest") not in served_names(cfg):
        raise oa.ApiError(404, f"model '{name}' not found (this server serves '{tag(cfg)}')", code="model_not_found")


@functools.lru_cache(maxsize=4)
def _card(path: str, mtime_ns: int, size: int) -> ModelCard:
    """Read once per version of the file (the key holds its stat)."""
    return read_model_card(Path(path))


async def _model(cfg: Config) -> tuple[Path, Any, ModelCard, str]:
    """The target's file, its stat, its card and a digest; read off the event loop, cached."""

    def read() -> tuple[Path, Any, ModelCard, str]:
        path = model_file(cfg, cfg.models.target)
        st = path.stat()
        card = _card(str(path), st.st_mtime_ns, st.st_size)
        # Ollama's digest names a manifest; the file's sha256 (known without hashing) serves the
        # same purpose, else one derived from where and what the file is.
        digest = known_sha256(cfg, cfg.models.target) or hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        return path, st, card, digest

    try:
        return await asyncio.to_thread(read)
    except (OSError, ModelError) as e:
        raise oa.ApiError(500, f"cannot read the model: {e}", type="server_error") from None


def _capabilities(daemon: Daemon, template: str | None) -> list[str]:
    caps = ["completion"]
    if tool_format(template) is not None:
        caps.append("tools")
    if daemon.can_infill:
        caps.append("insert")
    return caps


def _parameters(cfg: Config) -> str:
    """The daemon's sampling defaults as Ollama's Modelfile PARAMETER lines."""
    s = cfg.sampling
    lines = [f"temperature {s.temperature}", f"top_p {s.top_p}", f"top_k {s.top_k}", f"min_p {s.min_p}",
             f"repeat_penalty {s.repetition_penalty}", f"num_predict {s.max_tokens}", f"num_ctx {cfg.runtime.n_ctx}"]
    return "\n".join(lines)


# -- metadata ------------------------------------------------------------------------------------


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> PlainTextResponse:
    return PlainTextResponse("Ollama is running")  # what Ollama answers; its CLI probes it


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version() -> dict:
    return {"version": ol.OLLAMA_VERSION}


@router.api_route("/api/tags", methods=["GET", "HEAD"])  # HEAD: Ollama's liveness probe too
async def tags(request: Request) -> dict:
    cfg = daemon_of(request).cfg
    _path, st, card, digest = await _model(cfg)
    entry = {"name": tag(cfg), "model": tag(cfg), "modified_at": ol.timestamp(st.st_mtime), "size": st.st_size,
             "digest": digest, "details": ol.details(card.metadata, card.n_params, card.file_type)}
    return {"models": [entry]}


@router.get("/api/ps")
async def ps(request: Request) -> dict:
    daemon = daemon_of(request)
    cfg = daemon.cfg
    expires = daemon.expires_at()
    if expires is None:
        return {"models": []}
    _path, st, card, digest = await _model(cfg)
    size, vram = st.st_size, 0  # bytes
    loaded = [fp for fp in daemon.footprints if fp is not None]
    if loaded:  # the memory plan's figures: weights, KV cache and buffers, as Ollama counts them
        size = sum(fp.weights_ram + fp.weights_vram + fp.kv + fp.compute for fp in loaded)
        vram = sum(fp.weights_vram + fp.kv_vram + fp.compute_vram for fp in loaded)
    entry = {"name": tag(cfg), "model": tag(cfg), "size": size, "digest": digest,
             "details": ol.details(card.metadata, card.n_params, card.file_type), "expires_at": ol.expiry(expires),
             "size_vram": vram, "context_length": daemon.n_ctx}
    return {"models": [entry]}


@router.post("/api/show")
async def show(request: Request, body: ol.ModelRequest) -> dict:
    daemon = daemon_of(request)
    cfg = daemon.cfg
    check_name(cfg, body.wanted)
    path, st, card, _digest = await _model(cfg)
    template = daemon.template_source or card.metadata.get("tokenizer.chat_template")
    info = {k: v for k, v in card.metadata.items() if k != "tokenizer.chat_template"}
    info["general.parameter_count"] = card.n_params
    return {
        "license": str(card.metadata.get("general.license", "")),
        "modelfile": f"# served by homespec {daemon.version()}; its settings live in config.yaml\nFROM {path}\n",
        "parameters": _parameters(cfg),
        "template": template or "",  # a Jinja chat template (Ollama's are Go templates)
        "details": ol.details(card.metadata, card.n_params, card.file_type),
        "model_info": info,
        "capabilities": _capabilities(daemon, template),
        "modified_at": ol.timestamp(st.st_mtime),
    }


@router.post("/api/pull")
async def pull(request: Request, body: ol.ModelRequest) -> Any:
    """A registry model, fetched and verified as `homespec models pull` does; one already present
    (the served one, say) reports success at once. A `path:` target has nothing to pull."""
    cfg = daemon_of(request).cfg
    wanted = body.wanted.removesuffix(":latest")
    target = cfg.models.target
    if wanted in served_names(cfg) and target.path is not None:
        ok = {"status": "success"}
        return Response(_line(ok), media_type=NDJSON) if body.stream else JSONResponse(ok)
    try:
        registry = await asyncio.to_thread(load_registry, cfg.resolve(cfg.models.registry))
    except ModelError as e:
        raise oa.ApiError(500, str(e), type="server_error") from None
    name = target.name if wanted in served_names(cfg) else wanted
    entry = registry.get(name or "")
    if entry is None:
        raise oa.ApiError(404, f"model '{body.wanted}' not found: homespec pulls the models of its registry ({', '.join(sorted(registry))})",
                          code="model_not_found")
    models_dir = cfg.resolve(cfg.models.dir)
    if not body.stream:
        try:
            await asyncio.to_thread(ensure, entry, models_dir)
        except ModelError as e:
            raise oa.ApiError(500, str(e), type="server_error") from None
        return {"status": "success"}
    return StreamingResponse(_pull_progress(entry, models_dir), media_type=NDJSON)


async def _pull_progress(entry: Any, models_dir: Path) -> AsyncIterator[bytes]:
    """`ensure`'s progress lines as Ollama's {"status": ...} objects, then success or an error.
    The fetch runs on a thread; a client that leaves does not stop it (the file is wanted)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str] = asyncio.Queue()
    task = asyncio.ensure_future(asyncio.to_thread(
        ensure, entry, models_dir, progress=lambda msg: loop.call_soon_threadsafe(queue.put_nowait, msg)))
    yield _line({"status": "pulling manifest"})
    while not (task.done() and queue.empty()):
        try:
            yield _line({"status": await asyncio.wait_for(queue.get(), timeout=0.5)})
        except asyncio.TimeoutError:
            continue
    try:
        task.result()
    except ModelError as e:
        yield _line({"error": str(e)})
        return
    yield _line({"status": "success"})


# -- generation ----------------------------------------------------------------------------------


@router.post("/api/chat")
async def chat(request: Request, body: ol.ChatRequest) -> Any:
    t0 = time.perf_counter()
    daemon = daemon_of(request)
    check_name(daemon.cfg, body.model)
    if not body.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return await _answer(request, body, _job(daemon, body, None, None), "chat", None, t0)
    messages = body.template_messages()
    defs = [t.function.template() for t in body.tools or []] or None
    tools = tool_use(daemon, [t.function.name for t in body.tools]) if body.tools else None
    grammar = _grammar(body.format, tools, body)
    job = _job(daemon, body, grammar, lambda models: models.encode_chat(messages, tools=defs))
    return await _answer(request, body, job, "chat", tools, t0)


@router.post("/api/generate")
async def generate(request: Request, body: ol.GenerateRequest) -> Any:
    t0 = time.perf_counter()
    daemon = daemon_of(request)
    check_name(daemon.cfg, body.model)
    if body.load_only():
        return await _answer(request, body, _job(daemon, body, None, None), "generate", None, t0)
    grammar = _grammar(body.format, None, body)
    prompt, suffix = body.prompt, body.suffix
    if suffix is not None:  # fill in the middle: the prompt is the code before the gap
        gen = _request(daemon, body, grammar)
        encode = lambda models: models.encode_infill(prompt, suffix, n_predict=gen.max_tokens)  # noqa: E731
        return await _answer(request, body, _job(daemon, body, grammar, encode, gen), "generate", None, t0)
    if body.raw:
        encode = lambda models: models.encode_text(prompt)  # noqa: E731
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [{"role": "user", "content": prompt}]
        encode = lambda models: models.encode_chat(messages)  # noqa: E731
    return await _answer(request, body, _job(daemon, body, grammar, encode), "generate", None, t0)


def _grammar(fmt: ol.Format, tools: ToolUse | None, body: ol.ChatRequest | ol.GenerateRequest) -> str | None:
    """Tool calls and/or the format's JSON: with both, the answer is one or the other (Ollama's own
    grammar allows only the JSON). A format schema's keywords that cannot be enforced are ignored,
    as Ollama's llama.cpp ignores them."""
    answer = {"type": "object"} if fmt == "json" else fmt if isinstance(fmt, dict) else None
    param = "format"
    try:
        alone = json_schema_grammar(answer, lenient=True) if answer is not None else None  # its own errors name it
        if tools is None or not isinstance(body, ol.ChatRequest):
            return alone
        param = "tools"
        params = {t.function.name: t.function.parameters or {} for t in body.tools or []}
        return call_grammar(tools.fmt, params, "auto", parallel=True, answer=answer, answer_lenient=True)
    except GrammarError as e:
        raise oa.ApiError(400, str(e), param=param) from None


def _request(daemon: Daemon, body: ol.ChatRequest | ol.GenerateRequest, grammar: str | None) -> GenerationRequest:
    o = body.options
    h = check_speculation(daemon, oa.HomespecOptions(speculation=o.homespec_speculation, k=o.homespec_k))
    n_ctx = daemon.n_ctx
    try:
        return build_request(daemon.cfg, mode=h.speculation or Mode.AUTO, k=h.k, max_tokens=o.limit(n_ctx), stop=o.stop or (),
                             grammar=grammar, logprobs=body.logprobs_top(), **o.sampling())
    except UserError as e:
        raise oa.ApiError(400, f"options: {e}") from None


def _job(daemon: Daemon, body: ol.ChatRequest | ol.GenerateRequest, grammar: str | None, encode: Any,
         gen: GenerationRequest | None = None) -> Job:
    """encode None: a job that only loads the models (or unloads them, with keep_alive 0)."""
    gen = gen or (_request(daemon, body, grammar) if encode is not None else build_request(daemon.cfg))
    return Job(gen, sink=lambda ev: None, encode=encode, timeout_s=daemon.cfg.server.request_timeout_s,
               keep_alive_s=body.keep_alive)


async def _answer(request: Request, body: ol.ChatRequest | ol.GenerateRequest, job: Job, kind: str,
                  tools: ToolUse | None, t0: float) -> Any:
    daemon = daemon_of(request)
    bridge = submit(request, job)
    try:
        first = await bridge.next(request, job)
        if first.kind == "error":
            raise job_error(first)
        reply = _Reply(daemon, kind, body.model, tools, first.extra, t0)
        if body.stream and job.encode is not None:
            await bridge.first_output(request, job)
            return StreamingResponse(_ndjson(request, bridge, job, reply), media_type=NDJSON)
        while True:
            ev = await bridge.next(request, job)
            if ev.kind == "delta":
                reply.add(ev)
            elif ev.kind == "error":
                raise job_error(ev)
            elif ev.kind == "done":
                return reply.whole(ev)
    except ClientGone:
        log.info("request %s: client disconnected, generation cancelled", job.id)
        return Response(status_code=CLIENT_GONE_STATUS)


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


async def _ndjson(request: Request, bridge: Bridge, job: Job, reply: _Reply) -> AsyncIterator[bytes]:
    try:
        while True:
            ev = await bridge.next_or_cut(request)
            if ev is None:  # SIGTERM's drain bound: end with an error line the client can read
                job.cancel()
                log.warning("request %s: stream cut at the drain timeout (server.drain_timeout_s)", job.id)
                yield _line({"error": shutting_down_error().message})
                break
            if ev.kind == "delta":
                for chunk in reply.push(ev):
                    yield _line(chunk)
            elif ev.kind == "error":
                yield _line({"error": job_error(ev).message})
                break
            elif ev.kind == "done":
                for chunk in reply.finish(ev):
                    yield _line(chunk)
                break
    finally:
        job.cancel()  # a no-op when finished; stops the generation when the client left


class _Reply:
    """One answer in Ollama's shape: /api/chat's `message` or /api/generate's `response`, streamed
    (push, finish) or whole (add, whole). With tools, calls are held back until they close and
    sent as `tool_calls` with arguments as objects."""

    def __init__(self, daemon: Daemon, kind: str, model: str, tools: ToolUse | None, started: dict, t0: float) -> None:
        self.daemon, self.kind, self.model, self.tools, self.meta, self.t0 = daemon, kind, model, tools, started, t0
        self.calls = CallStream(tools.fmt, tools.names) if tools is not None else None
        self.text: list[str] = []
        self.logprobs: list[dict] = []

    def _obj(self, content: str, calls: list[dict] | None = None, logprobs: list[dict] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": ol.timestamp()}
        if self.kind == "chat":
            out["message"] = {"role": "assistant", "content": content}
            if calls:
                out["message"]["tool_calls"] = calls
        else:
            out["response"] = content
        out["done"] = False
        if logprobs:
            out["logprobs"] = logprobs
        return out

    def _logprobs(self, ev: JobEvent) -> list[dict]:
        return oa.chat_logprobs(ev.logprobs, ev.pieces)["content"] if ev.logprobs else []

    def push(self, ev: JobEvent) -> list[dict[str, Any]]:
        content, calls = self.calls.push(ev.text) if self.calls is not None else (ev.text, [])
        lps = self._logprobs(ev)
        out = [self._obj(content, logprobs=lps)] if content or lps else []
        if calls:  # numbered on from the calls sent before (CallStream keeps them all)
            assert self.calls is not None
            out.append(self._obj("", ol.tool_calls(calls, start=len(self.calls.calls) - len(calls))))
        return out

    def finish(self, ev: JobEvent) -> list[dict[str, Any]]:
        rest, calls = self.calls.finish(truncated=ol.done_reason(ev.finish_reason) == "length") if self.calls is not None else ("", [])
        out = [self._obj(rest)] if rest else []
        if calls:  # an answer that was one call with no marker, known only at its end
            assert self.calls is not None
            out.append(self._obj("", ol.tool_calls(calls, start=len(self.calls.calls) - len(calls))))
        return out + [self._final(ev, "")]

    def add(self, ev: JobEvent) -> None:
        self.text.append(ev.text)
        self.logprobs += self._logprobs(ev)

    def whole(self, ev: JobEvent) -> dict[str, Any]:
        text = "".join(self.text)
        out = self._final(ev, text)
        if self.tools is not None:
            parsed = parse_calls(self.tools.fmt, text, self.tools.names, truncated=out["done_reason"] == "length")
            if parsed is not None and parsed[1]:
                out["message"]["content"] = parsed[0]
                out["message"]["tool_calls"] = ol.tool_calls(parsed[1])
        if self.logprobs:
            out["logprobs"] = self.logprobs
        return out

    def _final(self, ev: JobEvent, content: str) -> dict[str, Any]:
        out = self._obj(content)
        out["done"] = True
        out["done_reason"] = ol.done_reason(ev.finish_reason)
        load_s = float(self.meta.get("load_s", 0.0))
        out.update(ol.metrics(ev.stats, load_s=load_s, total_s=time.perf_counter() - self.t0))
        if ev.stats is not None:  # homespec's figures, where Ollama's schema has room
            # The whole prompt and the part of it served from the KV cache of earlier turns
            # (prompt_eval_count counts only the rest, the tokens evaluated now).
            out["homespec"] = {**homespec_extra(self.daemon, ev.stats, self.meta),
                               "prompt_tokens": ev.stats.prompt_tokens, "cached_tokens": ev.stats.cached_tokens}
        return out


@router.get("/api/{rest:path}", include_in_schema=False)
async def unknown(request: Request, rest: str) -> None:
    """A GET of a path Ollama does not have: 404 (a path only POSTed to: 405, naming the method)."""
    if any(r.path == f"/api/{rest}" and "POST" in r.methods for r in router.routes if isinstance(r, APIRoute)):
        raise oa.ApiError(405, "method not allowed: POST it", headers={"Allow": "POST"})
    raise oa.ApiError(404, f"/api/{rest} not found", code="not_found")


@router.api_route("/api/{rest:path}", methods=["POST", "DELETE"], include_in_schema=False)
async def unsupported(rest: str) -> None:
    raise oa.ApiError(501, f"/api/{rest} is not supported: homespec serves one model (chat, generate, show, tags, ps, pull, version)",
                      type="server_error", code="not_implemented")
