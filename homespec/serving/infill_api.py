"""llama.cpp's `/infill` (fill-in-the-middle for editor plugins): the request model, the two stops
editors ask for, and the response bodies, in llama.cpp server's shape (tools/server/README.md).

The request is llama.cpp's: `input_prefix`, `input_suffix`, `input_extra` ([{"filename", "text"}]),
`prompt` (appended to the prefix), and the `/completion` options. The options homespec has are
mapped onto its sampling (`repeat_penalty` is repetition_penalty; temperature <= 0 and top_k <= 0
mean greedy and off, as in llama.cpp). Those it lacks are refused by name when set to a value that
would change the answer, and accepted at their neutral value, because clients send their whole
default set; the sampling ones (and `samplers`, the order of the steps, which llama.vscode and
llama.vim send as ["top_k", "top_p", "infill"]) are llama_options.py's, shared with the OpenAI
routes. Options that only steer llama.cpp's cache or slots (`cache_prompt`, `id_slot`,
`t_max_prompt_ms`) are accepted and have nothing to do here; so is `model`, as in llama.cpp.
homespec's own `homespec` object (speculation mode, k) works as on the OpenAI routes.

Errors keep the OpenAI-style body of the rest of the server (`{"error": {"message", ...}}`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from homespec.serving.llama_options import LlamaCppOptions, llama_sampling
from homespec.serving.openai_api import HomespecOptions, stop_strings
from homespec.serving.request_types import Flag, Integer, Number
from homespec.speculation.engine import GenerationStats

# llama.cpp /completion options homespec does not implement, beyond the sampling ones
# (llama_options.NEUTRAL), with the values at which they do nothing. Any other value would change
# the answer: refused, never dropped.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "grammar": (None, ""),
    "json_schema": (None,),
    "logit_bias": (None, [], {}),
    "lora": (None, []),
    "image_data": (None, []),
    "multimodal_data": (None, []),
    "return_tokens": (False,),  # token ids in the answer: homespec streams text only
    "logprobs": (None, 0, False),  # llama.cpp's alias of n_probs (token probabilities in the answer)
}


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str
    filename: str = "tmp"  # llama.cpp's default


class InfillRequest(LlamaCppOptions):
    # "allow": the llama.cpp options homespec lacks are looked at (NEUTRAL), not dropped unseen.
    model_config = ConfigDict(extra="allow")
    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # appended to the prefix: the current line up to the cursor, say
    n_predict: Integer | None = Field(None, ge=-1)  # -1: the server default; 0: evaluate the prompt only
    max_completion_tokens: Integer | None = Field(None, ge=-1)  # llama.cpp's aliases of n_predict, in its order
    max_tokens: Integer | None = Field(None, ge=-1)
    stream: Flag = False
    stop: str | list[str] | None = None
    temperature: Number | None = Field(None, le=5)  # <= 0: greedy
    top_k: Integer | None = None  # <= 0: off
    top_p: Number | None = Field(None, gt=0, le=1)
    min_p: Number | None = Field(None, ge=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    seed: Integer | None = Field(None, ge=-1, le=2**64 - 1)  # -1: a fresh seed
    n_indent: Integer = Field(0, ge=0)  # lines after the first need at least this indentation
    t_max_predict_ms: Integer = Field(0, ge=0)  # after a newline, stop once this long has passed
    response_fields: list[str] | None = None  # keep only these ("timings/prompt_n": nested)
    n_cmpl: Integer = 1  # completions of the same prompt, answered as a list (at most one per slot)
    n: Integer | None = None  # llama.cpp's alias of n_cmpl (OpenAI's name), used when n_cmpl is not given
    homespec: HomespecOptions | None = None  # as on the OpenAI routes: {"speculation": "off", "k": 4}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        return stop_strings(v)

    @model_validator(mode="after")
    def _unsupported(self) -> InfillRequest:
        extra = self.model_extra or {}
        bad = [f"{k}={extra[k]!r}" for k in NEUTRAL if k in extra and not _neutral(extra[k], NEUTRAL[k])]
        if bad:
            raise ValueError(f"not supported (it would change the answer): {', '.join(bad)}")
        if "n_cmpl" not in self.model_fields_set and self.n is not None:
            self.n_cmpl = self.n
        return self

    def limit(self) -> int | None:
        """Tokens to write: None = the server's default, 0 = none (the prompt is only evaluated)."""
        n = next((v for v in (self.n_predict, self.max_completion_tokens, self.max_tokens) if v is not None), None)
        return None if n is None or n < 0 else n

    def samples(self) -> bool:
        return self.limit() != 0

    def sampling(self) -> dict[str, Any]:
        """build_request's overrides (llama_options: under `samplers`, a step not listed does nothing)."""
        return self.with_llama_options(llama_sampling(self))

    def stops(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value in neutral  # by ==: 1.0 is 1, [] is []


class Cutoff:
    """llama.cpp's two code-completion stops, applied to the answer's text as it arrives.

    Both wait for the first newline: the first line continues the cursor's line and is never cut.
    - n_indent: a later line whose first character (anything but a space or a tab, so a blank
      line too) sits left of column n_indent ends the answer, cut just before that character.
      Code completion then stops at the end of the block it was asked to fill.
    - t_max_predict_ms: the answer ends once this long has passed since its first text.
    """

    def __init__(self, n_indent: int = 0, t_max_predict_ms: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.n_indent, self.t_max_s, self.clock = n_indent, t_max_predict_ms / 1000, clock
        self.text = ""  # the answer kept so far
        self.hit = False  # the answer ends here
        self._start: float | None = None
        self._scan = 0  # the newlines before this position are checked

    def push(self, delta: str) -> str:
        """The part of delta to keep (all of it unless a stop cuts it); sets `hit`."""
        if self.hit or not delta:
            return ""
        if self._start is None:
            self._start = self.clock()
        base = len(self.text)
        self.text += delta
        cut = self._indent_cut() if self.n_indent > 0 else None
        if cut is not None:
            self.hit = True
            self.text = self.text[: max(cut, base)]
            return self.text[base:]
        if self.t_max_s > 0 and "\n" in self.text and self.clock() - self._start > self.t_max_s:
            self.hit = True
        return delta

    def _indent_cut(self) -> int | None:
        """Where the first line left of n_indent begins its content, if one does."""
        while (nl := self.text.find("\n", self._scan)) >= 0:
            start = pos = nl + 1
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos == len(self.text):
                return None  # only blanks so far: the line's indentation is not known yet
            if pos - start < self.n_indent:
                return pos
            self._scan = start
        return None


# -- responses -----------------------------------------------------------------------------------


def stop_type(finish: str | None, stop_word: str | None, cut: bool) -> str:
    """llama.cpp's stop_type: "eos" (the model ended), "word" (a stop string), "limit" (n_predict,
    a full context, n_indent or t_max_predict_ms)."""
    if cut or finish in ("length", "context", "cancelled"):
        return "limit"
    return "word" if stop_word else "eos"


def timings(st: GenerationStats, wall_s: float) -> dict[str, Any]:
    """llama.cpp's `timings`: prompt_* for the prompt tokens evaluated now (cached ones excluded),
    predicted_* for the answer; draft_* when speculation proposed tokens. wall_s: the request's
    measured generation time, used when the engine was stopped before it could time itself."""
    prompt_n = max(0, st.prompt_tokens - st.cached_tokens)
    prompt_ms = st.prefill_s * 1000
    predicted_ms = max(0.0, (st.total_s or wall_s) - st.prefill_s) * 1000
    out: dict[str, Any] = {
        "cache_n": st.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": st.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / st.completion_tokens if st.completion_tokens else 0.0,
        "predicted_per_second": 1000 * st.completion_tokens / predicted_ms if predicted_ms else 0.0,
    }
    if st.proposed:
        out["draft_n"], out["draft_n_accepted"] = st.proposed, st.accepted
    return out


def final_body(text: str, st: GenerationStats, *, stream: bool, finish: str | None, cut: bool, model: str,
               wall_s: float, settings: dict[str, Any], homespec: dict[str, Any]) -> dict[str, Any]:
    """The finished answer; streamed, the last event, whose content is "" (the pieces carried it)."""
    return {
        "index": 0,
        "content": "" if stream else text,
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": model,
        "tokens_predicted": st.completion_tokens,
        "tokens_evaluated": st.prompt_tokens,
        "generation_settings": settings,
        "has_new_line": "\n" in text,
        "truncated": finish == "context",
        "stop_type": stop_type(finish, st.stop_word, cut),
        "stopping_word": st.stop_word or "",
        # llama-server's: the tokens the slot holds after the request (editors show it as the
        # context's fill, "c: 53 / 4096"); the prompt tokens reused are timings' cache_n
        "tokens_cached": st.prompt_tokens + st.completion_tokens,
        "timings": timings(st, wall_s),
        "homespec": homespec,
    }


def partial_chunk(text: str, tokens_predicted: int, tokens_evaluated: int) -> dict[str, Any]:
    """One streamed piece of the answer (llama.cpp: only content, tokens and stop until the end)."""
    return {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": -1,
            "tokens_predicted": tokens_predicted, "tokens_evaluated": tokens_evaluated}


def select_fields(body: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: only the named fields, "a/b" taken from body["a"]["b"] and
    keyed "a/b"; a missing one is left out."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = body
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out
