"""Every field of OpenAI's two request types is supported, ignored for a reason, or refused by name;
the request models and the README's table say the same as openai_fields.py."""

from __future__ import annotations

import re
from typing import Any

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
from pydantic import BaseModel, ValidationError

from homespec.serving.openai_api import ChatRequest, CompletionRequest
from homespec.serving.openai_fields import CHAT, COMPLETIONS, REFUSED, refusal
from tests.conftest import ROOT

# Declared by the constrained-decoding work (tools), which owns these fields of ChatRequest.
TOOLS_WORK = {"tool_choice", "parallel_tool_calls", "functions", "function_call"}

# What a client asking for the refused feature sends.
ASKS = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "n": 2,
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "best_of": 2,
    "echo": True,
}
# A value of each ignored field, as a client sends it.
IGNORED_VALUES = {
    "user": "u-42",
    "safety_identifier": "hash-42",
    "metadata": {"team": "a"},
    "store": True,
    "service_tier": "flex",
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "def f(): pass"},
}
CHAT_MIN = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION_MIN = {"prompt": "hi"}


def openai_fields(module: Any) -> set[str]:
    params = module.CompletionCreateParamsNonStreaming
    return set(params.__required_keys__) | set(params.__optional_keys__)


@pytest.mark.parametrize("module, table", [(chat_params, CHAT), (completion_params, COMPLETIONS)], ids=["chat", "completions"])
def test_every_field_of_the_openai_client_is_classified(module: Any, table: dict) -> None:
    assert openai_fields(module) == set(table)


@pytest.mark.parametrize("model, table, extra", [(ChatRequest, CHAT, TOOLS_WORK), (CompletionRequest, COMPLETIONS, set())],
                         ids=["chat", "completions"])
def test_every_classified_field_is_declared_by_the_request_model(model: type[BaseModel], table: dict, extra: set[str]) -> None:
    """Declared, so extra='forbid' does not refuse an ignored field as unknown."""
    assert set(table) - set(model.model_fields) <= extra


def request(model: type[BaseModel], **fields: Any) -> BaseModel:
    base = CHAT_MIN if model is ChatRequest else COMPLETION_MIN
    return model.model_validate({**base, **fields})


def both_endpoints(names: dict[str, Any]) -> list[tuple[type[BaseModel], str, Any]]:
    return [(m, name, v) for m, table in ((ChatRequest, CHAT), (CompletionRequest, COMPLETIONS))
            for name, v in names.items() if name in table]


@pytest.mark.parametrize("model, name, value", both_endpoints(ASKS), ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_refused_field_is_refused_naming_it(model: type[BaseModel], name: str, value: Any) -> None:
    assert (CHAT.get(name) or COMPLETIONS[name]).status == "refused"
    with pytest.raises(ValidationError) as e:
        request(model, **{name: value})
    err = e.value.errors()[0]
    assert err["loc"] == (name,) or name in err["msg"], err  # echo: refused by the model validator, by name


def test_refused_fields_have_an_example_here() -> None:
    assert set(REFUSED) == set(ASKS)


@pytest.mark.parametrize("model, name, value", both_endpoints({"n": 1, "modalities": ["text"], "best_of": 1, "echo": False}),
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_refused_field_set_to_what_asks_for_nothing_is_accepted(model: type[BaseModel], name: str, value: Any) -> None:
    request(model, **{name: value})


@pytest.mark.parametrize("model, name, value", both_endpoints(IGNORED_VALUES), ids=lambda x: getattr(x, "__name__", str(x)))
def test_an_ignored_field_is_accepted(model: type[BaseModel], name: str, value: Any) -> None:
    assert (CHAT.get(name) or COMPLETIONS[name]).status == "ignored"
    request(model, **{name: value})


def test_every_ignored_field_has_a_value_here() -> None:
    ignored = {n for t in (CHAT, COMPLETIONS) for n, r in t.items() if r.status == "ignored"}
    assert ignored == set(IGNORED_VALUES)


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest])
@pytest.mark.parametrize("name", ["top_a", "tfs_z", "stream_option"])  # neither OpenAI's nor llama.cpp's (llama_options.py)
def test_a_field_openai_does_not_define_is_refused_naming_it(model: type[BaseModel], name: str) -> None:
    with pytest.raises(ValidationError) as e:
        request(model, **{name: 1})
    assert e.value.errors()[0]["loc"] == (name,) and e.value.errors()[0]["type"] == "extra_forbidden"


def test_chat_only_fields_are_unknown_to_completions() -> None:
    with pytest.raises(ValidationError, match="store"):
        request(CompletionRequest, store=True)


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-3": 1}, {"1.5": 1}, {"7": 101}, {"7": -100.5}, {"7": float("nan")}])
def test_logit_bias_keys_are_token_ids_and_biases_lie_within_100(bias: dict) -> None:
    with pytest.raises(ValidationError) as e:
        request(ChatRequest, logit_bias=bias)
    assert e.value.errors()[0]["loc"][0] == "logit_bias"


def test_logit_bias_reaches_the_request_as_token_ids() -> None:
    assert request(ChatRequest, logit_bias={"7": -100, "12": 2.5}).token_bias() == {7: -100.0, 12: 2.5}  # type: ignore[attr-defined]
    assert request(CompletionRequest).token_bias() is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "fields, top",
    [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 20}, 20)],
)
def test_chat_logprobs_and_top_logprobs_give_the_alternatives_wanted(fields: dict, top: int | None) -> None:
    assert request(ChatRequest, **fields).logprobs_top() == top  # type: ignore[attr-defined]


@pytest.mark.parametrize("fields, where", [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                            ({"logprobs": False, "top_logprobs": 1}, "top_logprobs")])
def test_top_logprobs_needs_logprobs_and_stays_within_20(fields: dict, where: str) -> None:
    with pytest.raises(ValidationError) as e:
        request(ChatRequest, **fields)
    assert e.value.errors()[0]["loc"] == (where,)


@pytest.mark.parametrize("logprobs, ok", [(0, True), (5, True), (6, False), (-1, False)])
def test_completion_logprobs_lie_within_0_and_5(logprobs: int, ok: bool) -> None:
    if ok:
        assert request(CompletionRequest, logprobs=logprobs).logprobs_top() == logprobs  # type: ignore[attr-defined]
    else:
        with pytest.raises(ValidationError):
            request(CompletionRequest, logprobs=logprobs)


def test_refusal_accepts_null_and_names_what_is_missing() -> None:
    assert refusal("audio", None) is None
    assert "text only" in (refusal("audio", {"voice": "alloy"}) or "")
    assert refusal("n", True) is not None  # True == 1, but it is not the count 1


def readme_table(title: str) -> dict[str, str]:
    """field -> status word from the README table under the heading `title`."""
    lines = (ROOT / "README.md").read_text().split(title, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[1].split()[0].lower()
    return rows


@pytest.mark.parametrize("title, table", [("Chat completions fields", CHAT), ("Completions fields", COMPLETIONS)])
def test_the_readme_table_says_what_the_code_does(title: str, table: dict) -> None:
    assert readme_table(title) == {name: rule.status for name, rule in table.items()}
