"""What homespec does with each field of OpenAI's chat completions and completions requests.

Every field the OpenAI API defines for the two endpoints is listed here as one of:
- supported: honoured with OpenAI's meaning (the note says how, where it matters);
- ignored: accepted and dropped, because it cannot change the answer (the note says why);
- refused: a 400 that names the field, unless it is set to the value that asks for nothing
  (null always; `harmless` lists the others, e.g. n = 1): accepting it and answering without it
  would hand the client something other than what it asked for.
Fields OpenAI does not define are refused too (the request models forbid extra fields), except
homespec's own: top_k, min_p, repetition_penalty and the `homespec` object; and llama.cpp
server's sampling options (llama_options.py), which follow the same rule: honoured, ignored where
they cannot change the answer, or refused by name.

The request models (openai_api.py) declare the fields and call `refusal`; the README's table is
this one in prose, and tests/unit/test_openai_fields.py checks all three against the fields of the
installed `openai` client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["supported", "ignored", "refused"]


@dataclass(frozen=True)
class Rule:
    status: Status
    note: str
    harmless: tuple[Any, ...] = ()  # refused fields: values besides null that ask for nothing


def _same(note: str) -> Rule:
    return Rule("supported", note)


def _ignored(why: str) -> Rule:
    return Rule("ignored", why)


def _refused(why: str, *harmless: Any) -> Rule:
    return Rule("refused", why, harmless)


_N = _refused("one completion per request; n > 1 is not supported", 1)
_STOP = _same("never emitted, even when a speculative step runs past it")
_STREAM_OPTIONS = _same("include_usage; include_obfuscation is ignored (no padding field is sent)")
_LOGIT_BIAS = _same("added to the logits in the one sampling transform (target and proposers alike); "
                    "token ids are checked against the target's vocabulary")
_SEED = _same("the same output for every proposer and k")
_USER = _ignored("an end-user id for OpenAI's abuse monitoring; nothing here uses it")

CHAT: dict[str, Rule] = {
    "messages": _same("text content; other content parts (images, audio) are refused"),
    "model": _same("the served model's id, or `homespec`; any other name is a 404"),
    "audio": _refused("homespec generates text only"),
    "frequency_penalty": _same("over the last 64 tokens, as llama.cpp"),
    "function_call": _same("constrained decoding"),
    "functions": _same("constrained decoding"),
    "logit_bias": _LOGIT_BIAS,
    "logprobs": _same("the target's log-probabilities from the rows that verified each token (no extra pass): "
                      "logit_bias and penalties applied, temperature and truncation not"),
    "max_completion_tokens": _same(""),
    "max_tokens": _same(""),
    "metadata": _ignored("nothing is stored"),
    "modalities": _refused("homespec generates text only", ["text"]),
    "moderation": _refused("there is no moderation model"),
    "n": _N,
    "parallel_tool_calls": _same("constrained decoding"),
    "prediction": _ignored("at OpenAI it changes only the speed, never the answer; "
                           "prompt lookup already drafts from the text in the prompt"),
    "presence_penalty": _same("over the last 64 tokens, as llama.cpp"),
    "prompt_cache_key": _ignored("the prefix cache is automatic (usage.prompt_tokens_details.cached_tokens)"),
    "prompt_cache_options": _ignored("the prefix cache is automatic"),
    "prompt_cache_retention": _ignored("the prefix cache is automatic"),
    "reasoning_effort": _refused("no reasoning switch is passed to the model"),
    "response_format": _same("constrained decoding"),
    "safety_identifier": _USER,
    "seed": _SEED,
    "service_tier": _ignored("there is one tier"),
    "stop": _STOP,
    "store": _ignored("nothing is stored"),
    "stream": _same("server-sent events, `data:` lines only, from the first token (no comment pings unless server.sse_ping_s)"),
    "stream_options": _STREAM_OPTIONS,
    "temperature": _same(""),
    "tool_choice": _same("constrained decoding"),
    "tools": _same("constrained decoding"),
    "top_logprobs": _same("0-20 alternatives per token; needs logprobs: true"),
    "top_p": _same(""),
    "user": _USER,
    "verbosity": _refused("no verbosity switch is passed to the model"),
    "web_search_options": _refused("there is no web search"),
}

COMPLETIONS: dict[str, Rule] = {
    "model": CHAT["model"],
    "prompt": _same("one string (or a list of one); token-id and batched prompts are refused"),
    "best_of": _refused("one completion per request; best_of > 1 is not supported", 1),
    "echo": _refused("the prompt is not repeated in the answer", False),
    "frequency_penalty": CHAT["frequency_penalty"],
    "logit_bias": _LOGIT_BIAS,
    "logprobs": _same("0-5 alternatives per token, from the rows that verified each token (as in chat); "
                      "text_offset counts from the start of the completion"),
    "max_tokens": _same(""),
    "n": _N,
    "presence_penalty": CHAT["presence_penalty"],
    "seed": _SEED,
    "stop": _STOP,
    "stream": CHAT["stream"],
    "stream_options": _STREAM_OPTIONS,
    "suffix": _same("fill-in-the-middle"),
    "temperature": _same(""),
    "top_p": _same(""),
    "user": _USER,
}

REFUSED: dict[str, Rule] = {name: r for t in (CHAT, COMPLETIONS) for name, r in t.items() if r.status == "refused"}


def refusal(name: str, value: Any) -> str | None:
    """Why a request that sets `name` to `value` is refused, or None when it asks for nothing."""
    rule = REFUSED[name]
    if value is None or any(value == h and type(value) is type(h) for h in rule.harmless):
        return None
    return f"not supported: {rule.note}"
