"""llama.cpp server's sampling options (homespec/serving/llama_options.py): the order `samplers`
asks for, and the same options on the OpenAI routes, as clients written for llama-server send them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from homespec.errors import UserError
from homespec.serving.llama_options import sampling_order
from homespec.serving.openai_api import ChatRequest, CompletionRequest
from homespec.speculation.sampling import SamplingParams

# llama.vscode's "edit with AI" request (src/llama-server.ts, createChatEditRequestPayload): llama.cpp's
# whole default sampling set, llama.cpp's default order.
LLAMA_VSCODE_EDIT = {
    "messages": [{"role": "system", "content": "You are an expert coder."}, {"role": "user", "content": "rename x to y"}],
    "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0,
    "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1, "xtc_probability": 0,
    "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0,
    "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1,
    "timings_per_token": False,
}


@pytest.mark.parametrize(("names", "params", "order"), [
    # llama.cpp's default order: the cuts on the untempered distribution, tempered last
    (["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
     SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1),
     ("top_k", "top_p", "min_p", "temperature")),
    (["top_k", "top_p", "infill"], SamplingParams(temperature=1.0, top_k=40, top_p=0.99), ("top_k", "top_p", "infill")),
    (["top_p", "temperature", "infill"], SamplingParams(temperature=0.0, top_p=0.9), ("top_p", "temperature", "infill")),
    (["top_k", "top_k", "temperature"], SamplingParams(temperature=0.7, top_k=0), ("top_k", "temperature")),  # twice, doing nothing
    (["temperature", "penalties"], SamplingParams(temperature=0.7), ("temperature",)),  # penalties off: no order to keep
])
def test_a_listed_order_becomes_the_order_homespec_samples_in(names, params, order):
    assert sampling_order(names, params) == order


@pytest.mark.parametrize(("names", "params", "message"), [
    (["temperature", "penalties"], SamplingParams(temperature=0.0, repetition_penalty=1.2), "'penalties' after 'temperature'"),
    (["top_p", "infill"], SamplingParams(temperature=1.0, top_p=0.9), "needs a top_k"),
    (["infill", "top_k"], SamplingParams(temperature=1.0, top_k=40), "needs a top_k"),
    (["top_k", "infill"], SamplingParams(temperature=1.0, top_k=1000), "needs a top_k of 1-256"),
    (["top_k", "infill", "temperature"], SamplingParams(temperature=0.0, top_k=40), "'infill' before a temperature of 0"),
    (["temperature", "temperature"], SamplingParams(temperature=0.5), "listed twice"),
])
def test_an_order_homespec_cannot_sample_in_is_refused_by_name(names, params, message):
    with pytest.raises(UserError, match=message):
        sampling_order(names, params)


def test_llama_vscodes_edit_request_is_an_openai_chat_request_in_llama_cpps_order():
    r = ChatRequest.model_validate(LLAMA_VSCODE_EDIT)
    assert r.chain() == ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert r.limit() is None  # -1: the server's default
    s = r.with_llama_options({"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p, "min_p": r.min_p,
                              "repetition_penalty": r.repetition_penalty})
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["repetition_penalty"]) == (0.8, 40, 0.95, 0.05, 1)


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest])
@pytest.mark.parametrize(("field", "value"), [("mirostat", 2), ("typical_p", 0.9), ("xtc_probability", 0.5),
                                              ("dry_multiplier", 0.8), ("n_probs", 5), ("ignore_eos", True)])
def test_a_llama_cpp_sampler_homespec_lacks_is_refused_by_name_unless_it_does_nothing(model, field, value):
    base = {"messages": [{"role": "user", "content": "hi"}]} if model is ChatRequest else {"prompt": "hi"}
    with pytest.raises(ValidationError, match=f"not supported .*{field}"):
        model.model_validate({**base, field: value})
    neutral = {"mirostat": 0, "typical_p": 1.0, "xtc_probability": 0, "dry_multiplier": 0, "n_probs": 0, "ignore_eos": False}
    model.model_validate({**base, field: neutral[field], "xtc_threshold": 0.1, "dry_base": 1.75, "cache_prompt": True})


def test_repeat_penalty_is_repetition_penalty_and_two_different_values_are_refused():
    r = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "repeat_penalty": 1.1})
    assert r.with_llama_options({"repetition_penalty": None})["repetition_penalty"] == 1.1
    r = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "repeat_penalty": 1.1,
                                    "repetition_penalty": 1.2})
    with pytest.raises(UserError, match="repeat_penalty and repetition_penalty differ"):
        r.with_llama_options({"repetition_penalty": 1.2})


def test_max_tokens_zero_is_refused_and_minus_one_is_the_default():
    with pytest.raises(ValidationError, match="at least 1"):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert CompletionRequest.model_validate({"prompt": "hi", "max_tokens": -1}).limit() is None


def test_n_predict_is_max_tokens_by_llama_cpps_name_and_zero_writes_one_token():
    # llama.vim's instruct warm-up (autoload/llama.vim): read the prompt into the cache, write nothing
    warm = ChatRequest.model_validate({"id_slot": 0, "messages": [{"role": "user", "content": "hi"}], "samplers": [],
                                       "n_predict": 0, "stream": False, "cache_prompt": True, "response_fields": [""]})
    assert warm.limit() == 1 and warm.chain() == []
    assert CompletionRequest.model_validate({"prompt": "hi", "n_predict": 7}).limit() == 7
    assert CompletionRequest.model_validate({"prompt": "hi", "n_predict": -1}).limit() is None
    assert CompletionRequest.model_validate({"prompt": "hi", "n_predict": 7, "max_tokens": 3}).limit() == 3  # OpenAI's first


def test_a_penalty_by_either_name_needs_the_window_homespec_has():
    with pytest.raises(ValidationError, match="repeat_last_n"):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.3, "repeat_last_n": 256})
