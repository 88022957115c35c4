"""The JSON of GET /v1/homespec/stats: what the daemon publishes and the dashboard reads.

Declared once here (pydantic) so that producer and consumer cannot drift; this module imports
nothing from the engine, so the dashboard can use it over HTTP alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

DaemonState = Literal["loading", "warming", "ready", "unloaded", "failed", "stopping"]


class ModelInfo(BaseModel):
    name: str
    path: str
    n_gpu_layers: int = 0
    size_mib: float = 0.0  # weights, MiB
    loaded: bool = True


class ModelsView(BaseModel):
    target: ModelInfo | None = None
    draft: ModelInfo | None = None  # None: no draft configured
    mtp: ModelInfo | None = None
    proposers: list[str] = Field(default_factory=list)  # available now, e.g. ["ngram", "draft"]


class DeviceView(BaseModel):
    kind: Literal["cpu", "gpu"] = "cpu"
    threads: int = 0
    gpu_layers: int = 0
    gpu_name: str | None = None


class SpeedPoint(BaseModel):
    t: float  # unix seconds
    tok_s: float | None = None  # effective output tokens/s over the last interval (None: idle)
    baseline_tok_s: float | None = None  # plain decoding, from the cost model


class SpeedView(BaseModel):
    tok_s: float | None = None  # live effective output tokens/s (rolling window of steps)
    baseline_tok_s: float | None = None  # plain decoding estimate (cost model, refreshed by plain steps)
    speedup: float | None = None  # tok_s / baseline_tok_s
    tokens_generated: int = 0
    requests_served: int = 0
    history: list[SpeedPoint] = Field(default_factory=list)  # ~1 point per second, last 120


class SpeculationView(BaseModel):
    mode: str = "auto"  # the daemon's default mode (admin-settable)
    modes: list[str] = Field(default_factory=list)  # modes the admin endpoint accepts, in cycle order
    proposer: str = "off"  # the controller's current choice ("off": plain decoding)
    k: int = 0
    reason: str = ""
    gains: dict[str, list[float]] = Field(default_factory=dict)  # proposer -> expected gain for k = 1..k_max
    acceptance_rate: float | None = None  # accepted / proposed, rolling window
    acceptance_length: float | None = None  # tokens per step, rolling window
    per_position: list[float] = Field(default_factory=list)  # P(accepted | reached) at draft positions 1..
    draft_ms_per_step: float | None = None
    verify_ms_per_step: float | None = None
    draft_share: float | None = None  # drafting / (drafting + verifying) time, 0..1
    chosen: dict[str, int] = Field(default_factory=dict)  # "ngram:4" -> steps (rolling window)
    probes: int = 0
    answer_memory: AnswerMemoryView | None = None  # None: off (memory_tokens 0) or no model loaded


class AnswerMemoryView(BaseModel):
    """Prompt lookup's memory of earlier answers (speculation.ngram.memory_tokens)."""

    answers: int = 0  # answers held
    tokens: int = 0  # their tokens (with each one's prompt tail and a separator)
    capacity: int = 0  # tokens at most; past it the oldest half is forgotten


class MemoryView(BaseModel):
    ram_total_mib: float = 0.0
    ram_available_mib: float = 0.0
    reserve_mib: float = 0.0
    process_rss_mib: float = 0.0
    models_mib: dict[str, float] = Field(default_factory=dict)  # "target"/"draft" -> estimated MiB
    vram_total_mib: float | None = None
    vram_free_mib: float | None = None
    policy: str = "drop-draft"
    events: list[str] = Field(default_factory=list)  # e.g. "draft unloaded at 18:04: headroom 0.6 GiB < 1.0 GiB reserve"


class RunningRequest(BaseModel):
    """A request generating now (one of the set decoded together)."""

    id: str
    slot: int  # its KV sequence
    priority: int = 0
    mode: str = "auto"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    age_s: float = 0.0  # since it started
    tok_s: float | None = None  # its output tokens/s since its first token


class QueueView(BaseModel):
    running: int = 0
    waiting: int = 0
    max_waiting: int = 0
    parallel: int = 1  # requests that may generate together
    requests: list[RunningRequest] = Field(default_factory=list)  # the running set, oldest first
    batch_rows: float | None = None  # tokens per target pass, recent mean (all requests' rows)


class RequestRecord(BaseModel):
    id: str
    time: float  # unix seconds at arrival
    mode: str = "auto"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    tok_s: float | None = None
    speedup: float | None = None  # vs the plain baseline estimate
    status: Literal["ok", "cancelled", "error", "timeout"] = "ok"
    finish_reason: str | None = None
    cold: bool = False  # found the models unloaded and waited for a load


class PrefixCacheView(BaseModel):
    lookups: int = 0
    hits: int = 0
    hit_ratio: float | None = None
    tokens_reused: int = 0
    tokens_evaluated: int = 0
    saved_states: int = 0
    saved_mib: float = 0.0


class StatsView(BaseModel):
    version: str
    uptime_s: float
    state: DaemonState
    address: str = ""
    load_s: float | None = None  # last model load
    warmup_s: float | None = None
    cold_loads: int = 0
    models: ModelsView = ModelsView()
    device: DeviceView = DeviceView()
    speed: SpeedView = SpeedView()
    speculation: SpeculationView = SpeculationView()
    memory: MemoryView = MemoryView()
    queue: QueueView = QueueView()
    requests: list[RequestRecord] = Field(default_factory=list)  # most recent first, last 20
    prefix_cache: PrefixCacheView = PrefixCacheView()
