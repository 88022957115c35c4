"""Typed configuration: config.yaml -> Config, with defaults that carry their reason.

Every setting is declared once here (type, default, bounds, description); the CLI and the daemon
read it from this model. `load_config` turns any problem into a `ConfigError` whose message names
the bad field, so the CLI can print one line instead of a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from homespec.errors import UserError
from homespec.llama.gguf_info import KvType
from homespec.llama.kernels import EXACT_KV_TYPE, EXACT_MAX_ROWS


class Mode(str, Enum):
    """How a request speculates; declared once here (config, CLI flags, the API and stats use it).
    OFF is k = 0 (plain decoding) wherever it appears; a proposer's mode is its name."""

    # In the order the dashboard's `m` key cycles through: cheapest proposer first, off last.
    AUTO = "auto"  # the controller picks proposer and k (k = 0 included) from measurements
    NGRAM = "ngram"
    DRAFT = "draft"
    MTP = "mtp"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


MODES: tuple[str, ...] = tuple(m.value for m in Mode)


def _yaml_switch(value: object) -> object:
    """YAML 1.1 reads an unquoted on/off as true/false: take them back as the words the field
    lists (`mode: off`, `flash_attn: on`)."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


class ConfigError(UserError):
    """A config file that cannot be used; the message is one line naming the field."""


class _Strict(BaseModel):
    # Unknown keys are typos far more often than intent: reject them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelRef(_Strict):
    """One GGUF model: a registry name (fetched by `homespec models pull`) or a local path."""

    name: str | None = Field(None, description="Registry name from models/registry.yaml")
    path: Path | None = Field(None, description="Local GGUF file; overrides `name`")
    n_gpu_layers: int = Field(
        0, ge=-1, description="Layers offloaded to the GPU (-1 = all). 0: CPU only, the safe default"
    )

    @model_validator(mode="after")
    def _name_or_path(self) -> ModelRef:
        if self.name is None and self.path is None:
            raise ValueError("give `name` (registry) or `path` (local GGUF)")
        return self


class DraftRef(ModelRef):
    """The draft model: as ModelRef, and the type it is served in (models/derived.py)."""

    # Q4_0 has repacked kernels on every CPU ggml is fast on; the published 0.5B draft's Q5_0 and
    # Q8_0 have none. Requantized, a draft token took 14 ms instead of 27 on the 2-core Xeon, for
    # ~0.04 less acceptance. Proposals only: the target still verifies every token.
    requantize: Literal["q4_0"] | None = Field(
        "q4_0", description="Serve the draft requantized to this type (made once, kept beside it); null = as published"
    )


class ModelsConfig(_Strict):
    dir: Path = Field(Path("models"), description="Where pulled models live (relative to the config file)")
    registry: Path = Field(Path("models/registry.yaml"), description="Registry of pullable models")
    target: ModelRef = ModelRef(name="qwen2.5-coder-1.5b-instruct-q4_k_m")
    # The 0.5B draft shares the target's tokenizer. null disables draft-model speculation
    # (ngram needs no model).
    draft: DraftRef | None = DraftRef(name="qwen2.5-coder-0.5b-instruct-q4_k_m")
    mtp: Path | None = Field(None, description="Trained MTP head (.safetensors); null = none")


class RuntimeConfig(_Strict):
    # 4096 covers a chat with a few pages of history; the KV cache for the 1.5B target at 4k is
    # ~112 MiB (f16), cheap next to the weights.
    n_ctx: int = Field(4096, ge=256, le=131072, description="Context length in tokens")
    # None: one thread per physical core. Hyper-threads only add contention for llama.cpp's GEMMs.
    n_threads: int | None = Field(None, ge=1, le=512, description="CPU threads (null = physical cores)")
    # 512 keeps the compute buffer small (it scales with n_batch x vocab for the logits) while
    # prefill throughput is already flat above ~256 on a CPU.
    n_batch: int = Field(512, ge=32, le=8192, description="Max tokens per llama_decode call")
    use_mmap: bool = Field(True, description="Map weights from disk: fast start, shared page cache")
    # Off by default: mlock needs LimitMEMLOCK (the systemd unit sets it when this is on).
    use_mlock: bool = Field(False, description="Lock weights in RAM so the OS never pages them out")
    # Prefill runs at ~40-60 tokens/s on a 2-core CPU: re-reading a 1,000-token chat history
    # each turn costs ~20 s. Off only to measure what it saves.
    prefix_reuse: bool = Field(True, description="Reuse the KV cache of the shared prompt prefix")
    # On a CPU flash attention reads prompts faster (2-core AVX-512 EPYC, scripts/flash_attn_cost.py:
    # 105.9 against 97.2 tok/s), but ggml 0.25.3 runs the passes speculation verifies (2-63 rows)
    # one query row and head at a time: 8-35 % slower past 1,000 tokens. The wheel's
    # cpu-fa-grouped-heads fix (llama/cpu_build.py) takes them as fast as without it (paired in one
    # process, 1-17 rows after 300-2,000 tokens: 0.94-1.02x), so our auto is on for a CPU build
    # that has the fix, off for one without, and llama.cpp's choice with a GPU.
    flash_attn: Literal["auto", "on", "off"] = Field("auto", description="Flash attention (auto: on for a CPU build with the grouped kernel)")
    _flash_attn_words = field_validator("flash_attn", mode="before")(_yaml_switch)
    # Without it the AVX2 EPYC ran 8-12-row verify passes 9-20 % faster but prefill 1-10 % and
    # four parallel clients ~20 % slower (llama/kernels.py): llama.cpp's default stays.
    tiled_matmul: bool = Field(True, description="ggml's tiled matmul for passes of 8+ tokens (GGML_CPU_TILED_MM overrides)")
    # Off by default: it gives up repacked weights (AMX's stay, where it is in use: loader.open_target),
    # the tiled matmul's speed for verify passes of 8+ rows (llama/kernels.py: the reference kernels;
    # on a build without their switch, drafts past 6 tokens), and prompt chunks beside decode rows
    # (Config.k_limit, Config.max_pass_rows); the default mode keeps greedy output equal to plain
    # decoding except at near-ties (DESIGN.md).
    exact: bool = Field(False, description="Batch-invariant kernels: greedy output with speculation equals plain decoding bit for bit")
    # Off: a KV stream per slot, as llama-server -np N. Each slot's rows then attend over its own
    # cells only, not (masked) over every slot's: measured on a 2-core Xeon, four requests with
    # ~1,000-token prompts finished in 0.81x the time, a pass of four one-row steps beside
    # 2,000-token histories took 240 against 310 ms, and a lone request beside idle 2,000-token
    # histories 113 against 168 ms; with ~100-token prompts the two were even (0.998x). Exact
    # mode needs it off (llama/kernels.py).
    kv_unified: bool = Field(False, description="One KV buffer for all slots (llama.cpp's --kv-unified); off: a stream per slot")

    @model_validator(mode="after")
    def _exact_needs_flash_attn(self) -> RuntimeConfig:
        if self.exact and self.flash_attn == "off":
            raise ValueError("exact: needs flash_attn auto or on (without it one-token and batched attention differ)")
        if self.exact and self.kv_unified:
            raise ValueError("exact: needs kv_unified off (in one shared buffer a sequence's cells leave position order)")
        return self

    @property
    def kv_type(self) -> KvType:
        """The target's KV-cache element type: f16, llama.cpp's default, except in exact mode."""
        return EXACT_KV_TYPE if self.exact else "f16"

    def flash_attn_for(self, n_gpu_layers: int, grouped_kernel: bool = False) -> bool | None:
        """True/False to force it, None to leave the choice to llama.cpp. grouped_kernel: the
        installed build verifies with flash attention as fast as without (cpu_build.FA_GROUPED_FIX)."""
        if self.exact:
            return True  # the attention path whose rows do not depend on the batch (llama/kernels.py)
        if self.flash_attn != "auto":
            return self.flash_attn == "on"
        return grouped_kernel if n_gpu_layers == 0 else None


MIN_MEMORY_TOKENS = 1024  # a few answers of a few hundred tokens each


class NgramConfig(_Strict):
    # Matches shorter than 2 tokens are mostly noise (common tokens like "\n" or " the").
    n_min: int = Field(2, ge=1, le=16, description="Shortest suffix n-gram to look up")
    # Long matches mark copying (an edit, a quote), where long drafts pay; the controller
    # tracks acceptance per match length, so the lookup must be able to see them.
    n_max: int = Field(12, ge=1, le=32, description="Longest suffix n-gram to look up")
    # Earlier answers, drafted from when a request asks the same again (ngram_memory.py). 32768
    # tokens hold ~100 answers of a few hundred tokens in ~8 MB; 0 keeps every request to its
    # own text (a request's speed then says nothing about what others were told). Below
    # MIN_MEMORY_TOKENS one long answer would evict all the others.
    memory_tokens: int = Field(32768, ge=0, le=1 << 22, strict=True, description="Tokens of earlier answers prompt lookup may draft from (0 = off)")

    @field_validator("memory_tokens")
    @classmethod
    def _memory_size(cls, v: int) -> int:
        if 0 < v < MIN_MEMORY_TOKENS:
            raise ValueError(f"must be 0 (off) or at least {MIN_MEMORY_TOKENS} tokens")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> NgramConfig:
        if self.n_min > self.n_max:
            raise ValueError(f"n_min ({self.n_min}) must be <= n_max ({self.n_max})")
        return self


class ControllerConfig(_Strict):
    # Calibration covers the k the controller may choose: verify passes of 1..k_max+1 tokens.
    warmup_passes: int = Field(2, ge=1, le=20, description="Timed passes per batch size at warm-up")
    # 0.1: the estimate follows a workload change within ~10 steps yet one outlier step moves it
    # by only 10 %.
    acceptance_ewma: float = Field(0.1, gt=0, le=1, description="EWMA weight of a new acceptance observation")
    # Costs drift slowly (thermal, other load); 0.05 averages over ~20 samples per batch size.
    cost_ewma: float = Field(0.05, gt=0, le=1, description="EWMA weight of a new timing sample")
    # Re-probe a candidate that looks bad after this many steps without choosing it, so a change
    # of workload is noticed; bounded cost: 1 step in 32 at most.
    explore_every: int = Field(32, ge=2, le=10_000, description="Steps between exploration probes")
    # Optimistic prior: a never-observed position is assumed to accept at this rate.
    prior_acceptance: float = Field(0.5, ge=0, le=1, description="Acceptance assumed before any observation")
    # A candidate must beat plain decoding by this margin: speculation has variance and small
    # overheads that the cost model does not see.
    min_gain: float = Field(1.03, ge=1.0, le=2.0, description="Required expected speedup over k=0")


class SpeculationConfig(_Strict):
    mode: Mode = Field(Mode.AUTO, description="auto picks proposer and k from measurements; off = k 0")
    _mode_words = field_validator("mode", mode="before")(_yaml_switch)
    # Used by the fixed modes (draft, ngram, mtp).
    k: int = Field(4, ge=0, le=64, description="Draft length in the fixed modes (0 = off)")
    # 64: on a 2-core CPU a pass over 65 tokens costs ~24x one pass, over 49 ~20x and over 17 ~9x,
    # so a copy kept whole (an edit, the same question again) gains most from the longest drafts
    # (llama-server's ngram-mod drafts up to 64 too); the controller's costs and earned lengths keep
    # everything else short. Bench (--rounds 2: each prompt asked twice, so half the code answers
    # are repeats), 2-core EPYC, configs taking turns (48, 64, 64, 48): auto 1.36-1.40x / 1.64-1.65x
    # / 0.94-0.99x its plain decoding on code / edit / chat, against 1.24-1.36x / 1.54-1.56x /
    # 0.88-1.01x with 48; the repeated round alone 2.22-2.48x / 2.28-2.41x against 1.98-2.21x /
    # 2.03-2.14x. (48 against 16 earlier: 1.32-1.47x / 1.48-1.85x against 1.19-1.24x / 1.36-1.45x.)
    k_max: int = Field(64, ge=1, le=64, description="Largest k the controller may choose, and the longest grammar jump-forward")
    ngram: NgramConfig = NgramConfig()
    controller: ControllerConfig = ControllerConfig()


class SamplingDefaults(_Strict):
    # Greedy by default: reproducible answers, and the exactness guarantee is easiest to audit.
    temperature: float = Field(0.0, ge=0, le=5, description="Sampling temperature, 0 = greedy")
    top_p: float = Field(1.0, ge=0, le=1, description="Nucleus sampling mass, 1 = off")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens, 0 = off")
    min_p: float = Field(0.0, ge=0, le=1, description="Drop tokens below min_p x the top probability, 0 = off")
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # No fixed seed: each sampled request draws its own; set one to make sampling repeatable.
    seed: int | None = Field(None, ge=0, description="Random seed for sampling (null = fresh per request)")
    max_tokens: int = Field(512, ge=1, description="Default completion length")


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Bind address; loopback by default")
    # 8321: unassigned by IANA, not a common dev port (8000/8080/11434 are often taken).
    port: int = Field(8321, ge=1, le=65535, description="TCP port of the API")
    api_key: str | None = Field(None, description="Bearer key required on every /v1 request")
    api_key_file: Path | None = Field(None, description="File holding the API key (first line)")
    # A daemon that answers anyone on the LAN without a key is a footgun: opt in explicitly.
    allow_unauthenticated_remote: bool = Field(False, description="Allow a non-loopback bind without a key")
    # 8 waiting requests beside the running ones is ~minutes of work on a 2-core box.
    queue_depth: int = Field(8, ge=0, le=1024, description="Requests that may wait for the model")
    # Requests decoded together, each in its own KV sequence of runtime.n_ctx tokens (the memory
    # plan counts them all). On 2 AVX2 cores a pass over 4 rows costs ~3x one over 1 (measured:
    # 75 ms, 123 ms for 2, 227 ms for 4): four requests get ~1.3x the tokens/s of one at a time,
    # and a voice command no longer waits behind a long chat answer. 1 = one at a time.
    parallel: int = Field(4, ge=1, le=16, description="Requests that generate at the same time")
    # A prompt is read in chunks of this many tokens between the running requests' steps (alone:
    # prefill_chunk_alone), so it does not stall them for the whole prefill (a chunk's time,
    # ~0.8 s at 128 on 2 Xeon cores, is what they wait at most). Every pass also
    # pays about one decode step's worth of weight reads, so small chunks cost throughput: on the
    # 2-core Xeon of 2026-12-02, 513 tokens read at 92-96 tok/s in 64-token chunks, 97-100 in 128
    # and 95-100 in 512 (scripts/prefill_chunks.py; one process, interleaved), and a cold
    # 540-token prompt waited 1.06x as long as on llama-server in the same run, against 1.08x at
    # 64 (scripts/cold_ttft.py). An older Xeon's llama-bench read pp512 at 67.6 tok/s at ubatch
    # 64 and 60.0 at 512; 32 was 15 % slower there.
    prefill_chunk: int = Field(128, ge=1, le=4096, description="Prompt tokens read per pass (exact mode: n_batch, in passes of their own)")
    # A prompt with no decode beside it is read in passes this long (bounded by runtime.n_batch),
    # unless a request of higher priority has come before, since the models were first loaded (it
    # may come again, and would wait for the pass in flight: ~3 s for 512 tokens on 2 cores,
    # against ~0.8 s for 128). Fewer passes read it faster: on the 2-core AMX Xeon of
    # 2026-12-07, a cold 540-token chat prompt waited
    # 0.96-0.99x as long as on llama-server at 512 (three runs, scripts/cold_ttft.py), 1.02x at
    # 256 and 1.04-1.06x at 128.
    prefill_chunk_alone: int = Field(512, ge=1, le=4096, description="Prompt tokens read per pass with nothing else in it")
    request_timeout_s: float = Field(600, gt=0, description="Per-request wall-clock limit")
    # 4 MiB: far above any chat history that fits n_ctx, small enough to refuse abuse.
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    cors_origins: list[str] = Field(default_factory=list, description="Allowed CORS origins; none by default")
    # Graceful stop: in-flight generations get this long to finish before they are cancelled.
    drain_timeout_s: float = Field(20, ge=0, le=600)
    model_alias: str | None = Field(None, description="Model id reported by /v1/models (default: target name)")
    # DNS rebinding: a web page's own name resolved to 127.0.0.1 reaches the daemon with that name
    # in Host. Loopback names, IP literals, this machine's name and server.host are always
    # accepted; add the names clients use for a LAN bind (e.g. "homeserver.lan", "*.lan").
    allowed_hosts: list[str] = Field(default_factory=list, description="Extra Host names accepted")
    # 10 s: a real client sends its whole request header in one packet; a stalled half header
    # (slowloris) otherwise holds a socket and a file descriptor forever.
    header_timeout_s: float = Field(10, gt=0, le=300, description="Close connections whose request does not arrive in time")
    # uvicorn's default (5 s) keeps a reused connection cheap without letting idle ones pile up.
    keep_alive_s: int = Field(5, ge=1, le=300, description="Close idle keep-alive connections after this long")
    # Far below LimitNOFILE (65536 in the unit, 1024 without it) and far above what a home
    # server's clients open; past it the connection waiting longest for its header is dropped.
    max_connections: int = Field(512, ge=8, le=60_000, description="Open HTTP connections at most")
    # Off: some OpenAI-compatible clients read every non-empty line of a stream as `data:` and
    # choke on the `: ping` comment lines; a token stream sends data often anyway. Set it for a
    # proxy that closes connections idle longer than its timeout (a long prompt's prefill): a
    # stream then starts at once rather than with its first token (Bridge.first_output).
    sse_ping_s: float = Field(0, ge=0, le=3600, description="Seconds between keep-alive comments on a stream (0 = none)")

    @field_validator("api_key")
    @classmethod
    def _ascii_key(cls, v: str | None) -> str | None:
        # HTTP sends header values as bytes that servers read as latin-1, while clients encode
        # str keys as ASCII or UTF-8: a non-ASCII key could never match, locking everyone out.
        if v is not None and not (v.isascii() and v.isprintable() and v.strip() == v and v):
            raise ValueError("must be printable ASCII without surrounding spaces (it travels in an HTTP header)")
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, v: list[str]) -> list[str]:
        # Starlette's TrustedHostMiddleware matching: exact names or a leading "*." wildcard.
        for pattern in v:
            if not pattern or "*" in pattern[1:] or (pattern.startswith("*") and not pattern.startswith("*.")):
                raise ValueError(f"{pattern!r}: use a host name, or a wildcard like '*.example.com'")
        return v


class MemoryConfig(_Strict):
    # 1 GiB left to the rest of the home server (Home Assistant, a NAS, a browser over SSH).
    # At most 1 TiB: larger is a typo (GiB written as MiB x 1024), and the plan also refuses a
    # reserve that is not below the machine's RAM, naming this setting.
    reserve_mib: int = Field(1024, ge=0, le=1_048_576, description="RAM kept free for other services")
    vram_reserve_mib: int = Field(512, ge=0, description="VRAM kept free (desktop, other apps)")
    # drop-draft: serving without speculation beats not serving.
    policy: Literal["refuse", "drop-draft", "shrink-context"] = "drop-draft"
    watch_interval_s: float = Field(5.0, gt=0, description="How often headroom is checked while running")
    # Never by default: a home server's models should stay warm.
    keep_alive_s: float | None = Field(None, gt=0, description="Unload models after this idle time")
    # Prefix cache: saved KV states of recent conversations, beyond the live one.
    prefix_cache_mib: int = Field(512, ge=0, description="Memory for saved conversation caches")
    # On: a restart (an update, a reboot) does not read every app's long system prompt again;
    # up to prefix_cache_mib of disk in the state folder, written when the daemon stops.
    prefix_cache_persist: bool = Field(True, description="Keep the saved conversation caches on disk across restarts")


class Config(_Strict):
    models: ModelsConfig = ModelsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    sampling: SamplingDefaults = SamplingDefaults()
    server: ServerConfig = ServerConfig()
    memory: MemoryConfig = MemoryConfig()
    base_dir: Path = Field(
        Path("."), exclude=True, validate_default=True, description="Directory relative paths resolve against"
    )

    @field_validator("base_dir")
    @classmethod
    def _abs(cls, v: Path) -> Path:
        return v.resolve()

    def max_pass_rows(self, reference_decode: bool) -> int | None:
        """Rows one target pass of decode steps may hold, all requests together; None: n_batch,
        prompt chunks beside them. Exact mode packs narrow passes, prompts in passes of their own
        (speculation/batch.py), of one request's longest step (the last token and k_max) where
        its decode passes take llama.cpp's reference kernels (RuntimeOptions.reference_decode),
        else below ggml's tiled-matmul threshold, where rows stay batch-invariant without them
        (llama/kernels.py)."""
        if not self.runtime.exact:
            return None
        return self.speculation.k_max + 1 if reference_decode else EXACT_MAX_ROWS

    def k_limit(self, reference_decode: bool) -> int:
        """The longest draft the target may verify (max_pass_rows: the last token and k)."""
        rows = self.max_pass_rows(reference_decode)
        k = self.speculation.k_max
        return k if rows is None else min(k, rows - 1)

    def resolve(self, p: Path) -> Path:
        """A config path made absolute against the config file's folder."""
        p = Path(os.path.expanduser(p))
        return p if p.is_absolute() else (self.base_dir / p)


def override(section: BaseModel, values: Mapping[str, Any], prefix: str = "") -> None:
    """Set the values a caller gave (None: not given) on a config section, within each field's
    bounds (validate_assignment); a bad one raises ConfigError naming `prefix` + the field."""
    for name, value in values.items():
        if value is None:
            continue
        try:
            setattr(section, name, value)
        except ValidationError as e:
            raise ConfigError(f"{prefix}{name}: {e.errors()[0]['msg']}") from None


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}: {loc}: {first['msg']}{more}"


def load_config(path: str | Path | None) -> Config:
    """Read config.yaml. A missing path gives the defaults; a bad file raises ConfigError."""
    if path is None:
        return Config()
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    raw["base_dir"] = path.parent
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_error(e, str(path))) from None
