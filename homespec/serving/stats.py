"""Rolling aggregates for the dashboard and Prometheus metrics for scrapers.

Two views of the same events: `LiveStats` keeps short windows (the last steps, the last
requests, one speed point per second) for /v1/homespec/stats; `Metrics` keeps monotonic
counters and histograms in a prometheus-client registry for /metrics, named as vLLM names its
speculative-decoding metrics (spec_decode_num_drafts, ..._num_draft_tokens,
..._num_accepted_tokens, ..._num_accepted_tokens_per_pos).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from homespec.serving.stats_schema import RequestRecord, SpeedPoint
from homespec.speculation.engine import OFF, GenerationStats, StepStats, StepTally

STEP_WINDOW = 256  # steps in the rolling acceptance / timing window
REQUEST_WINDOW = 20  # recent requests shown
HISTORY_POINTS = 120  # one speed point per second: two minutes of sparkline


@dataclass
class _Bucket:
    """Tokens and seconds of steps that ended within one second."""

    t: float
    tokens: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LiveSnapshot:
    """What `LiveStats.snapshot()` returns: copies of the windows and counters, taken under the
    lock, plus aggregates over the step window. Counters count since start or the last reset."""

    requests: list[RequestRecord]  # the last REQUEST_WINDOW requests, most recent first
    history: list[SpeedPoint]  # one point per second, oldest first, the last HISTORY_POINTS
    tokens_generated: int  # tokens emitted by all steps
    requests_served: int  # requests that ran to an end: ok, cancelled or timed out
    cache_lookups: int  # requests looked up in the prefix cache
    cache_hits: int  # lookups that reused at least one cached prompt token
    tokens_reused: int  # prompt tokens whose KV cache was reused
    tokens_evaluated: int  # prompt tokens evaluated afresh
    acceptance_rate: float | None  # accepted / proposed, 0..1 (None: nothing proposed)
    acceptance_length: float | None  # tokens emitted per step, >= 1 (None: no steps)
    per_position: list[float]  # P(accepted | reached) at draft positions 1.., 0..1, rounded to 4 places
    draft_ms: float | None  # mean drafting time per step, milliseconds (None: no steps)
    verify_ms: float | None  # mean verifying time per step, milliseconds (None: no steps)
    draft_share: float | None  # drafting / (drafting + verifying) time, 0..1 (None: no time yet)
    tok_s: float | None  # emitted tokens per second of step time over the last 64 steps (None: idle)
    chosen: dict[str, int]  # "proposer:k" -> steps, e.g. "ngram:4"


class LiveStats:
    """Thread-safe rolling windows; the worker thread writes, HTTP handlers read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.steps: deque[StepStats] = deque(maxlen=STEP_WINDOW)
            self.requests: deque[RequestRecord] = deque(maxlen=REQUEST_WINDOW)
            self.history: deque[SpeedPoint] = deque(maxlen=HISTORY_POINTS)
            self._bucket: _Bucket | None = None
            self.tokens_generated = 0
            self.requests_served = 0
            self.cache_lookups = 0
            self.cache_hits = 0
            self.tokens_reused = 0
            self.tokens_evaluated = 0

    def add_step(self, step: StepStats, baseline_tps: float | None) -> None:
        now = time.time()
        with self._lock:
            self.steps.append(step)
            self.tokens_generated += step.emitted
            b = self._bucket
            if b is None or now - b.t >= 1.0:
                if b is not None:
                    self._flush(b, baseline_tps)
                b = self._bucket = _Bucket(now)
            b.tokens += step.emitted
            b.seconds += step.seconds

    def _flush(self, b: _Bucket, baseline_tps: float | None) -> None:
        tps = b.tokens / b.seconds if b.seconds > 0 else None
        self.history.append(SpeedPoint(t=round(b.t, 3), tok_s=tps, baseline_tok_s=baseline_tps))

    def tick(self, baseline_tps: float | None) -> None:
        """Called about once a second: closes the current bucket, or records an idle point."""
        now = time.time()
        with self._lock:
            b = self._bucket
            if b is not None and now - b.t >= 1.0:
                self._flush(b, baseline_tps)
                self._bucket = None
            elif b is None and (not self.history or now - self.history[-1].t >= 1.0):
                self.history.append(SpeedPoint(t=round(now, 3), tok_s=None, baseline_tok_s=baseline_tps))

    def add_request(self, rec: RequestRecord, st: GenerationStats) -> None:
        with self._lock:
            self.requests.appendleft(rec)
            self.requests_served += 1
            self.cache_lookups += 1
            self.cache_hits += st.cached_tokens > 0
            self.tokens_reused += st.cached_tokens
            self.tokens_evaluated += st.prompt_tokens - st.cached_tokens

    def add_abandoned(self, rec: RequestRecord) -> None:
        """A request that left the queue before it ran: shown in the log, not counted as served."""
        with self._lock:
            self.requests.appendleft(rec)

    def snapshot(self) -> LiveSnapshot:
        """Aggregates over the step window, for the stats view."""
        with self._lock:
            steps, requests, history = list(self.steps), list(self.requests), list(self.history)
            tokens_generated, requests_served = self.tokens_generated, self.requests_served
            lookups, hits, reused, evaluated = self.cache_lookups, self.cache_hits, self.tokens_reused, self.tokens_evaluated
        t = StepTally()
        for step in steps:
            t.add(step)
        recent = steps[-64:]  # the live rate: the last few seconds of steps
        recent_s = sum(s.seconds for s in recent)
        return LiveSnapshot(
            requests=requests,
            history=history,
            tokens_generated=tokens_generated,
            requests_served=requests_served,
            cache_lookups=lookups,
            cache_hits=hits,
            tokens_reused=reused,
            tokens_evaluated=evaluated,
            acceptance_rate=t.acceptance_rate,
            acceptance_length=t.acceptance_length,
            per_position=[round(x, 4) for x in t.position_acceptance],
            draft_ms=1000 * t.draft_s / t.steps if t.steps else None,
            verify_ms=1000 * t.verify_s / t.steps if t.steps else None,
            draft_share=t.draft_s / (t.draft_s + t.verify_s) if t.draft_s + t.verify_s > 0 else None,
            tok_s=sum(s.emitted for s in recent) / recent_s if recent_s > 0 else None,
            chosen=t.by_choice,
        )


class Metrics:
    """Prometheus metrics in their own registry (one per app, so tests can build several)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # status: ok | cancelled | timeout | error from a run; cancelled_in_queue (the client left
        # before its turn) and load_failed (a reload failed) for requests that never ran.
        self.requests = Counter("homespec_requests", "Requests finished, by status", ["status"], registry=r)
        self.prompt_tokens = Counter("homespec_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_prompt_tokens = Counter(
            "homespec_prompt_tokens_cached", "Prompt tokens whose KV cache was reused", registry=r
        )
        self.generation_tokens = Counter("homespec_generation_tokens", "Output tokens generated", registry=r)
        self.prefix_cache_lookups = Counter("homespec_prefix_cache_queries", "Requests looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("homespec_prefix_cache_hits", "Requests that reused a cached prefix", registry=r)
        self.drafts = Counter("homespec_spec_decode_num_drafts", "Steps that verified at least one proposed token", ["proposer"], registry=r)
        self.draft_tokens = Counter("homespec_spec_decode_num_draft_tokens", "Proposed tokens", ["proposer"], registry=r)
        self.accepted_tokens = Counter("homespec_spec_decode_num_accepted_tokens", "Accepted proposed tokens", ["proposer"], registry=r)
        self.accepted_per_pos = Counter(
            "homespec_spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by draft position (1-based)", ["position"], registry=r
        )
        self.steps = Counter("homespec_steps", "Target passes, by proposer and k", ["proposer", "k"], registry=r)
        # A CPU step is 50 ms .. 1 s; a GPU step 5 .. 100 ms.
        buckets = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0)
        self.step_seconds = Histogram("homespec_step_seconds", "Time per step phase", ["phase"], buckets=buckets, registry=r)
        self.ttft = Histogram(
            "homespec_time_to_first_token_seconds", "Time to first token", buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r
        )
        self.request_seconds = Histogram(
            "homespec_request_seconds", "Whole request time", buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=r
        )
        self.queue_waiting = Gauge("homespec_queue_waiting", "Requests waiting for the model", registry=r)
        self.queue_running = Gauge("homespec_queue_running", "Requests generating now", registry=r)
        self.queue_wait = Histogram(
            "homespec_queue_wait_seconds", "Time from arrival to start, by priority", ["priority"],
            buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r,
        )
        self.batch_sequences = Histogram(
            "homespec_batch_sequences", "Requests sharing one target pass", buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r
        )
        self.batch_rows = Histogram(
            "homespec_batch_rows", "Tokens in one target pass (all requests' rows)", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.warm = Gauge("homespec_warm", "1 when the models are loaded and warmed up", registry=r)
        self.model_loaded = Gauge("homespec_model_loaded", "1 when the model is loaded", ["role"], registry=r)
        self.ram_available = Gauge("homespec_memory_ram_available_bytes", "Available RAM", registry=r)
        self.ram_reserve = Gauge("homespec_memory_ram_reserve_bytes", "RAM kept free for other services", registry=r)
        self.tokens_per_second = Gauge("homespec_tokens_per_second", "Live output tokens/s", registry=r)
        self.baseline_tokens_per_second = Gauge(
            "homespec_baseline_tokens_per_second", "Plain decoding tokens/s estimated by the cost model", registry=r
        )
        self.speedup = Gauge("homespec_speedup", "Live tokens/s over the plain baseline", registry=r)
        self.draft_k = Gauge("homespec_spec_decode_k", "Draft length the controller chose last", registry=r)
        self.answer_memory_tokens = Gauge(
            "homespec_answer_memory_tokens", "Tokens of earlier answers prompt lookup drafts from", registry=r
        )

    def observe_step(self, step: StepStats) -> None:
        self.steps.labels(step.proposer, str(step.k)).inc()
        self.step_seconds.labels("verify").observe(step.verify_s)
        if step.proposer != OFF and step.proposed:
            self.step_seconds.labels("draft").observe(step.draft_s)
            self.drafts.labels(step.proposer).inc()
            self.draft_tokens.labels(step.proposer).inc(step.proposed)
            self.accepted_tokens.labels(step.proposer).inc(step.accepted)
            for i in range(step.accepted):
                self.accepted_per_pos.labels(str(i + 1)).inc()

    def observe_request(self, status: str, st: GenerationStats, seconds: float) -> None:
        self.requests.labels(status).inc()
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generation_tokens.inc(st.completion_tokens)
        self.cached_prompt_tokens.inc(st.cached_tokens)
        self.prefix_cache_lookups.inc()
        if st.cached_tokens:
            self.prefix_cache_hits.inc()
        if st.ttft_s:
            self.ttft.observe(st.ttft_s)
        self.request_seconds.observe(seconds)
