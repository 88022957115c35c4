"""llama.cpp server's sampling options beyond OpenAI's, as the clients written for llama-server
send them on every request (llama.vscode, llama.vim, llama.cpp's web UI): shared by `/infill`
and the OpenAI routes.

- `samplers` orders the sampling steps (a list of names, or a string of one-letter codes such as
  "edkypmxt"): those listed act in that order, one not listed does nothing (no temperature listed
  is temperature 1), as in llama.cpp. It becomes SamplingParams.order (sampling.py); `infill` is
  llama.cpp's infill sampler (speculation/infill_sampler.py).
- `repeat_penalty` is homespec's repetition_penalty; `repeat_last_n` must be its window (64)
  whenever a penalty is on.
- The samplers homespec lacks (dynamic temperature, typical-p, XTC, DRY, mirostat, top-n-sigma)
  are accepted at the value where they do nothing, and so are their companions (xtc_threshold
  without xtc_probability, ...); any other value would change the answer, so it is refused by
  name, never dropped.
- Cache and slot controls (`cache_prompt`, `id_slot`, `t_max_prompt_ms`, ...) have nothing to do
  here: homespec's prefix cache is always on and picks its own slot.
- `n_predict` is max_tokens by llama.cpp's name (0: see llama_limit); `response_fields` shapes
  llama.cpp's own answers only, so the OpenAI routes accept it and answer in OpenAI's shape, as
  llama-server does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from homespec.errors import UserError
from homespec.serving.request_types import Flag, Integer, Number
from homespec.speculation.sampling import DEFAULT_ORDER, SamplingParams

# llama.cpp's penalty window when none is given; homespec's is fixed at the same 64 (sampling.py).
PENALTY_LAST_N = 64

# Sampling options homespec does not implement, with the values at which they do nothing.
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


class LlamaCppOptions(BaseModel):
    """The options, declared so that a request model refusing unknown fields accepts them."""

    samplers: list[str] | str | None = None
    n_predict: Integer | None = Field(None, ge=-1)  # llama.cpp's max_tokens: -1 the server's default, 0 the prompt only
    repeat_penalty: Number | None = Field(None, gt=0, le=10)  # homespec's repetition_penalty
    repeat_last_n: Integer | None = None
    # The samplers homespec lacks (NEUTRAL) ...
    dynatemp_range: Number | None = None
    typical_p: Number | None = None
    dry_multiplier: Number | None = None
    xtc_probability: Number | None = None
    mirostat: Integer | None = None
    top_n_sigma: Number | None = None
    min_keep: Integer | None = None
    n_probs: Integer | None = None
    ignore_eos: Flag | None = None
    # ... and what only tunes them: nothing to do while they are off.
    dynatemp_exponent: Number | None = None
    xtc_threshold: Number | None = None
    dry_base: Number | None = None
    dry_allowed_length: Integer | None = None
    dry_penalty_last_n: Integer | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat_tau: Number | None = None
    mirostat_eta: Number | None = None
    # Cache and slot controls: homespec's prefix cache is always on and picks its own slot.
    cache_prompt: Flag | None = None
    id_slot: Integer | None = None
    t_max_prompt_ms: Integer | None = None
    timings_per_token: Flag | None = None
    return_progress: Flag | None = None
    # llama.cpp shapes only its own answers with it (/completion, /infill), never OpenAI's.
    response_fields: list[str] | None = None

    @field_validator(*NEUTRAL)
    @classmethod
    def _does_nothing(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v not in NEUTRAL[str(info.field_name)]:  # by ==: 1.0 is 1
            raise ValueError(f"not supported (it would change the answer): {info.field_name}={v!r}")
        return v

    @model_validator(mode="after")
    def _llama_cpp_options(self) -> LlamaCppOptions:
        self.chain()  # an unknown sampler, named
        penalised = (self.repeat_penalty not in (None, 1) or getattr(self, "repetition_penalty", None) not in (None, 1)
                     or bool(getattr(self, "presence_penalty", None))
                     or bool(getattr(self, "frequency_penalty", None)))
        if penalised and self.repeat_last_n not in (None, PENALTY_LAST_N):
            raise ValueError(f"not supported (it would change the answer): repeat_last_n={self.repeat_last_n!r} "
                             f"(the penalty window is {PENALTY_LAST_N})")
        return self

    def llama_limit(self) -> int | None:
        """n_predict as a token limit; None: the server's default (unset or -1). 0, with which
        llama.cpp reads the prompt into its cache and writes nothing (editors warm the cache so),
        writes one token here: homespec's generation writes at least one."""
        n = self.n_predict
        return None if n is None or n < 0 else max(1, n)

    def samples(self) -> bool:
        """Whether anything is sampled (llama.cpp's n_predict 0 evaluates the prompt only)."""
        return True

    def chain(self) -> list[str] | None:
        """The sampler order asked for; None: homespec's own (none given, or nothing is sampled:
        editors send `samplers: []` with n_predict 0 to warm the cache)."""
        if self.samplers is None or not self.samples():
            return None
        return sampler_chain(self.samplers)

    def with_llama_options(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """build_request's sampling overrides (None = the server's default) with repeat_penalty,
        and, under `samplers`, every step not listed doing nothing, whatever value it was given."""
        s = dict(sampling)
        if self.repeat_penalty is not None:
            if s.get("repetition_penalty") not in (None, self.repeat_penalty):
                raise UserError("repeat_penalty and repetition_penalty differ: send one of them")
            s["repetition_penalty"] = self.repeat_penalty
        chain = self.chain()
        if chain is not None:
            unlisted = {"temperature": {"temperature": 1.0}, "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0},
                        "min_p": {"min_p": 0.0},
                        "penalties": {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}}
            for name, neutral in unlisted.items():
                if name not in chain:
                    s.update(neutral)
        return s


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
