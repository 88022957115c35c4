"""The model host behind the HTTP API: loads and warms the models, runs up to server.parallel
generations together from a priority queue (one target pass per round for all of them,
speculation/batch.py), keeps the models warm (or unloads them after keep_alive), watches memory
headroom, and publishes live stats.

It knows sessions and jobs, not HTTP: the server hands it a `Job` with a `sink` callback and
relays the `JobEvent`s it receives. Everything that touches llama.cpp runs on the single worker
thread, so runtimes are never used concurrently.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from homespec import __version__
from homespec.config import Config, Mode
from homespec.errors import UserError
from homespec.llama.gguf_info import read_gguf_info
from homespec.llama.runtime import Vocabulary
from homespec.models.derived import served_draft
from homespec.models.fetch import resolve_model_path, state_dir
from homespec.models.loader import ModelSet, flash_attention
from homespec.models.memory import LoadPlan, kv_cells, pair_footprints, plan_load, read_headroom
from homespec.models.memory_watch import HeadroomWatcher
from homespec.mtp.checkpoint import head_ram
from homespec.serving.host import GenerationRequest, Host, Kept
from homespec.serving.stats import LiveStats, Metrics
from homespec.serving.stats_schema import DaemonState, RequestRecord, RunningRequest
from homespec.speculation.batch import Batch
from homespec.speculation.engine import GRAMMAR_DEAD_END, Event, GenerationStats, PromptTooLong
from homespec.speculation.sampling import TokenLogprob
from homespec.speculation.target import Target

log = logging.getLogger("homespec.serving.daemon")


# Seconds a stop spends writing the prefix cache to disk at most: systemd's TimeoutStopSec
# leaves 25 s after the drain (systemd.STOP_MARGIN_S) for this, unloading and exiting.
PERSIST_BUDGET_S = 10.0
# The prefix cache is also written after this long idle, when requests came since the last
# save: a power cut or a SIGKILL leaves no stop to write it in. Only new histories are written.
IDLE_SAVE_S = 60.0


def prompt_cache_dir() -> Path:
    """Where the prefix cache is kept across restarts (memory.prefix_cache_persist)."""
    return state_dir() / "prompt-cache"



class QueueFull(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__("queue full")
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    def __init__(self, state: str, retry_after_s: float = 5.0) -> None:
        super().__init__(f"models are {state}")
        self.state, self.retry_after_s = state, retry_after_s


@dataclass
class JobEvent:
    kind: Literal["started", "delta", "done", "error"]
    text: str = ""
    tokens: int = 0  # tokens in this delta
    stats: GenerationStats | None = None
    finish_reason: str | None = None
    status: int = 200  # for "error": the HTTP status it maps to
    code: str | None = None  # for "error": a machine-readable code
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # for "delta": of the tokens its text shows
    pieces: dict[int, bytes] = field(default_factory=dict)  # the bytes of every token id in logprobs


@dataclass(eq=False)  # a job is itself: the queue finds and removes it by identity
class Job:
    request: GenerationRequest
    sink: Callable[[JobEvent], None]  # called from the worker thread
    # The prompt, built on the worker thread from the models loaded then (they may be
    # unloaded while the job waits): chat through the template, raw text, infill pieces.
    # None: nothing to generate; the job only loads the models (Ollama's empty request), or
    # unloads them when keep_alive_s is 0.
    encode: Callable[[ModelSet], list[int]] | None
    timeout_s: float = 600.0
    # How long the models stay loaded once this job ends (Ollama's per-request keep_alive):
    # None = memory.keep_alive_s, math.inf = until told otherwise, 0 = unload at once.
    keep_alive_s: float | None = None
    # Higher first: admitted before lower ones, its prompt read first (X-Homespec-Priority).
    priority: int = 0
    # The request field its prompt came from ("messages", "prompt"): a refusal of the prompt
    # (too long for the context, not text) names it as the error's param. None: not one field.
    prompt_param: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    created: float = field(default_factory=time.time)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set by Daemon.submit: takes a job cancelled while it waits out of the queue at once.
    on_cancel: Callable[[Job], None] | None = field(default=None, repr=False, compare=False)

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)


@dataclass
class _Active:
    """A job generating now, in KV sequence `slot`."""

    job: Job
    slot: int
    stats: GenerationStats
    mode: Mode
    cold: bool
    t0: float  # perf_counter when it started
    deadline: float  # monotonic


class Daemon:
    def __init__(self, cfg: Config, opener: Callable[..., Host] | None = None) -> None:
        self.cfg = cfg
        # opener(cfg, with_draft=..., n_ctx=...) -> an un-warmed Host (tests inject fakes)
        self._open = opener or (lambda c, **kw: Host.open(c, calibrate=False, **kw))
        self.plan: LoadPlan | None = None
        self.watcher: HeadroomWatcher | None = None
        self._pending_control: collections.deque[str] = collections.deque()  # "unload-draft" | "reload-draft"
        self.session: Host | None = None
        self.state: DaemonState = "loading"
        self.error: str | None = None
        self.mode: Mode = cfg.speculation.mode  # what requests that name no mode get
        self.started = time.time()
        self.live = LiveStats()
        self.metrics = Metrics()
        self.footprints: tuple[Any, Any] = (None, None)  # (target, draft) memory.Footprint at the planned n_ctx
        self.slots = cfg.server.parallel  # KV sequences the plan found room for
        self.load_s: float | None = None
        self.warmup_s: float | None = None
        # The target's chat template, kept from the last load (the model may be unloaded after
        # keep_alive): requests with tools need its call format before they queue.
        self.template_source: str | None = None
        self.can_infill: bool | None = None  # the target has FIM tokens (None: not loaded yet)
        self._vocabulary: Vocabulary | None = None  # the target's tokenizer alone (vocabulary())
        self._vocabulary_lock = threading.Lock()
        self.cold_loads = 0
        self.memory_events: collections.deque[str] = collections.deque(maxlen=20)
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._active: dict[str, _Active] = {}  # job id -> the jobs generating now
        self._starting: dict[str, Job] = {}  # admitted, being started (a load may take ~30 s)
        self._batch: Batch | None = None  # drives them (one per loaded session)
        self._top_priority: int | None = None  # the highest priority the batches so far have seen (Batch.top_priority)
        self.mean_batch_rows: float | None = None  # tokens per target pass, EWMA over ~10 passes
        self._accepting = True
        self._stop = False
        self._last_active = time.monotonic()
        self._saved_at = self._last_active  # when the prefix cache was last written to disk
        # Seconds idle before unloading, None = never: the last job's keep_alive (as Ollama's
        # last request decides), memory.keep_alive_s when it named none.
        self._keep_alive_s: float | None = cfg.memory.keep_alive_s
        self._mean_request_s = 10.0  # for Retry-After; refined from real requests
        self._worker = threading.Thread(target=self._work, name="homespec-worker", daemon=True)
        self._ticker = threading.Thread(target=self._tick, name="homespec-ticker", daemon=True)
        self.on_ready: Callable[[], None] = lambda: None  # e.g. sd_notify READY=1
        self.on_failed: Callable[[Exception], None] = lambda e: None  # e.g. stop serving, exit non-zero
        self._progress = time.monotonic()  # last sign of life of the worker (step, load, idle)
        # A reload (after keep_alive) failed: the worker lives on, so the next request retries.
        # The first load failing stops the daemon instead (on_failed): nothing was ever served.
        self._retry_load = False
        self._tick_failed = False  # the ticker logged an error already: log it once, not every second

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Load and warm up in the background; /ready turns true when done."""
        self._worker.start()
        self._ticker.start()

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work, fail what is waiting, let the running job finish."""
        with self._cv:
            self._accepting = False
            self.state = "stopping"
            waiting = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for job in waiting:
            job.sink(JobEvent("error", text="the daemon is shutting down", status=503, code="shutting_down"))

    def shutdown(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the running job, then cancel it. True if it finished."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (self._active or self._starting) and time.monotonic() < deadline:
                self._cv.wait(0.1)
            finished = not (self._active or self._starting)
            for job in [*(a.job for a in self._active.values()), *self._starting.values()]:
                job.cancel()
            self._stop = True
            self._cv.notify_all()
        self._worker.join(timeout=10)
        if self.watcher is not None:
            self.watcher.stop()
        if self.session is not None:
            self._persist_prefixes(self.session)
            self.session.close()
            self.session = None
        return finished

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def n_ctx(self) -> int:
        """Tokens of context a request gets: the load plan's (memory may have shrunk the
        configured one), else the config's."""
        return self.plan.n_ctx if self.plan else self.cfg.runtime.n_ctx

    def vocabulary(self) -> Vocabulary:
        """The target's tokenizer, read on first use (/tokenize, /detokenize) and kept: it does
        not wait for the worker and stays when the model is unloaded after keep_alive."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(resolve_model_path(self.cfg, self.cfg.models.target))
            return self._vocabulary

    def healthy(self, stall_s: float = 120.0) -> bool:
        """For the systemd watchdog: the worker lives and makes progress. A prefill chunk of 512
        tokens takes ~13 s on 2 cores, a load plus warm-up ~30 s; no step for stall_s means hung.
        A failed load (at start or a reload after keep_alive) is unhealthy until a load succeeds."""
        dead = self._worker.ident is not None and not self._worker.is_alive()  # started, then died
        if self.state == "failed" or dead:
            return False
        return time.monotonic() - self._progress < stall_s

    # -- requests -------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job, or raise NotReady / QueueFull. Events go to job.sink."""
        with self._cv:
            if not self._accepting:
                raise NotReady("shutting down", retry_after_s=30)
            if self.state in ("loading", "warming"):
                raise NotReady(self.state, retry_after_s=5)
            if self.state == "failed" and not (self._retry_load and self._worker.is_alive()):
                raise NotReady(f"failed to load: {self.error}", retry_after_s=60)
            # Room for the running jobs plus queue_depth waiting. Count them together: a job the
            # worker has not popped yet is about to run, so whether it still sits in the queue
            # (a thread-scheduling race) must not decide between 200 and 429.
            in_system = len(self._queue) + len(self._active) + len(self._starting)
            if in_system >= self.cfg.server.queue_depth + self.cfg.server.parallel:
                raise QueueFull(retry_after_s=self._mean_request_s * (len(self._queue) + 1) / self.cfg.server.parallel)
            job.on_cancel = self._withdraw
            self._queue.append(job)
            self.metrics.queue_waiting.set(len(self._queue))
            self._cv.notify_all()

    def set_mode(self, mode: str) -> None:
        if mode not in self.available_modes():
            raise UserError(f"mode {mode!r} not available; choose one of {', '.join(self.available_modes())}")
        self.mode = Mode(mode)
        log.info("speculation mode set to %s", mode)

    def available_modes(self) -> list[str]:
        """In Mode's order (the dashboard cycles through them). Unloaded: ngram needs no model."""
        if self.session is not None:
            return [m.value for m in self.session.available_modes()]
        return [m.value for m in (Mode.AUTO, Mode.NGRAM, Mode.OFF)]

    def queue_view(self) -> tuple[int, int]:
        with self._cv:
            return len(self._active) + len(self._starting), len(self._queue)

    # -- worker ---------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self._load(cold=False)
        except Exception as e:  # a daemon that cannot load must say why, not die silently
            log.error("loading models failed: %s", e, exc_info=not isinstance(e, UserError))
            self.state, self.error = "failed", str(e)
            self.on_failed(e)
            return
        try:
            while True:
                save = False
                with self._cv:
                    while not self._queue and not self._active and not self._stop:
                        self._progress = time.monotonic()
                        self._apply_control()
                        self._maybe_unload()  # before waiting: keep_alive 0 unloads at once
                        if save := self._save_due():
                            break
                        self._cv.wait(1.0)
                    if self._stop:
                        return
                if save and self.session is not None:  # (outside the lock: a request meanwhile queues)
                    self._persist_prefixes(self.session)
                    continue
                with self._cv:
                    if not self._active:  # the draft is shed or taken back between generations
                        self._apply_control()
                    admitted = self._admit()
                    self.metrics.queue_waiting.set(len(self._queue))
                for job in admitted:
                    self._guarded(job, self._start)
                if self._active:
                    self._guarded_round()
        finally:
            self._end_all("the daemon is shutting down")

    def _admit(self) -> list[Job]:
        """Jobs to start now (lock held): the highest priority first, then the oldest, while
        slots are free. A job that loads or unloads the models runs alone, as does the first
        job after an unload (it loads them)."""
        out: list[Job] = []
        while self._queue:
            job = max(self._queue, key=lambda j: j.priority)  # max keeps the first (oldest) of equals
            busy = len(self._active) + len(out)
            alone = job.encode is None or self.session is None
            if busy and (alone or busy >= self.parallel() or self._pending_control):
                break  # (a pending draft shed or reload waits for the running set to drain)
            self._queue.remove(job)
            self._starting[job.id] = job
            out.append(job)
            if alone:
                break
        return out

    def parallel(self) -> int:
        """Requests that may generate together now (one until the models are loaded)."""
        session = self.session
        return min(self.cfg.server.parallel, session.slots) if session is not None else 1

    def running_view(self) -> list[RunningRequest]:
        """The running set, for /v1/homespec/stats (read from the HTTP thread)."""
        with self._cv:
            active = list(self._active.values())
        now = time.perf_counter()
        out = []
        for a in active:
            st = a.stats
            decoding = now - a.t0 - st.ttft_s if st.ttft_s else 0.0
            out.append(RunningRequest(
                id=a.job.id, slot=a.slot, priority=a.job.priority, mode=a.mode, prompt_tokens=st.prompt_tokens,
                completion_tokens=st.completion_tokens, age_s=round(now - a.t0, 2),
                tok_s=(st.completion_tokens - 1) / decoding if decoding > 0 and st.completion_tokens > 1 else None,
            ))
        return out

    def _guarded(self, job: Job, fn: Callable[[Job], None]) -> None:
        """Never let one request kill the worker: a failure ends only it."""
        try:
            fn(job)
        except Exception as e:
            log.exception("request %s failed", job.id)
            self._drop(job.id)
            job.sink(JobEvent("error", text=f"internal error: {e}", status=500, code="internal_error"))
            self._job_ended(job)

    def _guarded_round(self) -> None:
        try:
            self._round()
        except Exception as e:  # a failed pass, or a bug outside any one request: end the running set
            log.exception("a round failed")
            for a in list(self._active.values()):
                self._drop(a.job.id)
                a.job.sink(JobEvent("error", text=f"internal error: {e}", status=500, code="internal_error"))
                self._job_ended(a.job)

    def _job_ended(self, job: Job) -> None:
        with self._cv:
            self._starting.pop(job.id, None)
            a = self._active.pop(job.id, None)
            busy = [x.slot for x in self._active.values()]
        if a is not None and self.session is not None:
            self.session.release_slot(a.slot, busy)  # on the worker thread, as every llama.cpp call
        with self._cv:
            self._last_active = time.monotonic()
            self._keep_alive_s = self._keep_alive_after(job)
            self.metrics.queue_running.set(len(self._active))
            self._cv.notify_all()

    def _drop(self, job_id: str) -> None:
        if self._batch is not None:
            self._batch.remove(job_id)

    def _end_all(self, why: str) -> None:
        """The worker stops: jobs cancelled by shutdown() end as cancelled (as between steps),
        any other one with an error saying why."""
        for a in list(self._active.values()):
            if a.job.cancelled.is_set():
                self._finish(a, "cancelled")
                continue
            self._drop(a.job.id)
            a.job.sink(JobEvent("error", text=why, status=503, code="shutting_down", stats=a.stats))
            self._job_ended(a.job)

    def _plan(self) -> LoadPlan:
        """memory.policy applied to the estimated footprints; raises InsufficientMemory."""
        cfg = self.cfg
        target = read_gguf_info(resolve_model_path(cfg, cfg.models.target))
        # The file the draft is served from: its own size and types.
        draft = read_gguf_info(served_draft(cfg, cfg.models.draft)) if cfg.models.draft else None
        at = pair_footprints(
            target,
            draft,
            n_batch=cfg.runtime.n_batch,
            target_gpu_layers=cfg.models.target.n_gpu_layers,
            draft_gpu_layers=cfg.models.draft.n_gpu_layers if cfg.models.draft else 0,
            target_extra_ram=head_ram(cfg.resolve(cfg.models.mtp)) if cfg.models.mtp else 0,
            # The compute buffer depends on it; llama.cpp's auto (GPU) enables it where the
            # backend supports it, so only an explicit off plans for the buffer without it.
            flash_attn=flash_attention(cfg.runtime, cfg.models.target.n_gpu_layers) is not False,
            target_kv_type=cfg.runtime.kv_type,
        )
        # Each request decoding at once has a KV sequence of n_ctx. Fewer slots are the smallest
        # loss when memory is short: first the most slots that fit the configured models as they
        # are, then one slot under memory.policy (shrink the context, drop the draft, refuse).
        headroom = read_headroom()
        as_configured = cfg.memory.model_copy(update={"policy": "refuse"})
        for slots in range(cfg.server.parallel, 0, -1):
            def at_slots(n_ctx: int, slots: int = slots) -> tuple[Any, Any]:
                return at(kv_cells(n_ctx, slots, cfg.runtime.kv_unified))

            plan = plan_load(at_slots, headroom, as_configured if slots > 1 else cfg.memory, n_ctx=cfg.runtime.n_ctx)
            if plan.decision != "refuse":
                break
        plan.require()
        if slots < cfg.server.parallel:
            log.warning("memory: %d of server.parallel %d requests can decode at once", slots, cfg.server.parallel)
        self.slots = slots
        self.footprints = at_slots(plan.n_ctx)
        return plan

    def _watch(self, plan: LoadPlan) -> None:
        """Shed the draft below the reserve, take it back when room returns (between jobs)."""
        draft_fp = self.footprints[1]
        if draft_fp is None or self.watcher is not None:
            return
        self.watcher = HeadroomWatcher(
            self.cfg.memory,
            draft_fp,
            on_unload_draft=lambda: self._control("unload-draft"),
            on_reload_draft=lambda: self._control("reload-draft"),
            draft_loaded=plan.load_draft,
        )
        self.watcher.start()

    def _control(self, action: str) -> None:
        # Runs on the watcher thread: llama.cpp objects belong to the worker, which applies the
        # action before its next job (a running generation keeps its draft until it ends).
        with self._cv:
            self._pending_control.append(action)
            self._cv.notify_all()

    def _apply_control(self) -> None:
        while self._pending_control and self.session is not None:
            action = self._pending_control.popleft()
            if action == "unload-draft":
                self.session.unload_draft()
                self.metrics.model_loaded.labels("draft").set(0)
            else:
                self.session.reload_draft()
                self.metrics.model_loaded.labels("draft").set(1 if self.session.models.draft else 0)

    def _load(self, cold: bool) -> None:
        self.state = "loading"
        t0 = time.perf_counter()
        self.plan = plan = self._plan()
        session = self._open(self.cfg, with_draft=plan.load_draft, n_ctx=plan.n_ctx, slots=self.slots)
        self.load_s = time.perf_counter() - t0
        self.state = "warming"
        self._progress = time.monotonic()
        try:
            session.warmup()
        except BaseException:
            session.close()  # a half-ready session must not hold the models' memory
            raise
        self._restore_prefixes(session)
        self._progress = time.monotonic()
        self.warmup_s = session.warmup_s
        self.template_source = session.models.template.source
        self.can_infill = not session.models.target.fim_tokens().missing
        self.session = session
        self._batch = session.batch(self.cfg.server.prefill_chunk, self.cfg.server.prefill_chunk_alone, self._top_priority)
        self.cold_loads += cold
        self.state, self.error, self._retry_load = "ready", None, False
        self.metrics.warm.set(1)
        self.metrics.model_loaded.labels("target").set(1)
        self.metrics.model_loaded.labels("draft").set(1 if session.models.draft is not None else 0)
        log.info("ready: load %.1f s, warm-up %.1f s%s", self.load_s, self.warmup_s, " (cold start)" if cold else "")
        self._watch(plan)
        self.on_ready()

    def _keep_alive_after(self, job: Job) -> float | None:
        ka = job.keep_alive_s
        if ka is None:
            return self.cfg.memory.keep_alive_s
        return None if math.isinf(ka) else ka

    def _maybe_unload(self) -> None:
        """keep_alive: unload after an idle period (called with the lock held, worker idle)."""
        ka = self._keep_alive_s
        if ka is None or self.session is None or self.state != "ready":
            return
        if time.monotonic() - self._last_active >= ka:
            self._unload(f"idle for {ka:.0f} s" if ka else "keep_alive 0")

    def _unload(self, why: str) -> None:
        if self.session is None:
            return
        log.info("%s: unloading models", why)
        if self._batch is not None:
            self._top_priority = self._batch.top_priority  # a voice command seen once may come again after the reload
            self._batch.close()
            self._batch = None
        # State first: a reader that finds no session (ps, loaded) must also find "unloaded", and
        # dropping the session frees the models and the prefix cache's memory, which takes a while.
        self.state = "unloaded"
        self._persist_prefixes(self.session)
        self.session.close()
        self.session = None
        self.metrics.warm.set(0)
        self.metrics.model_loaded.labels("target").set(0)
        self.metrics.model_loaded.labels("draft").set(0)

    def _restore_prefixes(self, session: Host) -> None:
        """The conversation caches and answers the last run left on disk."""
        self._prompt_cache_io("read back", session.restore_prefixes)

    def _save_due(self) -> bool:
        """The prefix cache is to be written now: idle for IDLE_SAVE_S after requests that came
        since the last save (worker idle, lock held)."""
        return (self.cfg.memory.prefix_cache_persist and self.session is not None and self.state == "ready"
                and self._last_active > self._saved_at and time.monotonic() - self._last_active >= IDLE_SAVE_S)

    def _persist_prefixes(self, session: Host) -> None:
        """Write the conversation caches and answers for the next start."""
        self._saved_at = time.monotonic()
        if self.state != "failed":
            self._prompt_cache_io("kept for the next start", lambda root: session.persist_prefixes(root, PERSIST_BUDGET_S))

    def _prompt_cache_io(self, done: str, io: Callable[[Path], Kept]) -> None:
        """One transfer of the prompt cache between memory and disk (memory.prefix_cache_persist).
        A failure (a full disk, a read-only or unreadable state folder) costs a cold start later,
        no more: it is logged, and the start or stop goes on."""
        if not self.cfg.memory.prefix_cache_persist:
            return
        t0 = time.perf_counter()
        try:
            kept = io(prompt_cache_dir())
        except (OSError, ValueError) as e:
            log.warning("prompt cache on disk (%s): %s", prompt_cache_dir(), e)
            return
        if any(kept):
            log.info("prefix cache: %d conversation(s) and %d answer(s) %s in %.1f s",
                     kept.histories, kept.answers, done, time.perf_counter() - t0)

    def loaded(self) -> bool:
        return self.session is not None and self.state == "ready"

    def expires_at(self) -> float | None:
        """When idle models will be unloaded (epoch seconds): math.inf = never, None = not loaded."""
        if not self.loaded():
            return None
        ka = self._keep_alive_s
        if ka is None:
            return math.inf
        busy = bool(self._active)
        idle_from = time.monotonic() if busy else self._last_active
        return time.time() + (idle_from + ka - time.monotonic())

    def _start(self, job: Job) -> None:
        """Load the models if they are not, encode the prompt, and add the job to the batch."""
        t0 = time.perf_counter()
        self._progress = time.monotonic()
        if job.cancelled.is_set():  # the client left while the job waited for its turn
            self._record_abandoned(job)
            self._job_ended(job)
            return
        if job.encode is None and job.keep_alive_s == 0:  # Ollama's "unload now" (`ollama stop`)
            self._unload("a request asked (keep_alive 0)")
            job.sink(JobEvent("started", extra={"prompt_tokens": 0, "cold": False, "load_s": 0.0}))
            job.sink(JobEvent("done", finish_reason="unload"))
            self._job_ended(job)
            return
        cold = self.session is None
        if cold:
            try:
                self._load(cold=True)
            except Exception as e:
                self._reload_failed(job, e)
                self._job_ended(job)
                return
        load_s = time.perf_counter() - t0  # seconds this job waited for the models
        if job.encode is None:  # Ollama's empty request: load the models, generate nothing
            job.sink(JobEvent("started", extra={"prompt_tokens": 0, "cold": cold, "load_s": load_s}))
            job.sink(JobEvent("done", finish_reason="load"))
            self._job_ended(job)
            return
        session, batch = self.session, self._batch
        assert session is not None and batch is not None
        req = job.request
        if req.mode == Mode.AUTO and self.mode != Mode.AUTO:
            req = dataclasses.replace(req, mode=self.mode)
        stats = GenerationStats()
        try:
            tokens = job.encode(session.models)
            free = sorted(set(range(session.slots)) - {a.slot for a in self._active.values()})
            slot = session.pick_slot(tokens, free)
            steps = session.steps(tokens, req, slot, stats)
        except PromptTooLong as e:  # the daemon's own setting: say where it is set (a client's num_ctx is not)
            return self._refuse(job, f"{e}; the daemon's context is runtime.n_ctx in its config", "context_length_exceeded",
                                job.prompt_param)
        except UserError as e:
            return self._refuse(job, str(e), "invalid_request", e.param)
        except UnicodeEncodeError as e:  # JSON may carry lone surrogates ("\ud800"): not text
            return self._refuse(job, f"text is not valid Unicode: {e.reason} at position {e.start}", "invalid_request",
                                job.prompt_param)
        job.sink(JobEvent("started", extra={"prompt_tokens": len(tokens), "cold": cold, "mode": req.mode, "load_s": load_s}))
        self.metrics.queue_wait.labels(str(job.priority)).observe(max(0.0, time.time() - job.created - load_s))
        a = _Active(job, slot, stats, req.mode, cold, t0, time.monotonic() - load_s + job.timeout_s)
        with self._cv:
            self._starting.pop(job.id, None)
            self._active[job.id] = a
            self.metrics.queue_running.set(len(self._active))
        for ev in batch.add(job.id, steps, job.priority):
            self._deliver(a, ev)

    def _refuse(self, job: Job, text: str, code: str, param: str | None = None) -> None:
        job.sink(JobEvent("error", text=text, status=400, code=code, extra={"param": param} if param else {}))
        self._job_ended(job)

    def _round(self) -> None:
        """One target pass for every running job; relay what it produced, end what is done."""
        batch = self._batch
        assert batch is not None
        batch.step(self._relay)  # a failed pass leaves no request in a known state: _guarded_round
        self._progress = time.monotonic()
        if batch.last is not None:
            self.metrics.batch_sequences.observe(batch.last.sequences)
            self.metrics.batch_rows.observe(batch.last.rows)
            self.mean_batch_rows = (batch.last.rows if self.mean_batch_rows is None
                                    else self.mean_batch_rows + 0.1 * (batch.last.rows - self.mean_batch_rows))
        for key, e in batch.take_failures():
            a = self._active.get(str(key))
            if a is not None:
                log.error("request %s failed: %r", key, e, exc_info=e)
                a.job.sink(JobEvent("error", text=f"internal error: {e}", status=500, code="internal_error", stats=a.stats))
                self._job_ended(a.job)
        now = time.monotonic()
        for a in list(self._active.values()):
            if a.job.id not in batch:  # it ended and _deliver finished it, or it never started
                continue
            if a.job.cancelled.is_set():
                self._guarded(a.job, lambda job, a=a: self._finish(a, "cancelled"))
            elif now > a.deadline:
                self._guarded(a.job, lambda job, a=a: self._finish(a, "timeout"))

    def _relay(self, key: Hashable, ev: Event) -> None:
        """An event of the running set, as the round produces it (Batch.step)."""
        a = self._active.get(str(key))
        if a is not None:
            self._guarded(a.job, lambda job: self._deliver(a, ev))

    def _deliver(self, a: _Active, ev: Event) -> None:
        session = self.session
        assert session is not None
        if ev.step is not None:
            self.live.add_step(ev.step, session.controller.view.baseline_tps)
            self.metrics.observe_step(ev.step)
        finish = None if ev.finish_reason == GRAMMAR_DEAD_END else ev.finish_reason  # an error, not an end: _finish says so
        a.job.sink(JobEvent("delta", text=ev.text, tokens=len(ev.tokens), finish_reason=finish,
                            logprobs=ev.logprobs, pieces=_pieces(ev.logprobs, session.models.target) if ev.logprobs else {}))
        if ev.finish_reason:
            self._finish(a, "ok")

    def _finish(self, a: _Active, status: str) -> None:
        """The job ends (its last event, or cancelled, or timed out): stop it at this step (its
        caches stay consistent), say so, and record it."""
        self._drop(a.job.id)
        st, job = a.stats, a.job
        if status == "timeout":
            job.sink(JobEvent("error", text=f"request timed out after {job.timeout_s:.0f} s", status=504, code="timeout", stats=st))
        elif st.finish_reason == GRAMMAR_DEAD_END:  # the client's grammar or schema: a 400, with the reason
            job.sink(JobEvent("error", text=f"the answer could not go on under its grammar or schema after {st.completion_tokens} "
                              "tokens: it allows no complete text from there (a property whose schema refers only to "
                              "itself?)", status=400, code=GRAMMAR_DEAD_END, stats=st))
            status = "error"  # (its finish_reason says which)
        else:
            job.sink(JobEvent("done", stats=st, finish_reason=st.finish_reason or status, extra={"cold": a.cold}))
        seconds = time.perf_counter() - a.t0
        self._mean_request_s += 0.2 * (seconds - self._mean_request_s)
        self._record(job, st, status, a.cold, a.mode)
        self.metrics.observe_request(status, st, seconds)
        self._job_ended(job)

    def _reload_failed(self, job: Job, e: Exception) -> None:
        """A load after keep_alive failed: say why to this request and to /health (unhealthy, so
        the systemd watchdog restarts us), and let the next request try again."""
        log.error("reloading models failed: %s", e, exc_info=not isinstance(e, UserError))
        with self._cv:
            self.state, self.error, self._retry_load = "failed", str(e), True
        self.metrics.warm.set(0)
        self.metrics.requests.labels("load_failed").inc()
        job.sink(JobEvent("error", text=f"models failed to load: {e}", status=503, code="load_failed"))

    def _withdraw(self, job: Job) -> None:
        """A client left while its job waited: out of the queue now, so that a dead request
        neither holds a place that gets others a 429 nor waits to be counted."""
        with self._cv:
            if job not in self._queue:
                return  # started (its step sees the cancel) or already gone
            self._queue.remove(job)
            self.metrics.queue_waiting.set(len(self._queue))
            self._cv.notify_all()
        self._record_abandoned(job)

    def _record_abandoned(self, job: Job) -> None:
        """A job cancelled while queued: it never ran, but it leaves a trace in the log and metrics."""
        waited = time.time() - job.created  # seconds
        log.info("request %s cancelled after %.1f s in the queue", job.id, waited)
        self.metrics.requests.labels("cancelled_in_queue").inc()
        self.live.add_abandoned(
            RequestRecord(id=job.id, time=job.created, mode=job.request.mode, status="cancelled", finish_reason="cancelled_in_queue")
        )

    def _record(self, job: Job, st: GenerationStats, status: str, cold: bool, mode: str) -> None:
        baseline = self.session.controller.view.baseline_tps if self.session else None
        tps = st.decode_tps
        self.live.add_request(
            RequestRecord(
                id=job.id,
                time=job.created,
                mode=mode,
                prompt_tokens=st.prompt_tokens,
                cached_tokens=st.cached_tokens,
                completion_tokens=st.completion_tokens,
                ttft_s=st.ttft_s or None,
                tok_s=tps,
                speedup=(tps / baseline) if (tps and baseline) else None,
                status=status,  # type: ignore[arg-type]
                finish_reason=st.finish_reason,
                cold=cold,
            ),
            st,
        )

    def _tick(self) -> None:
        """Once a second: close the speed bucket and refresh memory gauges. Never dies: an error
        is logged once and the next second tries again."""
        while not self._stop:
            try:
                self._tick_once()
            except Exception:
                if not self._tick_failed:
                    log.exception("stats ticker failed (logged once; it keeps running)")
                    self._tick_failed = True
            time.sleep(1.0)

    def _tick_once(self) -> None:
        # One read: the worker may unload the session (keep_alive) between two reads.
        session = self.session
        v = session.controller.view if session is not None else None
        self.live.tick(v.baseline_tps if v is not None else None)
        vm = psutil.virtual_memory()
        self.metrics.ram_available.set(vm.available)
        self.metrics.ram_reserve.set(self.cfg.memory.reserve_mib * 2**20)
        memory = session.ngram_memory if session is not None else None
        self.metrics.answer_memory_tokens.set(len(memory) if memory is not None else 0)
        if v is not None:
            if v.effective_tps:
                self.metrics.tokens_per_second.set(v.effective_tps)
            if v.baseline_tps:
                self.metrics.baseline_tokens_per_second.set(v.baseline_tps)
            if v.speedup:
                self.metrics.speedup.set(v.speedup)
            self.metrics.draft_k.set(v.k)

    def uptime(self) -> float:
        return time.time() - self.started

    def version(self) -> str:
        return __version__


def _pieces(logprobs: list[TokenLogprob], target: Target) -> dict[int, bytes]:
    """Token id -> bytes for the tokens a delta's logprobs name (special tokens spelled out),
    read here on the worker thread: llama.cpp objects are only touched from it."""
    ids = {lp.token for lp in logprobs} | {t for lp in logprobs for t, _ in lp.top}
    return {t: target.piece(t, special=True) for t in ids}
