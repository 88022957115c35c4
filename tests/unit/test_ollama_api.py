"""Ollama's request and response shapes (serving/ollama_api.py) and the daemon's per-request
keep_alive, without weights: the daemon runs over the fake host of test_daemon_faults."""

from __future__ import annotations

import json
import math
import queue
import time
from datetime import datetime

import pytest
from pydantic import ValidationError

from homespec.serving import ollama_api as ol
from homespec.serving.daemon import Job, JobEvent
from homespec.serving.host import GenerationRequest
from homespec.serving.tool_calls import Call
from homespec.speculation.engine import GenerationStats
from tests.unit.test_daemon_faults import FakeHost, final, make_daemon, submit, wait_for


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(300, 300.0), (300.9, 300.0), (0, 0.0), (-1, math.inf), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5),
     ("10ms", 0.01), ("-1.0s", math.inf), ("-5m", math.inf), ("0", 0.0), ("300", 300.0), ("-1", math.inf), (None, None)],
)
def test_keep_alive_reads_numbers_as_seconds_and_go_durations(value: object, seconds: float | None) -> None:
    assert ol.parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [1e300, 1e18, math.inf, ol.FOREVER_S, "9999999999999h", "1" + "0" * 400])
def test_a_keep_alive_past_what_a_clock_can_show_is_forever_and_ps_can_show_it(value: object) -> None:
    # 1e300 s made /api/ps answer 500 (datetime.fromtimestamp overflowed) until a later request reset it
    seconds = ol.parse_keep_alive(value)
    assert seconds == math.inf
    assert ol.expiry(time.time() + seconds).endswith("Z")


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "m", True, [5], math.nan])
def test_keep_alive_that_is_no_duration_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        ol.parse_keep_alive(value)


def test_integer_options_sent_as_floats_are_truncated_as_go_does() -> None:
    o = ol.Options.model_validate({"num_ctx": 8192.0, "num_predict": 20.0, "top_k": 40.0, "seed": 7.9, "repeat_last_n": 64.0})
    assert (o.num_predict, o.top_k, o.seed, o.num_ctx) == (20, 40, 7, 8192)


def test_unknown_option_keys_are_ignored_but_known_ones_keep_their_type() -> None:
    assert ol.Options.model_validate({"no_such_option": "x"}).limit(4096) is None
    with pytest.raises(ValidationError, match="num_ctx"):
        ol.Options.model_validate({"num_ctx": "big"})
    with pytest.raises(ValidationError, match="use_mmap"):
        ol.Options.model_validate({"use_mmap": "maybe"})


@pytest.mark.parametrize("options", [{"num_predict": "8"}, {"top_k": True}, {"seed": "1"}, {"temperature": "0.5"},
                                     {"temperature": True}, {"use_mmap": 1}, {"numa": "false"}])
def test_options_of_another_json_type_are_refused_by_name_as_ollama_refuses_them(options: dict) -> None:
    # Ollama: `option "num_predict" must be of type integer`; lax pydantic read "8" as 8 and true as 1.
    with pytest.raises(ValidationError, match=next(iter(options))):
        ol.Options.model_validate(options)


@pytest.mark.parametrize(("field", "value"), [("stream", "false"), ("stream", 0), ("raw", "yes"), ("logprobs", 1),
                                              ("top_logprobs", "3")])
def test_request_fields_of_another_json_type_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        ol.GenerateRequest.model_validate({"model": "m", "prompt": "hi", field: value})


@pytest.mark.parametrize(
    "options",
    [{"typical_p": 0.5}, {"tfs_z": 0.9}, {"mirostat": 2}, {"repeat_penalty": 1.2, "repeat_last_n": 128}, {"num_predict": 0}],
)
def test_options_that_would_change_the_answer_without_effect_here_are_refused(options: dict) -> None:
    with pytest.raises(ValidationError):
        ol.Options.model_validate(options)


def test_neutral_values_of_missing_options_are_accepted() -> None:
    ol.Options.model_validate({"typical_p": 1.0, "tfs_z": 1, "mirostat": 0, "mirostat_tau": 5.0, "repeat_last_n": 32, "num_gpu": -1})


def test_options_map_onto_sampling_with_ollamas_meanings() -> None:
    o = ol.Options.model_validate({"temperature": 0.7, "top_k": -1, "seed": -1, "repeat_penalty": 1.1, "num_predict": -1})
    s = o.sampling()
    assert s["top_k"] == 0 and s["seed"] is None and s["repetition_penalty"] == 1.1 and s["temperature"] == 0.7
    assert o.limit(4096) == 4096  # -1: until the context is full
    assert ol.Options.model_validate({"num_predict": 12}).limit(4096) == 12


def test_messages_take_tool_calls_with_object_or_string_arguments_and_results_by_tool_name() -> None:
    req = ol.ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "31"},
    ]})
    user, call1, call2, result = req.template_messages()
    assert user == {"role": "user", "content": "weather?"}
    assert call1["content"] == "" and call1["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert call2["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert result == {"role": "tool", "content": "31", "name": "get_weather"}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}, "arguments"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"think": True}, "thinking"),
        ({"think": "high"}, "thinking"),
        ({"format": "yaml"}, "format"),
        ({"keep_alive": "later"}, "keep_alive"),
        ({"model": ""}, "model"),
    ],
)
def test_bad_chat_requests_are_refused_naming_the_field(body: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ol.ChatRequest.model_validate({"model": "m", **body})


def test_think_false_and_an_empty_format_are_accepted() -> None:
    req = ol.ChatRequest.model_validate({"model": "m", "think": False, "format": "", "keep_alive": "5m"})
    assert req.keep_alive == 300.0 and req.stream and not req.messages


@pytest.mark.parametrize(("body", "words"), [({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
                                             ({"images": ["aGk="]}, "images")])
def test_generate_refuses_what_it_cannot_honour(body: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ol.GenerateRequest.model_validate({"model": "m", "prompt": "hi", **body})


def test_an_empty_generate_only_loads_and_a_suffix_alone_is_infill() -> None:
    assert ol.GenerateRequest(model="m").load_only()
    assert not ol.GenerateRequest(model="m", suffix="}").load_only()
    assert ol.GenerateRequest(model="m", template="", context=[]).prompt == ""


def test_metrics_are_nanoseconds_split_into_prompt_and_answer_and_count_only_evaluated_prompt_tokens() -> None:
    st = GenerationStats(prompt_tokens=30, cached_tokens=10, completion_tokens=10, prefill_s=0.5, total_s=2.0)
    m = ol.metrics(st, load_s=0.25, total_s=2.5)
    assert m == {"total_duration": 2_500_000_000, "load_duration": 250_000_000, "prompt_eval_count": 20,
                 "prompt_eval_duration": 500_000_000, "eval_count": 10, "eval_duration": 1_500_000_000}
    assert ol.metrics(None, load_s=1.0, total_s=1.0) == {"total_duration": 10**9, "load_duration": 10**9}


def test_done_reasons_are_ollamas() -> None:
    assert [ol.done_reason(r) for r in ("stop", "length", "context", "cancelled", None, "load", "unload")] == \
        ["stop", "length", "length", "stop", "stop", "load", "unload"]


def test_tool_calls_carry_arguments_as_objects_and_an_index() -> None:
    calls = ol.tool_calls([Call("call_1", "get_weather", json.dumps({"city": "Paris"})), Call("call_2", "set_light", "{}")])
    assert calls == [{"id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}},
                     {"id": "call_2", "function": {"index": 1, "name": "set_light", "arguments": {}}}]


def test_details_use_the_size_label_or_the_weight_count() -> None:
    d = ol.details({"general.architecture": "qwen2", "general.size_label": "1.5B"}, 1_777_088_000, "Q4_K_M")
    assert d["family"] == "qwen2" and d["families"] == ["qwen2"] and d["parameter_size"] == "1.5B" and d["quantization_level"] == "Q4_K_M"
    assert ol.details({"general.architecture": "llama"}, 134_515_008, None)["parameter_size"] == "134.5M"


def test_timestamps_are_rfc3339_in_utc() -> None:
    t = ol.timestamp(1_700_000_000.25)
    assert t == "2023-11-14T22:13:20.250000Z"
    assert datetime.fromisoformat(ol.expiry(math.inf).replace("Z", "+00:00")).year > 2200


# -- the daemon's keep_alive -----------------------------------------------------------------------


def _job(events: queue.Queue[JobEvent], keep_alive_s: float | None, generate: bool = True) -> Job:
    encode = (lambda models: models.encode_chat([{"role": "user", "content": "hi"}])) if generate else None
    return Job(GenerationRequest(), sink=events.put, encode=encode, keep_alive_s=keep_alive_s)


def test_keep_alive_zero_unloads_after_the_request_and_the_next_one_loads_again() -> None:
    hosts: list[FakeHost] = []
    d = make_daemon(lambda cfg, **kw: hosts.append(FakeHost()) or hosts[-1])  # keep_alive_s None: forever
    d.start()
    try:
        wait_for(lambda: d.ready, "the first load")
        assert d.expires_at() == math.inf
        events: queue.Queue[JobEvent] = queue.Queue()
        d.submit(_job(events, keep_alive_s=0))
        assert final(events).kind == "done"
        wait_for(lambda: d.state == "unloaded", "the unload after keep_alive 0")
        assert hosts[0].closed and d.expires_at() is None
        started = submit(d)  # no keep_alive: the config's (forever) again
        assert final(started).kind == "done"
        assert len(hosts) == 2 and d.ready and d.expires_at() == math.inf
    finally:
        d.shutdown(timeout_s=5)


def test_a_request_keep_alive_sets_the_expiry_and_the_next_request_without_one_restores_the_default() -> None:
    d = make_daemon(lambda cfg, **kw: FakeHost(), keep_alive_s=600)
    d.start()
    try:
        wait_for(lambda: d.ready, "the first load")
        events: queue.Queue[JobEvent] = queue.Queue()
        d.submit(_job(events, keep_alive_s=math.inf))
        final(events)
        wait_for(lambda: d.expires_at() == math.inf, "keep_alive forever to apply")
        d.submit(_job(events, keep_alive_s=None))
        final(events)
        wait_for(lambda: d.expires_at() != math.inf, "the config's keep_alive to return")
        expires = d.expires_at()
        assert expires is not None and 0 < expires - time.time() <= 600
    finally:
        d.shutdown(timeout_s=5)


def test_an_empty_request_loads_and_one_with_keep_alive_zero_unloads_without_loading() -> None:
    hosts: list[FakeHost] = []
    d = make_daemon(lambda cfg, **kw: hosts.append(FakeHost()) or hosts[-1])
    d.start()
    try:
        wait_for(lambda: d.ready, "the first load")
        events: queue.Queue[JobEvent] = queue.Queue()
        d.submit(_job(events, keep_alive_s=0, generate=False))
        assert final(events).finish_reason == "unload"
        assert d.state == "unloaded" and hosts[0].closed
        d.submit(_job(events, keep_alive_s=0, generate=False))  # already unloaded: nothing is loaded for it
        assert final(events).finish_reason == "unload" and len(hosts) == 1
        d.submit(_job(events, keep_alive_s=None, generate=False))
        started = events.get(timeout=20)
        assert started.kind == "started" and started.extra["load_s"] >= 0
        assert final(events).finish_reason == "load" and d.ready and len(hosts) == 2
    finally:
        d.shutdown(timeout_s=5)


def test_a_streamed_answer_that_is_one_call_with_no_marker_ends_with_its_tool_calls() -> None:
    """Held to its end (it opens with a brace), then sent as Ollama's tool_calls before the done object."""
    from homespec.serving.routes.ollama import _Reply
    from homespec.serving.tool_calls import HERMES, ToolUse

    reply = _Reply(None, "chat", "m", ToolUse(HERMES, ["turn_on"], False), {}, time.perf_counter())  # type: ignore[arg-type]
    text = '{{"name": "turn_on", "arguments": {"entity": "kitchen"}}}'
    assert reply.push(JobEvent("delta", text=text[:9])) + reply.push(JobEvent("delta", text=text[9:])) == []
    *sent, done = reply.finish(JobEvent("done", finish_reason="stop"))
    (call,) = [c for chunk in sent for c in chunk["message"]["tool_calls"]]
    assert call["function"] == {"index": 0, "name": "turn_on", "arguments": {"entity": "kitchen"}}
    assert done["done"] and done["message"]["content"] == ""
