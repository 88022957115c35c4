"""Daemon faults (issue #12, 2): a failed reload, a racing stats ticker, requests cancelled in the
queue. The daemon is built with an injected opener and a fake host: no weights."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from homespec.config import Config
from homespec.errors import ModelError
from homespec.serving import daemon as daemon_mod
from homespec.serving.daemon import Daemon, Job, JobEvent, NotReady, QueueFull
from homespec.serving.host import GenerationRequest, Kept
from homespec.speculation.batch import Batch
from homespec.speculation.engine import Event, GenerationStats
from homespec.speculation.proposers.ngram_memory import NgramMemory

WAIT_S = 20.0  # seconds: an upper bound for the worker thread to get somewhere, not a timing check


def fake_steps(stats: GenerationStats) -> Iterator[Event]:
    """A generation that answers "hi" without a target pass (the Batch takes it as it comes)."""
    stats.prompt_tokens, stats.completion_tokens, stats.finish_reason = 3, 1, "stop"
    yield Event(text="hi", tokens=[5], step=None, finish_reason="stop")


class FakeHost:
    def __init__(self, view: Any = None) -> None:
        self.models = SimpleNamespace(draft=None, encode_chat=lambda m: [1, 2, 3], encode_text=lambda t: [1],
                                      template=SimpleNamespace(source=None),
                                      target=SimpleNamespace(fim_tokens=lambda: SimpleNamespace(missing=[])))
        self.controller = SimpleNamespace(view=view or SimpleNamespace(baseline_tps=None, effective_tps=None, speedup=None, k=0))
        self.warmup_s = 0.0
        self.closed = False
        self.saves = 0  # persist_prefixes calls
        self.ngram_memory: NgramMemory | None = None  # prompt lookup's memory of answers (off)
        self.batches: list[Batch] = []  # what batch() made, in order

    def warmup(self) -> None:
        pass

    def restore_prefixes(self, root: Any) -> Kept:
        return Kept(0, 0)  # no prefix cache

    def persist_prefixes(self, root: Any, budget_s: float | None = None) -> Kept:
        self.saves += 1  # (where: the state folder; prefix_store's tests write for real)
        return Kept(0, 0)

    slots = 1

    def pick_slot(self, tokens: list[int], free: list[int]) -> int:
        return free[0]

    def release_slot(self, slot: int, busy: list[int]) -> None:
        pass

    def batch(self, prefill_chunk: int, prefill_chunk_alone: int | None = None, top_priority: int | None = None) -> Batch:
        self.batches.append(Batch(lambda parts: [], n_batch=512, prefill_chunk=prefill_chunk, top_priority=top_priority))
        return self.batches[-1]

    def steps(self, tokens: list[int], req: GenerationRequest, slot: int, stats: GenerationStats) -> Iterator[Event]:
        return fake_steps(stats)

    def close(self) -> None:
        self.closed = True


def make_daemon(opener: Callable[..., Any], keep_alive_s: float | None = None) -> Daemon:
    cfg = Config()
    cfg.memory.keep_alive_s = keep_alive_s
    d = Daemon(cfg, opener=opener)
    d._plan = lambda: SimpleNamespace(load_draft=False, n_ctx=512)  # type: ignore[method-assign]  # no GGUF to read
    return d


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def submit(d: Daemon) -> queue.Queue[JobEvent]:
    events: queue.Queue[JobEvent] = queue.Queue()
    d.submit(Job(GenerationRequest(), sink=events.put, encode=lambda models: models.encode_chat([{"role": "user", "content": "hi"}])))
    return events


def final(events: queue.Queue[JobEvent]) -> JobEvent:
    while True:
        ev = events.get(timeout=WAIT_S)
        if ev.kind in ("done", "error"):
            return ev


def sample(d: Daemon, status: str) -> float | None:
    return d.metrics.registry.get_sample_value("homespec_requests_total", {"status": status})


def test_a_failed_reload_reports_the_reason_turns_unhealthy_and_the_next_request_retries() -> None:
    broken = {"now": False}

    def opener(cfg: Config, **kw: Any) -> FakeHost:
        if broken["now"]:
            raise ModelError("model.gguf: sha256 does not match the registry")
        return FakeHost()

    d = make_daemon(opener, keep_alive_s=0.01)
    d.start()
    try:
        wait_for(lambda: d.state == "unloaded", "the keep-alive unload")
        broken["now"] = True
        ev = final(submit(d))
        assert (ev.kind, ev.status, ev.code) == ("error", 503, "load_failed")
        assert "sha256 does not match" in ev.text
        assert d.state == "failed" and "sha256" in (d.error or "")
        assert not d.healthy()  # the watchdog stops pinging: systemd restarts a daemon that stays so
        assert sample(d, "load_failed") == 1
        broken["now"] = False
        ev = final(submit(d))  # accepted, not refused: this request retries the load
        assert (ev.kind, ev.finish_reason) == ("done", "stop")
        assert d.error is None and d.cold_loads == 1
    finally:
        d.shutdown(1.0)


def test_the_highest_priority_seen_outlives_an_unload_so_lone_prompts_stay_in_short_chunks_after_it() -> None:
    """A voice command seen before the models were unloaded may come again after they are loaded:
    the new batch starts knowing its priority (Batch's lone-prompt chunks, config.py)."""
    hosts: list[FakeHost] = []

    def opener(cfg: Config, **kw: Any) -> FakeHost:
        hosts.append(FakeHost())
        return hosts[-1]

    d = make_daemon(opener, keep_alive_s=0.05)
    d.start()
    try:
        wait_for(lambda: d.state == "unloaded", "the keep-alive unload")
        assert hosts[0].batches[-1].top_priority is None  # nobody has asked yet
        events: queue.Queue[JobEvent] = queue.Queue()
        d.submit(Job(GenerationRequest(), sink=events.put, priority=5,
                     encode=lambda models: models.encode_chat([{"role": "user", "content": "lights off"}])))
        assert final(events).kind == "done"
        wait_for(lambda: d.state == "unloaded", "the unload after the command")
        assert final(submit(d)).kind == "done"  # loads again: a new host, a new batch
        assert len(hosts) == 3 and hosts[-1].batches[-1].top_priority == 5
    finally:
        d.shutdown(1.0)


def test_a_failed_first_load_still_refuses_requests_with_the_reason() -> None:
    def opener(cfg: Config, **kw: Any) -> FakeHost:
        raise ModelError("model.gguf: not found")

    d = make_daemon(opener)
    d.start()
    try:
        wait_for(lambda: d.state == "failed", "the failed load")
        with pytest.raises(NotReady, match="failed to load: model.gguf: not found"):
            submit(d)
        assert not d.healthy()
    finally:
        d.shutdown(1.0)


class _Once:
    """time.sleep for the ticker: stops the loop after `n` rounds without waiting."""

    def __init__(self, d: Daemon, n: int) -> None:
        self.d, self.n = d, n

    def __call__(self, seconds: float) -> None:
        self.n -= 1
        if self.n <= 0:
            self.d._stop = True


def fake_time(monkeypatch: pytest.MonkeyPatch, d: Daemon, rounds: int) -> None:
    monkeypatch.setattr(daemon_mod, "time", SimpleNamespace(sleep=_Once(d, rounds), time=time.time, monotonic=time.monotonic))


class RacingDaemon(Daemon):
    """`session` reads follow a script: the keep-alive unload lands between two reads."""

    script: list[Any] = []

    @property  # type: ignore[override]
    def session(self) -> Any:
        return self.script.pop(0) if self.script else None

    @session.setter
    def session(self, value: Any) -> None:
        pass


def test_ticker_reads_the_session_once_so_an_unload_between_reads_is_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    view = SimpleNamespace(baseline_tps=10.0, effective_tps=12.0, speedup=1.2, k=3)
    d = RacingDaemon(Config(), opener=lambda c, **kw: FakeHost())
    host = FakeHost(view)
    host.ngram_memory = NgramMemory(4096)
    host.ngram_memory.add(list(range(20)), 10)  # an answer of 10 tokens after a prompt of 10
    RacingDaemon.script = [host, host, host, None]  # the 4th read (if any) sees the unload
    fake_time(monkeypatch, d, rounds=1)
    d._tick()  # before the fix: AttributeError, which killed the ticker thread
    assert d.metrics.registry.get_sample_value("homespec_spec_decode_k") == 3
    assert d.metrics.registry.get_sample_value("homespec_answer_memory_tokens") == 21  # with its separator


def test_ticker_survives_errors_and_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        @property
        def baseline_tps(self) -> float:
            raise RuntimeError("controller view broke")

    d = make_daemon(lambda c, **kw: FakeHost())
    d.session = FakeHost(Broken())  # type: ignore[assignment]
    fake_time(monkeypatch, d, rounds=3)
    with caplog.at_level(logging.ERROR, logger="homespec.serving.daemon"):
        d._tick()  # returns only because _stop was set: every round's error was caught
    assert [r.getMessage() for r in caplog.records] == ["stats ticker failed (logged once; it keeps running)"]


def test_a_request_cancelled_while_waiting_is_counted_and_logged() -> None:
    d = make_daemon(lambda c, **kw: FakeHost())
    d.session, d.state = FakeHost(), "ready"  # type: ignore[assignment]
    events: list[JobEvent] = []
    job = Job(GenerationRequest(), sink=events.append, encode=lambda models: models.encode_chat([{"role": "user", "content": "hi"}]))
    job.cancel()  # the client hung up before its turn
    d._start(job)
    assert events == []  # nobody is listening any more
    assert sample(d, "cancelled_in_queue") == 1
    rec = d.live.snapshot().requests[0]
    assert (rec.id, rec.status, rec.finish_reason) == (job.id, "cancelled", "cancelled_in_queue")
    assert d.live.snapshot().requests_served == 0


def test_a_request_cancelled_while_waiting_leaves_the_queue_at_once_and_its_place_is_free() -> None:
    d = make_daemon(lambda c, **kw: FakeHost())
    d.cfg.server.queue_depth, d.cfg.server.parallel = 1, 1
    d.session, d.state = FakeHost(), "ready"  # type: ignore[assignment]  # no worker: jobs stay queued
    jobs = [Job(GenerationRequest(), sink=lambda ev: None, encode=None) for _ in range(2)]
    for job in jobs:
        d.submit(job)
    with pytest.raises(QueueFull):
        d.submit(Job(GenerationRequest(), sink=lambda ev: None, encode=None))
    for job in jobs:
        job.cancel()  # both clients hung up while they waited
    assert d.queue_view() == (0, 0)
    assert sample(d, "cancelled_in_queue") == 2  # counted when they left, not when their turn came
    assert d.metrics.registry.get_sample_value("homespec_queue_waiting") == 0
    d.submit(Job(GenerationRequest(), sink=lambda ev: None, encode=None))  # their places are free again
    jobs[0].cancel()  # a second cancel of a withdrawn job changes nothing
    assert sample(d, "cancelled_in_queue") == 2 and d.queue_view() == (0, 1)


def test_http_health_is_503_with_the_reason_after_a_failed_reload_and_ok_again_after_recovery() -> None:
    import asyncio

    import httpx

    from homespec.serving.app import create_app

    broken = {"now": False}

    def opener(cfg: Config, **kw: Any) -> FakeHost:
        if broken["now"]:
            raise ModelError("model.gguf: sha256 does not match the registry")
        return FakeHost()

    async def get_health() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(d))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get("/health")

    d = make_daemon(opener, keep_alive_s=0.01)
    d.start()
    try:
        wait_for(lambda: d.state == "unloaded", "the keep-alive unload")
        assert asyncio.run(get_health()).status_code == 200
        broken["now"] = True
        final(submit(d))
        r = asyncio.run(get_health())
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert r.json()["status"] == "unhealthy" and "sha256" in r.json()["error"]
        broken["now"] = False
        final(submit(d))
        assert asyncio.run(get_health()).status_code == 200
    finally:
        d.shutdown(1.0)


def ready_daemon(slots: int = 4) -> Daemon:
    """A daemon whose (fake) models are loaded with `slots` KV sequences; the worker not started."""
    d = make_daemon(lambda c, **kw: FakeHost())
    host = FakeHost()
    host.slots = slots
    d.session, d.state = host, "ready"  # type: ignore[assignment]
    return d


def test_admission_starts_the_highest_priority_first_then_the_oldest_up_to_the_parallel_limit() -> None:
    d = ready_daemon()
    d.cfg.server.parallel = 2
    jobs = [Job(GenerationRequest(), sink=lambda ev: None, encode=lambda m: [1], priority=p) for p in (0, 0, 5, 1)]
    d._queue.extend(jobs)
    assert d._admit() == [jobs[2], jobs[3]]  # priority 5, then 1: two slots
    d._active = {j.id: SimpleNamespace(job=j, slot=i) for i, j in enumerate(jobs[2:4])}  # type: ignore[misc]
    assert d._admit() == []  # both slots busy: the rest waits
    d._active = {}
    assert d._admit() == [jobs[0], jobs[1]]  # equal priorities: the oldest first


def test_a_job_that_loads_or_unloads_the_models_runs_alone() -> None:
    d = ready_daemon()
    gen = Job(GenerationRequest(), sink=lambda ev: None, encode=lambda m: [1])
    unload = Job(GenerationRequest(), sink=lambda ev: None, encode=None, keep_alive_s=0)
    later = Job(GenerationRequest(), sink=lambda ev: None, encode=lambda m: [1])
    d._queue.extend([gen, unload, later])
    assert d._admit() == [gen]  # the unload waits for the running set to empty
    d._active = {gen.id: SimpleNamespace(job=gen, slot=0)}  # type: ignore[misc]
    assert d._admit() == []
    d._active = {}
    assert d._admit() == [unload]


def test_a_job_being_started_counts_as_running_in_the_queue_view() -> None:
    d = ready_daemon()
    job = Job(GenerationRequest(), sink=lambda ev: None, encode=lambda m: [1])
    d._queue.append(job)
    assert d._admit() == [job]
    assert d.queue_view() == (1, 0)  # admitted, not started yet (a cold load can take ~30 s)


def test_a_pending_draft_shed_stops_admission_until_the_running_set_drains() -> None:
    d = ready_daemon()
    running = Job(GenerationRequest(), sink=lambda ev: None, encode=lambda m: [1])
    d._active = {running.id: SimpleNamespace(job=running, slot=0)}  # type: ignore[misc]
    waiting = Job(GenerationRequest(), sink=lambda ev: None, encode=lambda m: [1])
    d._queue.append(waiting)
    d._pending_control.append("unload-draft")
    assert d._admit() == []  # slots are free, but the draft must go first
    d._active = {}
    assert d._admit() == [waiting]


def test_the_prefix_cache_is_written_once_after_requests_when_the_daemon_goes_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A power cut leaves no stop to write it in: it is also written when requests have come
    and the daemon then idles, once, not again until more come."""
    monkeypatch.setattr(daemon_mod, "IDLE_SAVE_S", 0.2)
    host = FakeHost()
    d = make_daemon(lambda cfg, **kw: host)
    d.start()
    try:
        wait_for(lambda: d.state == "ready", "the load")
        time.sleep(0.6)  # idle, but nothing came since the start: nothing to write
        assert host.saves == 0
        final(submit(d))
        wait_for(lambda: host.saves == 1, "the idle save")
        time.sleep(0.6)
        assert host.saves == 1
        final(submit(d))
        wait_for(lambda: host.saves == 2, "the idle save after the next request")
    finally:
        d.shutdown(1.0)
    assert host.saves == 3  # and at the stop
