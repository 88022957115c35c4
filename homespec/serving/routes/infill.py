"""POST /infill: llama.cpp server's fill-in-the-middle endpoint, for editor plugins (llama.vscode,
llama.vim) that send the code around the cursor and get back the code for the gap.

The request and the answer are llama.cpp's (serving/infill_api.py); the prompt is built on the
worker thread from the target's FIM tokens (ModelSet.encode_infill), so a model without them is
refused there with a 400. Queueing, cancellation and the event bridge are the OpenAI routes' own
(routes/common.py). n_indent and t_max_predict_ms end the answer here, on its text: the job is
cancelled and stops at its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from homespec.config import Mode
from homespec.errors import UserError
from homespec.llama.fim import Chunk
from homespec.serving import infill_api as ia
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
)

router = APIRouter()
log = logging.getLogger("homespec.serving.infill")


@router.post("/infill")
async def infill(request: Request, body: ia.InfillRequest) -> Any:
    daemon = daemon_of(request)
    gen = _generation_request(daemon, body)
    n = _completions(daemon, body)
    if body.stream:
        job = _job(daemon, body, gen)
        bridge = submit(request, job)
        try:
            first = await bridge.next(request, job)
            if first.kind == "error":
                raise job_error(first)
            answer = _Answer(daemon, body, gen, first)
            await bridge.first_output(request, job, pings=daemon.cfg.server.sse_ping_s > 0)
            return EventSourceResponse(_stream(request, bridge, job, answer), sep="\n", ping=daemon.cfg.server.sse_ping_s)
        except ClientGone:
            log.info("request %s: client disconnected, infill cancelled", job.id)
            return Response(status_code=CLIENT_GONE_STATUS)
    # n_cmpl completions of the same prompt (llama.vscode cycles through them): one job each,
    # decoding side by side in the running batch, the prompt borrowed from the first that read it.
    jobs: list[Job] = []
    waits: list[asyncio.Future[dict[str, Any]]] = []
    try:
        for i in range(n):
            jobs.append(_job(daemon, body, gen))
            waits.append(asyncio.ensure_future(_whole(request, daemon, body, gen, jobs[-1], submit(request, jobs[-1]), i)))
        answers = await asyncio.gather(*waits)
        return answers[0] if n == 1 else answers
    except ClientGone:
        log.info("request %s: client disconnected, infill cancelled", jobs[0].id)
        return Response(status_code=CLIENT_GONE_STATUS)
    finally:
        for w, j in zip(waits, jobs, strict=False):
            w.cancel()  # no-ops for what has finished; the others when one failed or the client left
            j.cancel()


def _job(daemon: Daemon, body: ia.InfillRequest, gen: GenerationRequest) -> Job:
    # The room left for the answer is the server's default, not this request's n_predict: an
    # editor's warm-up (n_predict 0) and its completion (128) then cut the extra context at the
    # same place, and the completion finds the warm-up's cache (llama/fim.py).
    prefix, suffix, prompt, n_predict = body.input_prefix, body.input_suffix, body.prompt, daemon.cfg.sampling.max_tokens
    extra = [Chunk(c.text, c.filename) for c in body.input_extra]
    return Job(gen, sink=lambda ev: None, timeout_s=daemon.cfg.server.request_timeout_s,
               encode=lambda models: models.encode_infill(prefix, suffix, extra=extra, prompt=prompt, n_predict=n_predict))


def _completions(daemon: Daemon, body: ia.InfillRequest) -> int:
    """How many completions to write: n_cmpl, at most one per slot (llama-server's bound and
    words, which llama.vscode reads); one for a warm-up (n_predict 0), which answers nothing."""
    if body.limit() == 0:
        return 1
    if not 1 <= body.n_cmpl <= daemon.slots:
        raise oa.ApiError(400, f"Field 'n_cmpl': Value must be between 1 <= value <= {daemon.slots}, but got {body.n_cmpl}",
                          param="n_cmpl")
    if body.n_cmpl > 1 and body.stream:
        raise oa.ApiError(400, "n_cmpl > 1 is answered whole: send stream: false", param="n_cmpl")
    return body.n_cmpl


async def _whole(request: Request, daemon: Daemon, body: ia.InfillRequest, gen: GenerationRequest, job: Job,
                 bridge: Bridge, index: int) -> dict[str, Any]:
    """One completion, answered whole."""
    first = await bridge.next(request, job)
    if first.kind == "error":
        raise job_error(first)
    answer = _Answer(daemon, body, gen, first, index)
    while True:
        ev = await bridge.next(request, job)
        if ev.kind == "error":
            raise job_error(ev)
        if ev.kind == "delta":
            answer.add(ev)
            if answer.cutoff.hit:
                job.cancel()
        elif ev.kind == "done":
            return answer.final(ev, stream=False)


def _generation_request(daemon: Daemon, body: ia.InfillRequest) -> GenerationRequest:
    limit = body.limit()
    h = check_speculation(daemon, body.homespec)
    try:
        # n_predict 0 evaluates the prompt (editors warm the cache with it): one token is
        # sampled, as generation needs one, and nothing of it is answered.
        return build_request(daemon.cfg, mode=h.speculation or Mode.AUTO, k=h.k, max_tokens=1 if limit == 0 else limit,
                             stop=body.stops(), samplers=body.chain(), **body.sampling())
    except UserError as e:
        raise oa.ApiError(400, str(e)) from None


class _Answer:
    """The answer so far: its text through the cutoffs, its token count, and how to end it."""

    def __init__(self, daemon: Daemon, body: ia.InfillRequest, gen: GenerationRequest, started: JobEvent,
                 index: int = 0) -> None:
        self.daemon, self.model, self.index = daemon, model_id(daemon.cfg), index
        self.quiet = body.limit() == 0  # n_predict 0: nothing is answered
        self.cutoff = ia.Cutoff(body.n_indent, body.t_max_predict_ms)
        self.fields = body.response_fields
        self.meta = started.extra
        self.prompt_tokens = int(started.extra.get("prompt_tokens", 0))
        self.tokens = 0
        self.t0 = time.perf_counter()
        p = gen.params
        self.settings = {
            "n_predict": 0 if self.quiet else gen.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
            "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repetition_penalty, "repeat_last_n": p.penalty_last_n,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "seed": -1 if p.seed is None else p.seed, "stop": list(gen.stop), "n_indent": body.n_indent,
            "t_max_predict_ms": body.t_max_predict_ms, "stream": body.stream, "n_ctx": daemon.n_ctx,
            "model": self.model, "speculation": str(self.meta.get("mode", "auto")),
            # the order followed: the one asked for, else homespec's own
            "samplers": chain if (chain := body.chain()) is not None else ["penalties", *(n for n in p.order if n != "infill")],
        }

    def add(self, ev: JobEvent) -> str:
        """The text of this delta that belongs to the answer."""
        if self.quiet or self.cutoff.hit:
            return ""
        self.tokens += ev.tokens
        return self.cutoff.push(ev.text)

    def partial(self, text: str) -> dict[str, Any]:
        return ia.partial_chunk(text, self.tokens, self.prompt_tokens)

    def final(self, ev: JobEvent, *, stream: bool) -> dict[str, Any]:
        st = ev.stats
        assert st is not None
        if self.quiet:
            st = dataclasses.replace(st, completion_tokens=0)
        extra = homespec_extra(self.daemon, st, self.meta)
        body = ia.final_body(self.cutoff.text, st, stream=stream, finish=ev.finish_reason, cut=self.cutoff.hit,
                             model=self.model, wall_s=time.perf_counter() - self.t0, settings=self.settings, homespec=extra)
        body["index"] = self.index  # which of n_cmpl
        return ia.select_fields(body, self.fields) if self.fields is not None else body


async def _stream(request: Request, bridge: Bridge, job: Job, answer: _Answer) -> AsyncIterator[dict]:
    """llama.cpp's stream: `data: {...}` per piece, then the final body; no [DONE]."""
    try:
        while True:
            ev = await bridge.next_or_cut(request)
            if ev is None:  # SIGTERM's drain bound: end with an error the client can read
                job.cancel()
                log.warning("request %s: stream cut at the drain timeout (server.drain_timeout_s)", job.id)
                yield {"data": json.dumps(shutting_down_error().body())}
                break
            if ev.kind == "delta":
                text = answer.add(ev)
                if text:
                    yield {"data": json.dumps(answer.partial(text))}
                if answer.cutoff.hit:
                    job.cancel()
            elif ev.kind == "error":
                yield {"data": json.dumps(job_error(ev).body())}
                break
            elif ev.kind == "done":
                yield {"data": json.dumps(answer.final(ev, stream=True))}
                break
    finally:
        job.cancel()  # a no-op when finished; stops the generation when the client left
