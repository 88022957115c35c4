"""OpenAI-compatible request models and response bodies (chat completions, completions).

Requests are validated by pydantic with OpenAI's ranges. Each field OpenAI defines is honoured,
ignored because it cannot change the answer, or refused with a 400 that names it (the table and
the reasons: openai_fields.py); fields OpenAI does not define are refused as well, as OpenAI
refuses them, so nothing that would change the answer is accepted and dropped. homespec's own
knobs travel in an extension object, `homespec: {"speculation": "off", "k": 4}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from homespec.config import Mode
from homespec.serving.llama_options import LlamaCppOptions
from homespec.serving.openai_fields import refusal
from homespec.serving.request_types import Flag, Integer, Number
from homespec.serving.tool_calls import template_tool_calls
from homespec.speculation.engine import GenerationStats
from homespec.speculation.sampling import TokenLogprob


class ApiError(Exception):
    """An error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class FieldError(ValueError):
    """A check across fields (a model validator, whose errors carry no location) that is about
    one of them: the error's `param` names it (routes/common.validation_error reads it back)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class HomespecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    speculation: Mode | None = None  # None: the daemon's current mode
    k: Integer | None = Field(None, ge=0, le=64)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None
    function_call: FunctionCall | None = None  # the legacy form of one tool call

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        # Before the union is tried: otherwise an image part is refused as "content.str: Input
        # should be a valid string", which names neither the part nor the reason.
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", None):
                raise ValueError(f"content parts of type {kind!r} are not supported: homespec serves text models only")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: Flag | None = None  # calls always follow the schema here (constrained decoding)

    def template(self) -> dict[str, Any]:
        """The definition as chat templates render it (they `tojson` the whole tool)."""
        return {"type": "function", "function": self.model_dump(exclude_none=True, exclude={"strict"})}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | Flag = Field(True, alias="schema")  # True: any JSON value
    strict: Flag | None = None  # always strict here: the schema constrains generation


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format type 'json_schema' needs a json_schema object")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Flag = False


# OpenAI allows 4 stop strings; code assistants (Continue, llama.vscode) send 5-15 to end a
# completion at a block boundary or a FIM marker. 64 is ample for them and keeps the per-token
# stop-string scan (textstream.py) cheap.
MAX_STOP = 64


def stop_strings(v: str | list[str] | None) -> list[str] | None:
    """A request's `stop` (one string or a list) as a list, checked: at most MAX_STOP, none empty."""
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty")
    return stops


class _Common(LlamaCppOptions):
    # OpenAI refuses fields it does not define, and so do we: accepting one and answering without
    # it would hand back something other than what was asked for. The exceptions are homespec's
    # own (top_k, min_p, repetition_penalty, `homespec`) and llama.cpp server's sampling options
    # (LlamaCppOptions: what clients written for llama-server send; refused where they would
    # change the answer).
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: Integer | None = Field(None, ge=-1)  # -1 (llama.cpp's "no limit"): the server's default
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)  # 0: the likeliest token only, as llama.cpp keeps one
    top_k: Integer | None = Field(None, ge=0)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0, le=10)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    seed: Integer | None = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI: a signed 64-bit integer
    stop: str | list[str] | None = None
    n: Integer | None = Field(None, ge=1)
    stream: Flag = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Number] | None = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # ignored (openai_fields.py says why)
    homespec: HomespecOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_flags(cls, data: Any) -> Any:
        # The openai client's types allow null for these flags (stream: Optional[Literal[False]],
        # echo: Optional[bool]) and send it; null is the default.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in ("stream", "echo", "parallel_tool_calls"))}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        return stop_strings(v)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1 (or -1 for the server's default)")
        return None if v == -1 else v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # Ids beyond the vocabulary are refused on the worker, where the loaded target is known.
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys are token ids (non-negative integers), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} is {bias}; it must lie in [-100, 100]")
        return v

    @field_validator("n")
    @classmethod
    def _refused_common(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    def stops(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    def token_bias(self) -> dict[int, float] | None:
        return {int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None

    def logprobs_top(self) -> int | None:
        """None: no logprobs; n: each token's logprob and its n likeliest alternatives."""
        return None


def _refuse(name: str | None, value: Any) -> Any:
    why = refusal(name or "", value)
    if why:
        raise ValueError(why)
    return value


class _ChatFields(_Common):
    """Chat's own fields beyond the common ones (tools and response_format are ChatRequest's)."""

    logprobs: Flag | None = None
    top_logprobs: Integer | None = Field(None, ge=0, le=20)
    # Ignored: none of them can change the answer (openai_fields.py says why, field by field).
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    prediction: Any = None
    # Refused unless they ask for nothing (null; modalities ["text"]).
    audio: Any = None
    modalities: Any = None
    moderation: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @field_validator("audio", "modalities", "moderation", "reasoning_effort", "verbosity", "web_search_options")
    @classmethod
    def _refused_chat(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class _CompletionFields(_Common):
    """The completions endpoint's own fields beyond the common ones."""

    logprobs: Integer | None = Field(None, ge=0, le=5)  # OpenAI's legacy meaning: alternatives per token
    best_of: Integer | None = Field(None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _refused_completion(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    def logprobs_top(self) -> int | None:
        return self.logprobs


ToolChoice = Literal["none", "auto", "required"]


class ChatRequest(_ChatFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: Flag = True
    functions: list[FunctionDef] | None = None  # legacy tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # legacy tool_choice
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama.cpp's extension: a GBNF (or Lark) grammar

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatRequest:
        if self.tools and self.functions:
            raise FieldError("functions", "send tools or the legacy functions, not both")
        if self.tool_choice is not None and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if self.function_call is not None and not self.functions:
            raise FieldError("function_call", "function_call needs functions")
        names = self.tool_names()
        if len(set(names)) != len(names):
            raise FieldError("tools", "tool names must be unique")
        choice = self.choice()
        if choice not in ("none", "auto", "required") and choice not in names:
            raise FieldError("tool_choice", f"tool_choice names {choice!r}, which is not among the tools")
        # response_format and tools combine (the answer is the JSON asked for, or calls); a grammar
        # constrains the whole answer alone.
        other = [f for f, on in (("response_format", self.answer_schema() is not None),
                                 ("tools", bool(names) and choice != "none")) if on]
        if self.grammar is not None and other:
            raise FieldError("grammar", f"grammar and {' and '.join(other)} cannot be combined (a grammar constrains the whole answer)")
        return self

    def answer_schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema response_format asks the answer to follow; None: free text."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return {"type": "object"}
        assert rf.json_schema is not None  # _schema_given
        return rf.json_schema.schema_

    @property
    def legacy_functions(self) -> bool:
        return bool(self.functions)

    def tool_defs(self) -> list[FunctionDef]:
        return [t.function for t in self.tools or []] + list(self.functions or [])

    def tool_names(self) -> list[str]:
        return [f.name for f in self.tool_defs()]

    def choice(self) -> str:
        """"none" | "auto" | "required" | the one function's name."""
        c = self.tool_choice if self.tools else self.function_call
        if c is None:
            return "auto"
        if isinstance(c, NamedToolChoice):
            return c.function.name
        if isinstance(c, NamedFunction):
            return c.name
        return c

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens or self.llama_limit()

    def chat_messages(self) -> list[dict[str, Any]]:
        """The history as chat templates take it: "developer" is OpenAI's newer "system"; tool
        results (and legacy "function" results) are "tool" messages; earlier calls carry their
        arguments as objects. A call whose arguments are not JSON is the client's error."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            calls = m.tool_calls or ([ToolCall(function=m.function_call)] if m.function_call else [])
            if calls:
                try:
                    msg["tool_calls"] = template_tool_calls([c.model_dump() for c in calls])
                except ValueError:
                    raise ApiError(400, f"messages[{i}].tool_calls: arguments are not a JSON object",
                                   param=f"messages[{i}].tool_calls") from None
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


class CompletionRequest(_CompletionFields):
    prompt: str | list[str]
    echo: Flag = False
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
            raise FieldError("prompt", "prompt must be one string (batched prompts are not supported)")
        if self.echo:
            raise FieldError("echo", "echo is not supported")
        return self

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def limit(self) -> int | None:
        return self.max_tokens or self.llama_limit()


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


# OpenAI's floor for a log-probability: JSON has no -Infinity (a token masked to -inf, say).
MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB)


def _token_entry(token: int, logprob: float, pieces: dict[int, bytes]) -> dict[str, Any]:
    raw = pieces.get(token, b"")
    return {"token": raw.decode("utf-8", "replace"), "logprob": _lp(logprob), "bytes": list(raw)}


def chat_logprobs(lps: list[TokenLogprob], pieces: dict[int, bytes]) -> dict[str, Any]:
    """choices[i].logprobs of a chat answer or chunk; pieces: token id -> its bytes."""
    content = [{**_token_entry(lp.token, lp.logprob, pieces), "top_logprobs": [_token_entry(t, x, pieces) for t, x in lp.top]}
               for lp in lps]
    return {"content": content, "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], pieces: dict[int, bytes], offset: int = 0) -> dict[str, Any]:
    """choices[i].logprobs of a completion or chunk (OpenAI's legacy shape). offset: characters
    of the completion before these tokens; text_offset[j] is where token j starts in it."""
    tokens = [pieces.get(lp.token, b"").decode("utf-8", "replace") for lp in lps]
    starts = []
    for tok in tokens:
        starts.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(lp.logprob) for lp in lps],
        "top_logprobs": [{pieces.get(t, b"").decode("utf-8", "replace"): _lp(x) for t, x in lp.top} for lp in lps],
        "text_offset": starts,
    }


def chat_body(rid: str, model: str, message: dict[str, Any], finish: str, st: GenerationStats, extra: dict) -> dict:
    """message: the assistant message; finish: OpenAI's finish_reason."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
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
