"""The OpenAI request surface over HTTP, with the official client, on scripted logits: a real
Host, Daemon, FastAPI app and uvicorn on loopback, but a FakeRuntime for the target, so the
shapes, refusals and stream lines are checked in seconds without weights."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from homespec.config import Config, RuntimeConfig
from homespec.llama.template import ChatTemplate
from homespec.serving.app import create_app
from homespec.serving.daemon import Daemon
from homespec.serving.host import Host
from tests.integration.server_fixtures import ThreadServer, wait_for

from .fakes import FakeRuntime, FakeSlot

VOCAB = 64
WAIT_S = 60


class SlowRuntime(FakeRuntime):
    """A pass costs `delay_s`, so a stream lasts long enough for keep-alive pings to be due;
    `on_pass`, when set, runs at each pass (on the worker thread, while the requests are live)."""

    delay_s = 0.0
    on_pass: Callable[[], None] | None = None

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._slots = [self] + [_SlowSlot(self, i) for i in range(1, self.n_seq)]  # every slot's pass is slow

    def eval(self, tokens: Sequence[int], output: str = "all") -> Any:
        self._pass()
        return super().eval(tokens, output)

    def eval_many(self, parts: Any) -> Any:
        self._pass()
        return super().eval_many(parts)

    def _pass(self) -> None:
        if self.on_pass is not None:
            self.on_pass()
        time.sleep(self.delay_s)


class _SlowSlot(FakeSlot):
    """A sequence of a SlowRuntime other than 0: its lone passes cost what the runtime's do."""

    def eval(self, tokens: Sequence[int], output: str = "all") -> Any:
        self.rt._pass()  # type: ignore[attr-defined]
        return FakeRuntime.eval(self, tokens, output)


class ScriptedModels:
    """What Host needs of a ModelSet: a scripted target, no draft, no MTP head."""

    def __init__(self) -> None:
        self.target = SlowRuntime(vocab=VOCAB, n_ctx=512, n_seq=4)  # four requests at once
        self.draft = None
        self.mtp_head = None
        self.template = ChatTemplate(None)  # ChatML: no tools section

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        return self.encode_text("".join(m["content"] for m in messages))

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text] or [0]

    def close(self) -> None:
        pass


class ScriptedHost(Host):
    def warmup(self) -> None:  # nothing to calibrate: auto decodes plainly, fixed modes work
        self.warmup_s = 0.0


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Daemon]]:
    cfg = Config(runtime=RuntimeConfig(n_ctx=512, prefix_reuse=False))
    cfg.sampling.max_tokens = 16
    cfg.server.queue_depth = 2
    daemon = Daemon(cfg, opener=lambda c, **kw: ScriptedHost(c, ScriptedModels()))  # type: ignore[arg-type]
    daemon._plan = lambda: type("Plan", (), {"load_draft": False, "n_ctx": 512})()  # type: ignore[method-assign]  # no GGUF
    srv = ThreadServer(create_app(daemon, address="127.0.0.1")).start()
    daemon.start()
    try:
        wait_for(lambda: daemon.state == "ready", WAIT_S, "the scripted daemon")
        yield srv.url, daemon
    finally:
        srv.stop()
        daemon.shutdown(timeout_s=5)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)


def chat(url: str, **kw: Any) -> Any:
    return client(url).chat.completions.create(model="homespec", messages=[{"role": "user", "content": "hello"}], **kw)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=WAIT_S)


def test_chat_logprobs_parse_with_the_openai_client_streaming_and_not(server: tuple[str, Daemon]) -> None:
    url, _ = server
    whole = chat(url, max_tokens=12, logprobs=True, top_logprobs=3, extra_body={"homespec": {"speculation": "ngram", "k": 4}})
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens == 12
    for t in content:
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the argmax
        assert t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    chunks = list(chat(url, max_tokens=12, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    assert chat(url, max_tokens=4).choices[0].logprobs is None


def test_completion_logprobs_parse_with_the_openai_client_streaming_and_not(server: tuple[str, Daemon]) -> None:
    url, _ = server
    c = client(url)
    whole = c.completions.create(model="homespec", prompt="def add(a, b):", max_tokens=10, logprobs=2)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) == x for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(c.completions.create(model="homespec", prompt="def add(a, b):", max_tokens=10, logprobs=2, stream=True))
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.token_logprobs for p in parts), []) == lp.token_logprobs
    assert sum((p.text_offset for p in parts), []) == lp.text_offset  # offsets run on across chunks


def test_logit_bias_bans_a_token_over_http(server: tuple[str, Daemon]) -> None:
    url, _ = server
    free = chat(url, max_tokens=8, logprobs=True).choices[0].logprobs.content
    first = free[0].token  # FakeRuntime spells ids < 26 as one letter, others as "[id]"
    tid = ord(first) - ord("a") if len(first) == 1 else int(first.strip("[]"))
    biased = chat(url, max_tokens=8, logprobs=True, logit_bias={str(tid): -100}).choices[0].logprobs.content
    assert biased[0].token != first and all(t.token != first for t in biased)


def test_a_logit_bias_id_beyond_the_vocabulary_is_a_400_naming_it(server: tuple[str, Daemon]) -> None:
    url, _ = server
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {str(VOCAB): 5}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"] and str(VOCAB) in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "n", 2),
        ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "reasoning_effort", "low"),
        ("/v1/chat/completions", "web_search_options", {}),
        ("/v1/chat/completions", "top_logprobs", 3),  # without logprobs: true
        ("/v1/chat/completions", "mirostat", 2),  # llama.cpp's: refused where it would change the answer
        ("/v1/chat/completions", "tfs_z", 0.9),  # neither OpenAI's nor llama.cpp's: unknown
        ("/v1/completions", "best_of", 3),
        ("/v1/completions", "n", 2),
        ("/v1/completions", "logprobs", 6),
        ("/v1/completions", "store", True),  # chat's, not completions'
    ],
)
def test_a_refused_field_is_a_400_naming_it(server: tuple[str, Daemon], path: str, field: str, value: Any) -> None:
    url, _ = server
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = post(url, path, {**base, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, "stop"),
])
def test_a_wrong_type_in_a_union_field_names_the_field_not_the_member_tried(server: tuple[str, Daemon], path: str, body: dict,
                                                                            param: str) -> None:
    url, _ = server
    r = post(url, path, {**body, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "max_tokens", "8"),  # lax pydantic read these as 8, 1, true and 0.5
    ("/v1/chat/completions", "max_tokens", True),
    ("/v1/chat/completions", "max_tokens", 2.5),
    ("/v1/chat/completions", "stream", "yes"),
    ("/v1/chat/completions", "stream", 1),
    ("/v1/chat/completions", "temperature", "0.5"),
    ("/v1/chat/completions", "temperature", False),
    ("/v1/chat/completions", "seed", "7"),
    ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "logit_bias", {"5": "1"}),
    ("/v1/chat/completions", "ignore_eos", 0),  # llama-server's option
    ("/v1/completions", "echo", "no"),
    ("/v1/completions", "max_tokens", "2"),
])
def test_a_value_of_another_json_type_is_a_400_naming_its_field(server: tuple[str, Daemon], path: str, field: str,
                                                               value: Any) -> None:
    url, _ = server
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = post(url, path, {**base, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and field in err["message"], err


def test_numbers_as_json_clients_write_them_are_accepted(server: tuple[str, Daemon]) -> None:
    # Python's json.dumps writes 2.0 for a float that holds 2; an integer is a valid temperature.
    url, _ = server
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.0,
                                           "temperature": 0, "top_p": 1, "logit_bias": {"5": -1}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_a_content_part_that_is_not_text_is_a_400_naming_its_type(server: tuple[str, Daemon], part: dict) -> None:
    url, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="homespec", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}])
    err = e.value.body
    assert err["param"] == "messages.0.content" and repr(part["type"]) in err["message"] and "text" in err["message"], err


def test_a_prompt_longer_than_the_context_is_a_400_that_says_where_the_context_is_set(server: tuple[str, Daemon]) -> None:
    url, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="homespec", max_tokens=2, messages=[{"role": "user", "content": "x" * 600}])
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and "the context holds 512" in err["message"], err
    assert "runtime.n_ctx" in err["message"], err  # a client's num_ctx / max context does not set it


@pytest.mark.parametrize("method, path", [("POST", "/v1/embeddings"), ("GET", "/v2/models")])
def test_an_unknown_endpoint_is_a_404_that_names_it(server: tuple[str, Daemon], method: str, path: str) -> None:
    url, _ = server
    r = httpx.request(method, url + path, json={"input": "hi"} if method == "POST" else None, timeout=WAIT_S)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "not_found" and f"{method} {path}" in err["message"], err


def test_ignored_fields_are_accepted_and_change_nothing(server: tuple[str, Daemon]) -> None:
    url, _ = server
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    ignored = {"user": "u", "store": True, "metadata": {"a": "b"}, "service_tier": "flex", "safety_identifier": "s",
               "prompt_cache_key": "k", "prediction": {"type": "content", "content": "x"}, "n": 1, "modalities": ["text"],
               "stream_options": None, "logprobs": False}
    plain, extra = post(url, "/v1/chat/completions", base), post(url, "/v1/chat/completions", {**base, **ignored})
    assert extra.status_code == plain.status_code == 200, extra.text
    assert extra.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def stream_lines(url: str) -> list[str]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.strip()]


def test_streams_carry_only_data_lines_unless_pings_are_configured(server: tuple[str, Daemon]) -> None:
    """Clients that read every non-empty line as `data:` choke on `: ping` comments."""
    url, daemon = server
    assert Config().server.sse_ping_s == 0  # off unless configured
    target = daemon.session.models.target  # type: ignore[union-attr]
    target.delay_s = 0.05  # ~0.6 s of stream: several 0.05 s ping intervals
    try:
        lines = stream_lines(url)
        assert lines and all(line.startswith("data: ") for line in lines), lines
        json.loads(lines[0].removeprefix("data: "))
        daemon.cfg.server.sse_ping_s = 0.05  # read per request
        assert any(line.startswith(":") for line in stream_lines(url))  # the control: pings do show
    finally:
        daemon.cfg.server.sse_ping_s = 0
        target.delay_s = 0.0


def test_concurrent_streams_each_get_exactly_their_answer_alone_while_sharing_passes(server: tuple[str, Daemon]) -> None:
    url, daemon = server
    prompts = ["hello there", "def f(x):", "a b c d e f", "the quick brown fox"]
    alone = [chat_with(url, p) for p in prompts]
    target = daemon.session.models.target  # type: ignore[union-attr]
    target.delay_s = 0.05  # passes last long enough for the four to overlap on a busy box
    seen_running: list[int] = []
    # Read at each pass, not by a timer: a timer on a loaded box can miss a burst this short.
    target.on_pass = lambda: seen_running.append(len(daemon.running_view()))  # what /v1/homespec/stats lists
    try:
        with ThreadPoolExecutor(4) as pool:
            clients = [client(url) for _ in prompts]  # made first: a client's setup must not stagger the starts
            together = list(pool.map(lambda cp: chat_with(url, cp[1], stream=True, c=cp[0]), zip(clients, prompts)))
    finally:
        target.on_pass = None
        target.delay_s = 0.0
    assert together == alone
    assert max(seen_running) >= 2  # several requests were running at once
    assert any(len(p) >= 2 for p in target.passes)  # and they shared target passes


def chat_with(url: str, prompt: str, stream: bool = False, c: openai.OpenAI | None = None) -> str:
    c = c or client(url)
    args: dict[str, Any] = {"model": "homespec", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                            "extra_body": {"homespec": {"speculation": "ngram", "k": 3}}}
    if not stream:
        return c.chat.completions.create(**args).choices[0].message.content or ""
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **args) if ch.choices)


@pytest.mark.parametrize("value", ["high", "11", "-11", "1.5", ""])
def test_a_bad_priority_header_is_a_400_naming_it(server: tuple[str, Daemon], value: str) -> None:
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Homespec-Priority": value}, timeout=WAIT_S,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "X-Homespec-Priority" in r.json()["error"]["message"]
    ok = client(url).chat.completions.create(model="homespec", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                             extra_headers={"X-Homespec-Priority": "5"})
    assert ok.choices[0].finish_reason == "length"
