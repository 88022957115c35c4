"""The OpenAI-compatible daemon end to end: real uvicorn on loopback, real small models.

Clients: the official `openai` package for the happy paths, raw httpx (and a raw socket) where a
test needs to send what no client would send or to hang up at a chosen moment.

Greedy texts are compared across modes and between streaming and not. DESIGN.md says greedy
speculative output equals plain output only up to near ties (top-2 logit margin below the batch
noise); the prompts and lengths here were picked for margins >= 1.4 logits at every emitted
position (measured with the target alone), far above the ~0.2 noise, so equality is expected.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from homespec.serving.stats_schema import StatsView
from tests.integration.server_fixtures import API_KEY, MAX_BODY, N_CTX, QUEUE_DEPTH, Served, wait_for

pytestmark = pytest.mark.integration

# Prompts with large top-2 margins over the lengths used (see the module docstring).
PARIS = "What is the capital of France? Answer with one word."  # "Paris"
DAYS = "List the days of the week, one per line."  # "Monday\nTuesday\n..."
FOX = "Repeat exactly: the quick brown fox jumps over the lazy dog"  # copies the prompt: ngram finds matches
ADD = "Write a Python function `add(a, b)` that returns a + b. Output only the code."
LONG = "Write the numbers from 1 to 500, one per line."  # long output, for cancel and queue tests
COMPLETION_PROMPT = "def add(a, b):\n    return"

WAIT_S = 300  # bounded waits for liveness; generous because the 2 cores are shared


# -- helpers --------------------------------------------------------------------------------------


def oai(s: Served, url: str | None = None, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or s.url) + "/v1", api_key=key, max_retries=0, timeout=WAIT_S)


def chat_body(prompt: str, max_tokens: int, mode: str | None = "off", **extra: object) -> dict:
    body: dict = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}
    if mode is not None:
        body["homespec"] = {"speculation": mode}
    return body


def post_chat(s: Served, body: dict | bytes, **kw: object) -> httpx.Response:
    with s.client() as c:
        if isinstance(body, bytes):
            return c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}, **kw)
        return c.post("/v1/chat/completions", json=body, **kw)


def stats(s: Served) -> StatsView:
    r = httpx.get(f"{s.url}/v1/homespec/stats", timeout=30)
    assert r.status_code == 200, r.text
    return StatsView.model_validate(r.json())


def wait_idle(s: Served) -> None:
    """Nothing running or waiting (a previous test's cancelled job has finished)."""
    wait_for(lambda: s.daemon.queue_view() == (0, 0), WAIT_S, "the daemon to go idle")


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, f"{r.status_code}: {r.text}"
    assert r.headers["content-type"].startswith("application/json")
    assert "Traceback" not in r.text and 'File "' not in r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_served_normally(s: Served) -> None:
    """The request after a bad one is answered as usual."""
    r = post_chat(s, chat_body(PARIS, 2))  # "Paris" is one token: one pass over a cached prompt
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


_REFERENCE: dict[tuple[str, int], str] = {}


def reference(s: Served, prompt: str, max_tokens: int) -> str:
    """Plain greedy decoding (speculation off) of a chat prompt, computed once per session."""
    key = (prompt, max_tokens)
    if key not in _REFERENCE:
        r = post_chat(s, chat_body(prompt, max_tokens, mode="off"))
        assert r.status_code == 200, r.text
        _REFERENCE[key] = r.json()["choices"][0]["message"]["content"]
    return _REFERENCE[key]


def metric(text: str, sample: str, **labels: str) -> float:
    """Sum of the samples named `sample` whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            if smp.name == sample and all(smp.labels.get(k) == v for k, v in labels.items()):
                total += smp.value
    return total


def metrics_text(s: Served) -> str:
    r = httpx.get(f"{s.url}/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def sse_events(lines) -> list:
    """Parse `data:` lines of a server-sent event stream; stops at [DONE] (included as "[DONE]")."""
    out: list = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out.append("[DONE]")
            break
        out.append(json.loads(data))
    return out


# -- happy paths with the official client ---------------------------------------------------------


def test_health_and_ready_report_ok_when_loaded(served: Served) -> None:
    h = httpx.get(f"{served.url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = httpx.get(f"{served.url}/ready", timeout=10)
    assert r.status_code == 200 and r.json() == {"ready": True, "state": "ready"}
    for path in ("/health", "/ready", "/v1/models", "/models"):  # HEAD: a monitor's probe, as for Ollama's /
        head = httpx.head(f"{served.url}{path}", timeout=10)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)


def test_models_endpoint_lists_the_one_served_model(served: Served) -> None:
    models = oai(served).models.list().data
    assert [m.id for m in models] == [served.model]
    assert models[0].owned_by == "homespec"
    assert oai(served).models.retrieve(served.model) == models[0]  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        oai(served).models.retrieve("gpt-4o")


def test_chat_without_stream_returns_text_usage_with_cached_tokens_and_homespec_extension(served: Served) -> None:
    client = oai(served)
    kw = dict(model=served.model, messages=[{"role": "user", "content": PARIS}], max_tokens=8,
              extra_body={"homespec": {"speculation": "off"}})
    first = client.chat.completions.create(**kw)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    assert first.model == served.model
    choice = first.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"  # "Paris" then end of turn, well inside 8 tokens
    u = first.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens
    ext = first.model_extra["homespec"]
    assert ext["mode"] == "off" and ext["steps"] >= 0 and ext["proposed"] == 0
    assert {"acceptance_rate", "acceptance_length", "ttft_s", "tokens_per_s", "draft_s", "verify_s", "cold"} <= set(ext)

    again = client.chat.completions.create(**kw)  # the same prompt: its prefix is in the KV cache
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens == u.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1  # all but the last token


def test_chat_stream_concatenates_to_the_non_streaming_text_and_ends_with_usage(served: Served) -> None:
    want = reference(served, DAYS, 12)
    stream = oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": DAYS}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"homespec": {"speculation": "off"}},
    )
    chunks = list(stream)  # the client stops at [DONE]; a missing [DONE] would hang or raise
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model == served.model for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in with_choices][-1] in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    tail = chunks[-1]
    assert tail.choices == [] and tail.usage is not None
    assert tail.usage.completion_tokens >= 1 and tail.usage.total_tokens == tail.usage.prompt_tokens + tail.usage.completion_tokens
    assert tail.model_extra["homespec"]["mode"] == "off"


def test_chat_stream_without_include_usage_sends_no_usage_chunk(served: Served) -> None:
    chunks = list(oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": PARIS}], max_tokens=4, stream=True,
        extra_body={"homespec": {"speculation": "off"}},
    ))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks)


def test_completions_stream_and_non_stream_give_the_same_text(served: Served) -> None:
    client = oai(served)
    kw = dict(model=served.model, prompt=COMPLETION_PROMPT, max_tokens=8, extra_body={"homespec": {"speculation": "off"}})
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion"
    text = whole.choices[0].text
    assert text.startswith(" a + b"), text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.model_extra["homespec"]["mode"] == "off"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["ngram", "draft", "auto"])
def test_speculation_override_changes_the_mode_not_the_greedy_text(served: Served, mode: str) -> None:
    want = reference(served, FOX, 12)
    r = oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": FOX}], max_tokens=12,
        extra_body={"homespec": {"speculation": mode, "k": 4}},
    )
    assert r.choices[0].message.content == want
    ext = r.model_extra["homespec"]
    assert ext["mode"] == mode
    if mode in ("ngram", "draft"):
        # The copy prompt gives ngram matches; the draft proposes on every step.
        assert ext["proposed"] > 0 and 0 <= ext["accepted"] <= ext["proposed"]
        assert any(key.startswith(f"{mode}:") for key in ext["proposers"]), ext["proposers"]


MONTHS = "List the months of the year, one per line."  # asked by the memory test only


def test_the_same_question_again_drafts_the_remembered_answer_and_says_the_same(served: Served) -> None:
    # Prompt lookup keeps greedy answers across requests (ngram_memory.py): the second time the
    # whole first answer is the draft, so nearly every drafted token is kept and the answer takes
    # fewer target passes. Forced ngram: what is drafted, not what auto judges worth it on this CPU.
    kw = dict(model=served.model, messages=[{"role": "user", "content": MONTHS}], max_tokens=40,
              extra_body={"homespec": {"speculation": "ngram", "k": 8}})
    first = oai(served).chat.completions.create(**kw)
    again = oai(served).chat.completions.create(**kw)
    assert again.choices[0].message.content == first.choices[0].message.content
    f, a = first.model_extra["homespec"], again.model_extra["homespec"]
    # Not drafted: the first token, the target's own token after each full draft of 8, and what
    # follows a near-tie the two answers part at (a step's worth).
    n = again.usage.completion_tokens
    assert a["accepted"] >= (n - 1) * 8 / 9 - 9, (f, a, n)
    assert a["steps"] < f["steps"], (f, a)
    held = stats(served).speculation.answer_memory  # what the memory holds shows in the stats
    assert held is not None and held.answers >= 1 and n < held.tokens <= held.capacity, held


# -- bad input: the right 4xx with an OpenAI error object, then a normal answer -------------------

_LONG_PROMPT = "hello " * (N_CTX + 100)  # ~1,100 tokens: more than the context holds

# (id, method, path, body: dict | bytes | None, status, code, param)
BAD_INPUT = [
    ("malformed-json", "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", ', 400, "invalid_json", None),
    ("not-utf8", "POST", "/v1/chat/completions", b"\xff\xfe{}", 400, None, None),
    ("json-array-body", "POST", "/v1/chat/completions", b"[]", 400, None, None),
    ("deeply-nested-json", "POST", "/v1/chat/completions", b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400, None, None),
    ("stop-not-strings", "POST", "/v1/chat/completions", chat_body(PARIS, 4, stop=[1, 2]), 400, None, None),
    ("homespec-unknown-field", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "homespec": {"turbo": True}}, 400, None, None),
    ("json-null-body", "POST", "/v1/chat/completions", b"null", 400, None, None),
    ("empty-body", "POST", "/v1/chat/completions", b"", 400, None, None),
    ("messages-is-a-string", "POST", "/v1/chat/completions", {"messages": "hi"}, 400, None, "messages"),
    ("temperature-is-a-word", "POST", "/v1/chat/completions", chat_body(PARIS, 4, temperature="hot"), 400, None, "temperature"),
    ("missing-messages", "POST", "/v1/chat/completions", {"max_tokens": 4}, 400, None, "messages"),
    ("empty-messages", "POST", "/v1/chat/completions", {"messages": []}, 400, None, "messages"),
    ("unknown-role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
    ("content-is-a-number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None, None),
    ("image-content-part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None, "messages.0.content"),
    ("unknown-model", "POST", "/v1/chat/completions", chat_body(PARIS, 4, model="gpt-9"), 404, "model_not_found", "model"),
    ("temperature-too-high", "POST", "/v1/chat/completions", chat_body(PARIS, 4, temperature=3), 400, None, "temperature"),
    ("temperature-negative", "POST", "/v1/chat/completions", chat_body(PARIS, 4, temperature=-0.5), 400, None, "temperature"),
    ("temperature-nan", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None, "temperature"),
    ("top-p-negative", "POST", "/v1/chat/completions", chat_body(PARIS, 4, top_p=-0.1), 400, None, "top_p"),
    ("top-p-above-one", "POST", "/v1/chat/completions", chat_body(PARIS, 4, top_p=1.5), 400, None, "top_p"),
    ("max-tokens-zero", "POST", "/v1/chat/completions", chat_body(PARIS, 0), 400, None, "max_tokens"),
    ("max-tokens-negative", "POST", "/v1/chat/completions", chat_body(PARIS, -5), 400, None, "max_tokens"),
    ("presence-penalty-out-of-range", "POST", "/v1/chat/completions", chat_body(PARIS, 4, presence_penalty=3), 400, None, "presence_penalty"),
    ("frequency-penalty-infinite", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -Infinity}', 400, None, "frequency_penalty"),
    ("top-k-negative", "POST", "/v1/chat/completions", chat_body(PARIS, 4, top_k=-1), 400, None, "top_k"),
    ("seed-not-an-integer", "POST", "/v1/chat/completions", chat_body(PARIS, 4, seed=1.5), 400, None, "seed"),
    ("seed-beyond-int64", "POST", "/v1/chat/completions", chat_body(PARIS, 4, seed=2**64), 400, None, "seed"),
    ("n-two", "POST", "/v1/chat/completions", chat_body(PARIS, 4, n=2), 400, None, "n"),
    ("top-logprobs-without-logprobs", "POST", "/v1/chat/completions", chat_body(PARIS, 4, top_logprobs=2), 400, None, "top_logprobs"),
    ("audio-output", "POST", "/v1/chat/completions", chat_body(PARIS, 4, audio={"voice": "alloy", "format": "wav"}), 400, None, "audio"),
    ("field-openai-does-not-define", "POST", "/v1/chat/completions", chat_body(PARIS, 4, mirostat=2), 400, None, "mirostat"),
    ("logit-bias-beyond-the-vocabulary", "POST", "/v1/chat/completions",
     chat_body(PARIS, 4, logit_bias={"999999": 5}), 400, "invalid_request", "logit_bias"),
    ("grammar-that-matches-no-text", "POST", "/v1/chat/completions",
     chat_body(PARIS, 4, grammar="root ::= root"), 400, "invalid_request", None),
    # checks across fields name the field they are about
    ("tool-choice-naming-no-tool", "POST", "/v1/chat/completions",
     chat_body(PARIS, 4, tools=[{"type": "function", "function": {"name": "lights"}}],
               tool_choice={"type": "function", "function": {"name": "heating"}}), 400, None, "tool_choice"),
    ("tool-choice-without-tools", "POST", "/v1/chat/completions", chat_body(PARIS, 4, tool_choice="required"), 400, None, "tool_choice"),
    ("grammar-beside-response-format", "POST", "/v1/chat/completions",
     chat_body(PARIS, 4, grammar='root ::= "a"', response_format={"type": "json_object"}), 400, None, "grammar"),
    ("completion-echo", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "echo": True}, 400, None, "echo"),
    ("completion-best-of-two", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "best_of": 2}, 400, None, "best_of"),
    ("tools", "POST", "/v1/chat/completions", chat_body(PARIS, 4, tools=[{"type": "function"}]), 400, None, None),
    ("sixty-five-stop-strings", "POST", "/v1/chat/completions", chat_body(PARIS, 4, stop=[f"s{i}" for i in range(65)]), 400, None, "stop"),
    ("unknown-speculation-mode", "POST", "/v1/chat/completions", chat_body(PARIS, 4, mode="warp"), 400, None, "homespec.speculation"),
    ("unavailable-speculation-mode", "POST", "/v1/chat/completions", chat_body(PARIS, 4, mode="mtp"), 400, None, "homespec.speculation"),
    ("k-out-of-range", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "homespec": {"k": 1000}}, 400, None, "homespec.k"),
    ("chat-prompt-longer-than-context", "POST", "/v1/chat/completions", chat_body(_LONG_PROMPT, 4), 400, "context_length_exceeded", "messages"),
    ("streamed-chat-prompt-longer-than-context", "POST", "/v1/chat/completions",
     chat_body(_LONG_PROMPT, 4, stream=True), 400, "context_length_exceeded", "messages"),
    ("completion-prompt-longer-than-context", "POST", "/v1/completions",
     {"prompt": _LONG_PROMPT, "max_tokens": 4}, 400, "context_length_exceeded", "prompt"),
    ("completion-missing-prompt", "POST", "/v1/completions", {"max_tokens": 4}, 400, None, "prompt"),
    ("completion-batched-prompts", "POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4}, 400, None, "prompt"),
    ("completion-empty-prompt", "POST", "/v1/completions", {"prompt": "", "max_tokens": 4}, 400, None, "prompt"),
    ("lone-surrogate-in-content", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}', 400, None, "messages"),
    ("negative-seed-in-int64", "POST", "/v1/chat/completions", chat_body(PARIS, 4, seed=-1), 200, None, None),
    ("oversized-body", "POST", "/v1/chat/completions", chat_body("x" * (MAX_BODY + 1), 4), 413, "body_too_large", None),
    ("unknown-route", "POST", "/v1/embeddings", {"input": "hi"}, 404, None, None),
    ("unknown-route-get", "GET", "/v2/nothing", None, 404, None, None),
    ("wrong-method", "GET", "/v1/chat/completions", None, 405, None, None),
    ("admin-mode-missing-field", "POST", "/v1/homespec/mode", {}, 400, None, "mode"),
]


@pytest.mark.parametrize(
    "method,path,body,status,code,param", [pytest.param(*row[1:], id=row[0]) for row in BAD_INPUT]
)
def test_bad_input_gets_an_openai_error_and_the_next_request_is_served(
    served: Served, method: str, path: str, body: object, status: int, code: str | None, param: str | None
) -> None:
    with served.client() as c:
        if isinstance(body, bytes):
            r = c.request(method, path, content=body, headers={"content-type": "application/json"})
        elif body is None:
            r = c.request(method, path)
        else:
            r = c.request(method, path, json=body)
    if status == 200:  # accepted input in the same family (e.g. OpenAI's signed int64 seed)
        assert r.status_code == 200, r.text
    else:
        assert_openai_error(r, status, code, param)
    if status == 405:
        assert "POST" in r.headers.get("allow", ""), r.headers
    assert_served_normally(served)


def test_oversized_body_without_content_length_is_refused_with_413(served: Served) -> None:
    def chunks():
        payload = json.dumps(chat_body("y" * (MAX_BODY * 2), 4)).encode()
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]

    with served.client() as c:  # a generator body goes out chunked: no Content-Length to check
        r = c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "body_too_large")
    assert_served_normally(served)


# -- auth --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic " + API_KEY, API_KEY])
def test_auth_refuses_missing_or_wrong_key_with_401(served: Served, header: str | None) -> None:
    headers = {"authorization": header} if header else {}
    with httpx.Client(base_url=served.auth_url, timeout=60) as c:
        for method, path, body in [
            ("POST", "/v1/chat/completions", chat_body(PARIS, 2)),
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("GET", "/v1/models", None),
            ("GET", "/v1/homespec/stats", None),
            ("POST", "/v1/homespec/mode", {"mode": "off"}),
            ("POST", "/v1/homespec/reset", None),
            ("GET", "/metrics", None),
        ]:
            r = c.request(method, path, json=body, headers=headers)
            assert_openai_error(r, 401, "invalid_api_key")
    assert served.daemon.mode == "auto"  # the refused admin call changed nothing


def test_auth_accepts_the_right_key_and_leaves_health_open(served: Served) -> None:
    r = oai(served, served.auth_url, key=API_KEY).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": PARIS}], max_tokens=4,
        extra_body={"homespec": {"speculation": "off"}},
    )
    assert "Paris" in r.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        oai(served, served.auth_url, key="nope").models.list()
    for path in ("/health", "/ready"):
        assert httpx.get(served.auth_url + path, timeout=10).status_code == 200


# -- cancellation, concurrency, backpressure ----------------------------------------------------


def _last_request_after(served: Served, n_before: int):
    view = wait_for(lambda: (v := stats(served)).speed.requests_served > n_before and v, WAIT_S, "the request to be recorded", 0.2)
    return view.requests[0]


def test_client_disconnect_mid_stream_stops_generation(served: Served) -> None:
    wait_idle(served)
    n_before = stats(served).speed.requests_served
    max_tokens = 400
    with served.client() as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body(LONG, max_tokens, stream=True)) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line and '"content": ""' not in line:
                    got += 1
                    if got == 3:
                        break  # hang up mid-stream
    rec = _last_request_after(served, n_before)
    assert rec.status == "cancelled", rec
    assert 3 <= rec.completion_tokens < max_tokens // 4, rec
    wait_idle(served)
    assert_served_normally(served)


# A prompt whose prefill takes seconds on these 2 cores (~700 tokens of a 1k context).
def _long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"item{i}" for i in range(240)) + ". How many items are there?"


STREAMS = {
    "openai": ("/v1/chat/completions", lambda p, m: chat_body(p, 16, stream=True)),
    "ollama": ("/api/chat", lambda p, m: {"model": m, "messages": [{"role": "user", "content": p}], "options": {"num_predict": 16}}),
    # The long part goes in the extra context: /infill keeps only 3/4 of a batch of the prefix.
    "infill": ("/infill", lambda p, m: {"input_extra": [{"filename": "items.txt", "text": p}], "input_prefix": "def f(",
                                        "input_suffix": ")\n", "n_predict": 16, "stream": True}),
}


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_streaming_client_that_hangs_up_during_prefill_is_cancelled_before_its_first_token(served: Served, api: str) -> None:
    """A hang-up arrives as a bare EOF, which a stream's open response took for a half-close:
    the prompt was read to its end and a token made for nobody while the next request waited.
    A stream's response now starts with its first token, so the hang-up is seen during prefill."""
    path, body = STREAMS[api]
    wait_idle(served)
    n_before = stats(served).speed.requests_served
    passes_before = metric(metrics_text(served), "homespec_batch_rows_count")
    raw = json.dumps(body(_long_prompt(f"{api} {n_before}"), served.model)).encode()  # new each time: no cached prefix
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        # Hang up once a first chunk of the prompt has been read: a stream's headers used to be out by then.
        wait_for(lambda: metric(metrics_text(served), "homespec_batch_rows_count") > passes_before, WAIT_S, "a prompt chunk")
        # Read what has come, as a client does: a socket closed with unread bytes sends a reset,
        # which any server sees; a client that has read everything sends only EOF.
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while sock.recv(65536):
                pass
    rec = _last_request_after(served, n_before)
    assert rec.status == "cancelled", rec
    assert rec.completion_tokens == 0 and rec.ttft_s is None, rec
    wait_idle(served)
    assert_served_normally(served)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_client_disconnect_while_waiting_for_a_non_streaming_answer_stops_generation(served: Served) -> None:
    errors = _Errors()
    logging.getLogger("uvicorn.error").addHandler(errors)  # uvicorn's loggers do not propagate
    wait_idle(served)
    n_before = stats(served).speed.requests_served
    tokens_before = served.daemon.live.tokens_generated
    body = json.dumps(chat_body(LONG, 400)).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        # Hang up once the job is generating (a few tokens out), not while it waits or prefills.
        wait_for(lambda: served.daemon.live.tokens_generated >= tokens_before + 3, WAIT_S, "generation to start")
    rec = _last_request_after(served, n_before)
    assert rec.status == "cancelled", rec
    assert rec.completion_tokens < 100, rec
    wait_idle(served)
    assert_served_normally(served)
    logging.getLogger("uvicorn.error").removeHandler(errors)
    # A hang-up is routine: one INFO line, not "Exception in ASGI application" and a traceback.
    assert not errors.records, [r.getMessage() for r in errors.records]


def test_concurrent_clients_each_get_their_complete_sequential_answer(served: Served) -> None:
    prompts = [(PARIS, 4), (DAYS, 12), (ADD, 12)]
    want = [reference(served, p, n) for p, n in prompts]  # sequential, speculation off
    wait_idle(served)

    def ask(item: tuple[str, int]):
        p, n = item
        r = oai(served).chat.completions.create(model=served.model, messages=[{"role": "user", "content": p}], max_tokens=n)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    # 1 running + QUEUE_DEPTH waiting fit; the default mode (auto) is used on purpose.
    with ThreadPoolExecutor(max_workers=1 + QUEUE_DEPTH) as pool:
        got = list(pool.map(ask, prompts[: 1 + QUEUE_DEPTH]))
    for (text, finish, n), expected, (_, limit) in zip(got, want, prompts):
        assert text == expected
        assert finish in ("stop", "length") and 1 <= n <= limit


def test_full_queue_answers_429_with_retry_after_and_queued_requests_still_complete(served: Served) -> None:
    wait_idle(served)
    results: list[httpx.Response] = []
    parallel = served.daemon.cfg.server.parallel

    def queued() -> None:
        results.append(post_chat(served, chat_body(PARIS, 4)))

    with contextlib.ExitStack() as hold, served.client() as c:
        for _ in range(parallel):  # every slot busy with a long stream
            long_running = hold.enter_context(c.stream("POST", "/v1/chat/completions", json=chat_body(LONG, 400, stream=True)))
            assert long_running.status_code == 200  # headers come once the job has started
        waiters = [threading.Thread(target=queued) for _ in range(QUEUE_DEPTH)]
        for t in waiters:
            t.start()
        wait_for(lambda: served.daemon.queue_view() == (parallel, QUEUE_DEPTH), WAIT_S, "the queue to fill")

        for _ in range(3):
            r = post_chat(served, chat_body(PARIS, 4))
            err = assert_openai_error(r, 429, "queue_full")
            assert err["type"] == "rate_limit_error"
            assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError) as e:
            oai(served).chat.completions.create(model=served.model, messages=[{"role": "user", "content": PARIS}], max_tokens=2)
        assert e.value.response.headers["retry-after"].isdigit()
        # leaving the block hangs up on the long streams: the waiting requests run next
    for t in waiters:
        t.join(timeout=WAIT_S)
    assert [r.status_code for r in results] == [200] * QUEUE_DEPTH, [r.text for r in results]
    assert all("Paris" in r.json()["choices"][0]["message"]["content"] for r in results)
    wait_idle(served)
    assert_served_normally(served)


def test_request_past_its_timeout_gets_504_server_error_and_the_next_request_is_served(served: Served) -> None:
    wait_idle(served)
    server_cfg = served.daemon.cfg.server
    saved = server_cfg.request_timeout_s
    server_cfg.request_timeout_s = 1.0  # read per request; LONG needs far more than 1 s for 400 tokens
    try:
        r = post_chat(served, chat_body(LONG, 400))
        err = assert_openai_error(r, 504, "timeout")
        assert err["type"] == "server_error"
        with served.client() as c:
            with c.stream("POST", "/v1/chat/completions", json=chat_body(LONG, 400, stream=True)) as resp:
                assert resp.status_code == 200  # the stream had started; the error arrives in it
                events = sse_events(resp.iter_lines())
    finally:
        server_cfg.request_timeout_s = saved
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "timeout", events[-3:]
    assert stats(served).requests[0].status == "timeout"
    wait_idle(served)
    assert_served_normally(served)


# -- stats, metrics, admin -----------------------------------------------------------------------


def test_stats_and_metrics_move_with_speculative_requests(served: Served) -> None:
    wait_idle(served)
    before_text, before = metrics_text(served), stats(served)
    done = []
    for mode in ("ngram", "draft"):
        r = post_chat(served, chat_body(FOX, 12, mode=mode))
        assert r.status_code == 200, r.text
        done.append(r.json())
    after_text, after = metrics_text(served), stats(served)

    completion = sum(d["usage"]["completion_tokens"] for d in done)
    grew = lambda name, **lab: metric(after_text, name, **lab) - metric(before_text, name, **lab)  # noqa: E731
    assert grew("homespec_requests_total", status="ok") == 2
    assert grew("homespec_generation_tokens_total") == completion
    assert grew("homespec_prompt_tokens_total") == sum(d["usage"]["prompt_tokens"] for d in done)
    accepted_total = 0
    for proposer in ("ngram", "draft"):
        assert grew("homespec_spec_decode_num_draft_tokens_total", proposer=proposer) > 0
        assert grew("homespec_spec_decode_num_drafts_total", proposer=proposer) > 0
        accepted = grew("homespec_spec_decode_num_accepted_tokens_total", proposer=proposer)
        assert 0 <= accepted <= grew("homespec_spec_decode_num_draft_tokens_total", proposer=proposer)
        accepted_total += accepted
    assert metric(after_text, "homespec_warm") == 1
    assert metric(after_text, "homespec_model_loaded", role="draft") == 1

    assert after.state == "ready" and after.speed.requests_served == before.speed.requests_served + 2
    assert after.speed.tokens_generated > before.speed.tokens_generated
    assert [q.mode for q in after.requests[:2]] == ["draft", "ngram"]  # most recent first
    assert all(q.status == "ok" and q.completion_tokens > 0 for q in after.requests[:2])
    spec = after.speculation
    assert spec.acceptance_rate is not None and 0 <= spec.acceptance_rate <= 1
    assert spec.acceptance_length is not None
    if accepted_total:  # these steps are in the window: some emitted more than their bonus token
        assert spec.acceptance_length > 1
    assert spec.per_position and any(key.startswith("draft:") for key in spec.chosen)
    assert set(spec.modes) >= {"auto", "off", "ngram", "draft"}
    assert after.queue.max_waiting == QUEUE_DEPTH
    assert after.models.target is not None and after.models.draft is not None and after.models.draft.loaded
    assert after.prefix_cache.lookups >= 2


def test_admin_mode_sets_the_default_speculation_and_refuses_unknown_modes(served: Served) -> None:
    wait_idle(served)
    try:
        with served.client() as c:
            r = c.post("/v1/homespec/mode", json={"mode": "ngram"})
            assert r.status_code == 200 and r.json() == {"mode": "ngram"}
            assert stats(served).speculation.mode == "ngram"
            # A request without its own override now runs in the daemon's mode.
            answer = post_chat(served, chat_body(PARIS, 4, mode=None)).json()
            assert answer["homespec"]["mode"] == "ngram"
            for bad in ("warp", "mtp", "", "AUTO"):
                assert_openai_error(c.post("/v1/homespec/mode", json={"mode": bad}), 400, None, "mode")
            assert_openai_error(c.post("/v1/homespec/mode", json={"mode": 3}), 400, None, "mode")
            assert stats(served).speculation.mode == "ngram"
    finally:
        httpx.post(f"{served.url}/v1/homespec/mode", json={"mode": "auto"}, timeout=30)
    assert stats(served).speculation.mode == "auto"
    assert_served_normally(served)
