"""Ollama's REST API (ollama/ollama docs/api.md): the request models, what their options mean
here, and the response bodies, so that apps written for Ollama (Home Assistant, Open WebUI,
Continue, the `ollama` client libraries) talk to homespec unchanged.

Requests are read as Ollama reads them: unknown fields and unknown `options` keys are ignored
(Ollama logs them and goes on), known options must have their type (integer options may arrive
as floats, 8192.0, truncated as Go does), keep_alive is a number of seconds or a Go duration
("5m", "-1.0s"; negative = forever), and tool-call arguments are JSON objects. Options that would
change the answer and that homespec lacks (typical_p, tfs_z, mirostat) are refused unless set to
the value at which they do nothing; options that steer Ollama's runner (num_ctx, num_gpu,
num_thread, ...) have nothing to steer here: the context and threads are the daemon's, fixed at
load. homespec's own knobs are options too: `homespec_speculation` ("off", "ngram", ...) and
`homespec_k`.

Errors are Ollama's shape, `{"error": "message"}` (app.py shapes every error under /api/).
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from homespec.config import Mode
from homespec.serving.llama_options import PENALTY_LAST_N, llama_sampling
from homespec.serving.openai_api import MAX_STOP, FunctionDef
from homespec.serving.request_types import Flag, Integer, Number
from homespec.serving.tool_calls import Call
from homespec.speculation.engine import GenerationStats

# The Ollama release whose API this follows (api.md, the `ollama` 0.6 client). Clients read it
# to decide which fields a server understands; homespec's own version is in /v1/models and /health.
OLLAMA_VERSION = "0.12.0"

_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# Ollama shows a model kept forever with an expiry centuries away; so do we, and a keep_alive
# longer than that is forever too (a clock cannot show the expiry of 1e300 seconds).
FOREVER_S = 200 * 365 * 86400  # seconds


def parse_keep_alive(v: Any) -> float | None:
    """keep_alive as Ollama reads it -> seconds; math.inf = keep loaded; None = not given.

    A number is seconds (fractions dropped, as Ollama's int(t)); a string is a Go duration
    ("5m", "1h30m", "-1.0s") or a bare number of seconds ("300", "-1"); anything negative, or
    longer than FOREVER_S, means forever. ValueError otherwise."""
    if v is None:
        return None
    if isinstance(v, bool) or (isinstance(v, float) and math.isnan(v)):
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as \"5m\", got {v!r}")
    if isinstance(v, int | float):
        return _kept(v < 0, v)
    if isinstance(v, str):
        s = v.strip()
        sign = -1.0 if s.startswith("-") else 1.0
        body = s.lstrip("+-")
        if re.fullmatch(r"[0-9]+(\.[0-9]*)?", body):  # a bare number: seconds (as OLLAMA_KEEP_ALIVE reads it)
            return _kept(sign < 0, float(body))
        pos, total = 0, 0.0
        while pos < len(body):
            m = _GO_DURATION.match(body, pos)
            if m is None:
                break
            total += float(m.group(1)) * _UNIT_S[m.group(2)]
            pos = m.end()
        if body and pos == len(body):
            return _kept(sign < 0, total, whole=False)
    raise ValueError(f"keep_alive {v!r} is not a duration: use seconds (300, -1 for forever) or a duration (\"5m\", \"1h30m\")")


def _kept(negative: bool, seconds: float, whole: bool = True) -> float:
    """A parsed keep_alive in seconds (whole: fractions dropped), or math.inf for forever
    (negative, or past FOREVER_S)."""
    if negative or seconds >= FOREVER_S:
        return math.inf
    return float(int(seconds)) if whole else seconds


def _int_like(v: Any) -> Any:
    # Go unmarshals JSON numbers as float64 and Ollama truncates them into int options.
    if isinstance(v, float) and math.isfinite(v):
        return int(v)
    return v


# Ollama refuses a string or a boolean for an int option ("must be of type integer"), as Integer does.
IntOption = Annotated[Integer, BeforeValidator(_int_like)]

# Options homespec does not implement, with the values at which they do nothing (Ollama's
# defaults). Any other value would change the answer: refused, never dropped.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "typical_p": (None, 1),
    "tfs_z": (None, 1),
    "mirostat": (None, 0),
}


class Options(BaseModel):
    """The generation `options`: Ollama's Options, typed as Ollama types them (a wrong type is a
    400 there and here); unknown keys are ignored, as Ollama ignores them."""

    model_config = ConfigDict(extra="allow")
    temperature: Number | None = Field(None, ge=0)  # 0: greedy
    top_k: IntOption | None = None  # <= 0: off
    top_p: Number | None = Field(None, ge=0, le=1)  # 0: the likeliest token only, as llama.cpp keeps one
    min_p: Number | None = Field(None, ge=0, le=1)
    num_predict: IntOption | None = Field(None, ge=-2)  # -1 (and -2): until the context is full
    stop: list[str] | None = Field(None, max_length=MAX_STOP)
    seed: IntOption | None = None  # negative: a fresh seed
    repeat_penalty: Number | None = Field(None, gt=0, le=10)
    repeat_last_n: IntOption | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    # Refused unless neutral (NEUTRAL).
    typical_p: Number | None = None
    tfs_z: Number | None = None
    mirostat: IntOption | None = None
    # Nothing to steer here: the context, batch and threads are the daemon's, fixed at load
    # (Ollama reloads the model for another num_ctx); homespec stops at a full context where
    # Ollama shifts it (num_keep); mirostat's settings are read only with mirostat on.
    num_ctx: IntOption | None = None
    num_batch: IntOption | None = None
    num_gpu: IntOption | None = None
    main_gpu: IntOption | None = None
    num_thread: IntOption | None = None
    num_keep: IntOption | None = None
    mirostat_tau: Number | None = None
    mirostat_eta: Number | None = None
    low_vram: Flag | None = None
    f16_kv: Flag | None = None
    logits_all: Flag | None = None
    vocab_only: Flag | None = None
    use_mmap: Flag | None = None
    use_mlock: Flag | None = None
    numa: Flag | None = None
    embedding_only: Flag | None = None
    penalize_newline: Flag | None = None  # Ollama's current engine ignores it too
    homespec_speculation: Mode | None = None  # homespec's: this request's speculation mode
    homespec_k: IntOption | None = Field(None, ge=0, le=64)  # homespec's: draft length

    @field_validator("num_predict")
    @classmethod
    def _some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1 to write until the context is full")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> Options:
        bad = [f"{k}={getattr(self, k)!r}" for k, ok in NEUTRAL.items() if getattr(self, k) not in ok]
        penalised = self.repeat_penalty not in (None, 1) or bool(self.presence_penalty) or bool(self.frequency_penalty)
        if penalised and self.repeat_last_n not in (None, PENALTY_LAST_N):
            bad.append(f"repeat_last_n={self.repeat_last_n!r} (the penalty window is {PENALTY_LAST_N})")
        if bad:
            raise ValueError(f"not supported (it would change the answer): {', '.join(bad)}")
        return self

    def sampling(self) -> dict[str, Any]:
        """The sampling overrides for build_request (llama.cpp's names and meanings)."""
        return llama_sampling(self)

    def limit(self, n_ctx: int) -> int | None:
        """Tokens to write: None = the daemon's default (sampling.max_tokens); a negative
        num_predict runs until the context is full, as in Ollama."""
        if self.num_predict is None:
            return None
        return n_ctx if self.num_predict < 0 else self.num_predict


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # Ollama: an object; OpenAI's JSON string is read too

    @field_validator("arguments", mode="before")
    @classmethod
    def _object(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except ValueError:
                raise ValueError("arguments must be a JSON object") from None
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    function: ToolCallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_name: str | None = None  # a tool result: the tool that wrote it (Ollama sends no ids)
    tool_call_id: str | None = None
    thinking: str | None = None  # an earlier answer's thinking: not shown to a model without it

    @field_validator("images")
    @classmethod
    def _no_images(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("images are not supported: homespec serves text models only")
        return v

    def template(self) -> dict[str, Any]:
        """The message as chat templates take it (tool-call arguments as objects)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_name is not None:
            msg["name"] = self.tool_name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ToolFunction(FunctionDef):
    # Ollama puts no rule on names (OpenAI's is ^[a-zA-Z0-9_-]{1,64}$); Home Assistant's tools
    # are named after scripts and intents. The call grammar quotes them as JSON strings.
    name: str = Field(min_length=1, max_length=256)


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolFunction


Format = Literal["", "json"] | dict[str, Any] | None


def _null_is_unset(data: Any) -> Any:
    """Go's clients (the `ollama` CLI) send every field they have no value for, as null or "":
    Ollama reads a null as the field's default, and so do we."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Generation(BaseModel):
    # Ollama ignores fields it does not know; so do we (they cannot have changed its answer).
    model_config = ConfigDict(extra="ignore")
    _nulls = model_validator(mode="before")(_null_is_unset)
    model: str = Field(min_length=1)
    format: Format = None  # "json", or a JSON schema the answer follows
    options: Options = Field(default_factory=Options)
    stream: Flag = True
    keep_alive: Number | None = None  # seconds (see parse_keep_alive); None: the daemon's default
    think: Flag | str | None = None
    logprobs: Flag = False
    top_logprobs: Integer = Field(0, ge=0, le=20)

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, v: Any) -> float | None:
        return parse_keep_alive(v)

    @field_validator("think")
    @classmethod
    def _think(cls, v: bool | str | None) -> bool | str | None:
        # Ollama refuses think for a model without a thinking mode; homespec's models have none
        # it can separate from the answer.
        if v not in (None, False, "", "false"):
            raise ValueError("thinking is not supported by this model (send think: false or leave it out)")
        return v

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("", "json"):
            raise ValueError('format must be "json" or a JSON schema object')
        return v

    def logprobs_top(self) -> int | None:
        return self.top_logprobs if self.logprobs else None


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)  # empty: only load (or unload) the model
    tools: list[Tool] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template() for m in self.messages]


class GenerateRequest(_Generation):
    prompt: str = ""  # empty (and no suffix): only load (or unload) the model
    suffix: str | None = None  # the code after the gap: the answer fills it (FIM)
    system: str | None = None
    template: str | None = None
    context: list[Integer] | None = None
    raw: Flag = False
    images: list[Any] | None = None

    @field_validator("suffix")
    @classmethod
    def _empty_suffix(cls, v: str | None) -> str | None:
        return v or None  # Ollama fills the middle only for a suffix that is not "" (Go sends "")

    @model_validator(mode="after")
    def _unsupported(self) -> GenerateRequest:
        if self.images:
            raise ValueError("images are not supported: homespec serves text models only")
        if self.template:
            raise ValueError("template is not supported: prompts use the model's own chat template; "
                             "send raw: true with a prompt you formatted yourself")
        if self.context:
            raise ValueError("context is not supported (Ollama deprecated it): send the conversation to /api/chat")
        return self

    def load_only(self) -> bool:
        return not self.prompt and self.suffix is None


class ModelRequest(BaseModel):
    """/api/show and /api/pull name a model as `model` (or the older `name`)."""

    model_config = ConfigDict(extra="ignore")
    _nulls = model_validator(mode="before")(_null_is_unset)
    model: str | None = None
    name: str | None = None
    stream: Flag = True  # /api/pull
    verbose: Flag = False  # /api/show: the vocabulary too (left out: it is ~150k strings)

    @model_validator(mode="after")
    def _named(self) -> ModelRequest:
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self

    @property
    def wanted(self) -> str:
        return self.model or self.name or ""


# -- responses -----------------------------------------------------------------------------------


def timestamp(t: float | None = None) -> str:
    """RFC 3339 in UTC with microseconds, as Go writes created_at ("2025-01-02T03:04:05.678901Z")."""
    when = datetime.now(timezone.utc) if t is None else datetime.fromtimestamp(t, timezone.utc)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


def expiry(t: float) -> str:
    """expires_at of /api/ps; t: epoch seconds, math.inf = never."""
    if math.isinf(t):
        return timestamp(datetime.now(timezone.utc).timestamp() + FOREVER_S)
    return timestamp(t)


def done_reason(finish: str | None) -> str:
    """Engine finish reasons -> Ollama's: a full context is a length limit too."""
    return {"length": "length", "context": "length", "load": "load", "unload": "unload"}.get(finish or "", "stop")


def metrics(st: GenerationStats | None, *, load_s: float, total_s: float) -> dict[str, int]:
    """The final object's counts and durations (nanoseconds), from which clients compute
    tokens/s: the prompt tokens evaluated now (those served from the KV cache of earlier turns
    cost nothing and are left out, so the rate is the real one) and the answer's tokens and time."""
    ns = 1_000_000_000
    out = {"total_duration": int(total_s * ns), "load_duration": int(load_s * ns)}
    if st is None:
        return out
    decode_s = max(0.0, st.total_s - st.prefill_s)
    return {
        **out,
        "prompt_eval_count": st.prompt_tokens - st.cached_tokens,
        "prompt_eval_duration": int(st.prefill_s * ns),
        "eval_count": st.completion_tokens,
        "eval_duration": int(decode_s * ns),
    }


def tool_calls(calls: list[Call], start: int = 0) -> list[dict[str, Any]]:
    """Calls in Ollama's shape: arguments as an object, an index per call (from `start`, the
    number of calls of this answer already sent)."""
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": json.loads(c.arguments)}}
            for i, c in enumerate(calls, start)]


def parameter_size(n_params: int, size_label: Any) -> str:
    """"1.5B" as Ollama shows it: the model's own size label, else the weight count."""
    if isinstance(size_label, str) and size_label:
        return size_label
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n_params >= div:
            return f"{n_params / div:.1f}{unit}"
    return str(n_params)


def details(metadata: dict[str, Any], n_params: int, file_type: str | None) -> dict[str, Any]:
    arch = str(metadata.get("general.architecture", ""))
    return {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": parameter_size(n_params, metadata.get("general.size_label")),
        "quantization_level": file_type or "unknown",
    }
