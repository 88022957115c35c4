"""llama.cpp's `/infill` (fill-in-the-middle for editor plugins): the request model, the two stops
editors ask for, and the response bodies, in llama.cpp server's shape (tools/server/README.md).

The request is llama.cpp's: `input_prefix`, `input_suffix`, `input_extra` ([{"filename", "text"}]),
`prompt` (appended to the prefix), and the `/completion` options. The options homespec has are
mapped onto its sampling (`repeat_penalty` is repetition_penalty; temperature <= 0 and top_k <= 0
mean greedy and off, as in llama.cpp). Those it lacks are refused by name when set to a value that
would change the answer, and accepted at their neutral value, because clients send their whole
default set. `samplers` (llama.cpp's order of its sampler chain, which llama.vscode and llama.vim
send as ["top_k", "top_p", "infill"]) is followed: the samplers it lists act in its order, the
others do nothing (as in llama.cpp: no temperature listed is temperature 1), and `infill` is
llama.cpp's infill sampler (speculation/infill_sampler.py).
Options that only steer llama.cpp's cache or slots (`cache_prompt`, `id_slot`,
`t_max_prompt_ms`) are accepted and have nothing to do here; so is `model`, as in llama.cpp.
homespec's own `homespec` object (speculation mode, k) works as on the OpenAI routes.

Errors keep the OpenAI-style body of the rest of the server (`{"error": {"message", ...}}`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from homespec.errors import UserError
from homespec.serving.openai_api import HomespecOptions, stop_strings
from homespec.speculation.engine import GenerationStats
from homespec.speculation.sampling import DEFAULT_ORDER, SamplingParams

# llama.cpp's penalty window when none is given; homespec's is fixed at the same 64 (sampling.py).
PENALTY_LAST_N = 64

# llama.cpp /completion options homespec does not implement, with the values at which they do
# nothing. Any other value would change the answer: refused, never dropped.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "dynatemp_range": (0,),
    "typical_p": (1,),
    "dry_multiplier": (0,),
    "xtc_probability": (0,),
    "mirostat": (0,),
    "top_n_sigma": (-1,),
    "min_keep": (0,),
    "n_probs": (0,),  # token probabilities in the answer
    "ignore_eos": (False,),
    "grammar": (None, ""),
    "json_schema": (None,),
    "logit_bias": (None, [], {}),
    "lora": (None, []),
    "image_data": (None, []),
    "multimodal_data": (None, []),
    "return_tokens": (False,),  # token ids in the answer: homespec streams text only
}


# llama.cpp's sampler names (common/sampling.cpp): these, their kebab-case and run-together
# spellings ("top-k", "topk"), three aliases, and the one-letter codes of a string ("kpi").
SAMPLER_CODES = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
_SAMPLER_NAMES = {
    **{n: n for n in SAMPLER_CODES.values()},
    **{n.replace("_", "-"): n for n in SAMPLER_CODES.values()},
    **{n.replace("_", ""): n for n in SAMPLER_CODES.values()},
    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}
# The samplers homespec lacks (dry, typ_p, top_n_sigma, xtc) may be listed at their neutral values
# (NEUTRAL), where they do nothing. infill compares every candidate with every other (quadratic,
# as in llama.cpp), so a top-k cut before it must bound them: llama.vscode and llama.vim send 40,
# llama.cpp's default.
INFILL_MAX_TOP_K = 256


def sampler_chain(samplers: list[str] | str) -> list[str]:
    """llama.cpp's `samplers` (names, or a string of one-letter codes) as canonical names in
    their order; ValueError naming one homespec does not know or cannot follow."""
    if isinstance(samplers, str):
        bad = [c for c in samplers if c not in SAMPLER_CODES]
        names = [SAMPLER_CODES.get(c, c) for c in samplers]
    else:
        bad = [n for n in samplers if n.lower() not in _SAMPLER_NAMES]
        names = [_SAMPLER_NAMES.get(n.lower(), n) for n in samplers]
    if bad:
        raise ValueError(f"samplers: unknown sampler {bad[0]!r} (llama.cpp's are {', '.join(SAMPLER_CODES.values())})")
    if "adaptive_p" in names:  # it replaces the final draw: homespec always draws from the chain's distribution
        raise ValueError("not supported (it would change the answer): samplers with 'adaptive_p'")
    return names


def sampling_order(names: list[str], params: SamplingParams) -> tuple[str, ...]:
    """SamplingParams.order for llama.cpp's `samplers` (canonical names, in order), checked with
    the request's values (params, resolved against the config's defaults); UserError where
    homespec cannot sample as llama.cpp would."""
    acting = {
        "penalties": params.has_penalties,
        "temperature": params.temperature != 1.0,
        "top_k": params.top_k > 0,
        "top_p": params.top_p < 1.0,
        "min_p": params.min_p > 0.0,
        "infill": True,
    }
    listed = [n for n in names if acting.get(n)]
    twice = next((n for i, n in enumerate(listed) if n in listed[:i]), None)
    if twice is not None:
        raise UserError(f"samplers: {twice!r} is listed twice; homespec applies each sampler once")
    if "penalties" in listed[1:]:  # homespec's penalties change the logits before any other step
        raise UserError(f"samplers: 'penalties' after {listed[0]!r} is an order homespec cannot follow; list it first")
    if "infill" in names and not params.greedy:
        if not (0 < params.top_k <= INFILL_MAX_TOP_K and "top_k" in names[: names.index("infill")]):
            raise UserError(f"samplers: 'infill' needs a top_k of 1-{INFILL_MAX_TOP_K} listed before it "
                            "(it compares every candidate with every other)")
    if params.greedy and "temperature" in names and "infill" in names[: names.index("temperature")]:
        # llama.cpp would take the argmax of what infill kept; homespec's greedy is the argmax of all
        raise UserError("samplers: 'infill' before a temperature of 0 is an order homespec cannot follow")
    return tuple(dict.fromkeys(n for n in names if n in DEFAULT_ORDER))


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str
    filename: str = "tmp"  # llama.cpp's default


class InfillRequest(BaseModel):
    # "allow": the llama.cpp options homespec lacks are looked at (NEUTRAL), not dropped unseen.
    model_config = ConfigDict(extra="allow")
    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # appended to the prefix: the current line up to the cursor, say
    n_predict: int | None = Field(None, ge=-1)  # -1: the server default; 0: evaluate the prompt only
    max_tokens: int | None = Field(None, ge=-1)  # llama.cpp's alias of n_predict
    stream: bool = False
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, le=5)  # <= 0: greedy
    top_k: int | None = None  # <= 0: off
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    repeat_last_n: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)  # -1: a fresh seed
    samplers: list[str] | str | None = None
    n_indent: int = Field(0, ge=0)  # lines after the first need at least this indentation
    t_max_predict_ms: int = Field(0, ge=0)  # after a newline, stop once this long has passed
    response_fields: list[str] | None = None  # keep only these ("timings/prompt_n": nested)
    homespec: HomespecOptions | None = None  # as on the OpenAI routes: {"speculation": "off", "k": 4}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        return stop_strings(v)

    @model_validator(mode="after")
    def _unsupported(self) -> InfillRequest:
        extra = self.model_extra or {}
        bad = [f"{k}={extra[k]!r}" for k in NEUTRAL if k in extra and not _neutral(extra[k], NEUTRAL[k])]
        self.chain()  # an unknown sampler, named
        penalised = (self.repeat_penalty not in (None, 1) or bool(self.presence_penalty) or bool(self.frequency_penalty))
        if penalised and self.repeat_last_n not in (None, PENALTY_LAST_N):
            bad.append(f"repeat_last_n={self.repeat_last_n!r} (the penalty window is {PENALTY_LAST_N})")
        if bad:
            raise ValueError(f"not supported (it would change the answer): {', '.join(bad)}")
        return self

    def limit(self) -> int | None:
        """Tokens to write: None = the server's default, 0 = none (the prompt is only evaluated)."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if n is None or n < 0 else n

    def chain(self) -> list[str] | None:
        """The sampler order asked for; None: homespec's own (none given, or nothing is sampled:
        n_predict 0, which editors send with `samplers: []` to warm the cache)."""
        if self.samplers is None or self.limit() == 0:
            return None
        return sampler_chain(self.samplers)

    def sampling(self) -> dict[str, Any]:
        """build_request's overrides. With `samplers`, one not listed does nothing, as in llama.cpp
        (temperature 1, no cut, no penalty), whatever value the request gave it."""
        s = llama_sampling(self)
        chain = self.chain()
        if chain is not None:
            unlisted = {"temperature": {"temperature": 1.0}, "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0},
                        "min_p": {"min_p": 0.0},
                        "penalties": {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}}
            for name, neutral in unlisted.items():
                if name not in chain:
                    s.update(neutral)
        return s

    def stops(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


def llama_sampling(o: Any) -> dict[str, Any]:
    """llama.cpp's sampling options, which Ollama shares (temperature, top_k, top_p, min_p,
    repeat_penalty, presence_penalty, frequency_penalty, seed), as build_request's overrides;
    None = the server's default. temperature <= 0 is greedy, top_k <= 0 off, a negative seed a
    fresh one."""
    return {
        "temperature": None if o.temperature is None else max(0.0, o.temperature),
        "top_k": None if o.top_k is None else max(0, o.top_k),
        "top_p": o.top_p,
        "min_p": o.min_p,
        "repetition_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
        "seed": None if o.seed is None or o.seed < 0 else o.seed,
    }


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
        "tokens_cached": st.cached_tokens,
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
