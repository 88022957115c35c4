"""OpenAI-compatible request models and response bodies (chat completions, completions).

Requests are validated by pydantic with OpenAI's ranges; fields OpenAI defines but homespec
cannot honour (n > 1, logprobs, tools, a JSON response_format) are refused with a 400 that
names them rather than silently ignored. Unknown extra fields are ignored, as OpenAI does.
homespec's own knobs travel in an extension object, `homespec: {"speculation": "off", "k": 4}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from homespec.config import Mode
from homespec.speculation.engine import GenerationStats


class ApiError(Exception):
    """An error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class HomespecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    speculation: Mode | None = None  # None: the daemon's current mode
    k: int | None = Field(None, ge=0, le=64)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI: a signed 64-bit integer
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    user: str | None = None
    homespec: HomespecOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        # OpenAI allows 4; code assistants (Continue, llama.vscode) send 5-15 to end a completion
        # at a block boundary or a FIM marker. 64 is ample for them and keeps the per-token
        # stop-string scan (textstream.py) cheap.
        if len(stops) > 64:
            raise ValueError("at most 64 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _unsupported(self) -> _Common:
        if self.n != 1:
            raise ValueError("n > 1 is not supported (one completion per request)")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def stops(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self) -> ChatRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format type 'text' is supported")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool = False
    # The text after the gap: the prompt is then the prefix, and the answer is the middle that
    # joins them (fill-in-the-middle with the model's FIM tokens; "" = the end of the file).
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: str | list[str]) -> str | list[str]:
        if v == "" or v == [""]:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt must be one string (batched prompts are not supported)")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def limit(self) -> int | None:
        return self.max_tokens


# -- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def openai_finish(reason: str | None) -> str:
    """Engine finish reasons -> OpenAI's: a full context is a length limit too."""
    return {"stop": "stop", "length": "length", "context": "length"}.get(reason or "", "stop")


def usage(st: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "total_tokens": st.prompt_tokens + st.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
    }


def homespec_stats(st: GenerationStats, mode: str, cold: bool, baseline_tps: float | None) -> dict[str, Any]:
    """This request's speculative figures (an extension field on the response)."""
    tps = st.decode_tps
    return {
        "mode": mode,
        "proposers": st.by_choice,
        "steps": st.steps,
        "proposed": st.proposed,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "acceptance_length": st.acceptance_length,
        "ttft_s": round(st.ttft_s, 4),
        "tokens_per_s": tps,
        "speedup_estimate": (tps / baseline_tps) if tps and baseline_tps else None,
        "draft_s": round(st.draft_s, 4),
        "verify_s": round(st.verify_s, 4),
        "cold": cold,
    }


def chat_body(rid: str, model: str, text: str, finish: str | None, st: GenerationStats, extra: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": openai_finish(finish)}],
        "usage": usage(st),
        "homespec": extra,
    }


def completion_body(rid: str, model: str, text: str, finish: str | None, st: GenerationStats, extra: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish(finish)}],
        "usage": usage(st),
        "homespec": extra,
    }


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, created: int | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, created: int | None = None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
