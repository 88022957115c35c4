"""Ollama's API on the real daemon, driven by the official `ollama` Python client (and by raw
HTTP where the wire format itself is the property: NDJSON lines, error bodies).

The same daemon serves /v1 and /api, so greedy answers are compared between the two routes.
The keep_alive test unloads the shared daemon; it runs last here and leaves the models loaded.
"""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import ollama
import pytest

from tests.integration.server_fixtures import API_KEY, Served, wait_for
from tests.integration.test_server import oai
from tests.integration.test_tools_and_json import SCHEMAS, TOOLS, WEATHER_Q

GREEDY = {"temperature": 0}


def client(s: Served, url: str | None = None, **kw: object) -> ollama.Client:
    return ollama.Client(host=url or s.url, timeout=300, **kw)


def raw_post(s: Served, path: str, body: object) -> httpx.Response:
    with s.client() as c:
        return c.post(path, json=body)


def assert_ollama_error(r: httpx.Response, status: int, words: str) -> str:
    """Ollama's error body: {"error": "message"} and nothing else, with the given status."""
    assert r.status_code == status, f"{r.status_code}: {r.text}"
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert words.lower() in body["error"].lower(), body
    assert "Traceback" not in r.text
    return body["error"]


def test_root_and_version_answer_as_ollama_does(served: Served) -> None:
    with served.client() as c:
        assert c.get("/").text == "Ollama is running"
        head = c.head("/")
        assert head.status_code == 200 and head.text == ""
        assert c.get("/api/version").json()["version"].count(".") == 2


def test_list_show_and_ps_describe_the_served_model(served: Served) -> None:
    cl = client(served)
    (m,) = cl.list().models
    assert m.model == f"{served.model}:latest"
    assert m.size > 500 * 2**20 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "qwen2"
    assert m.details.quantization_level == "Q4_K_M" and m.details.parameter_size == "1.5B"

    shown = cl.show(m.model)
    assert {"completion", "tools", "insert"} <= set(shown.capabilities)
    assert shown.modelinfo["general.architecture"] == "qwen2"
    assert shown.modelinfo["qwen2.context_length"] == 32768
    assert shown.modelinfo["general.parameter_count"] > 10**9
    assert "<tool_call>" in shown.template
    assert cl.show(served.model).details.family == "qwen2"  # without ":latest" as well

    (running,) = cl.ps().models
    assert running.model == m.model and running.size > m.size  # weights plus KV cache and buffers
    assert running.context_length == 1024 and running.expires_at is not None


def test_pull_of_the_served_model_reports_success_without_fetching(served: Served) -> None:
    cl = client(served)
    assert cl.pull(served.model).status == "success"
    statuses = [p.status for p in cl.pull(f"{served.model}:latest", stream=True)]
    assert statuses[-1] == "success"


def test_unknown_model_gets_ollamas_404_in_every_endpoint(served: Served) -> None:
    cl = client(served)
    for call in (lambda: cl.chat("llama3:8b", messages=[{"role": "user", "content": "hi"}]),
                 lambda: cl.generate("llama3:8b", prompt="hi"), lambda: cl.show("llama3:8b")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "llama3:8b" in e.value.error and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        cl.pull("no-such-model")
    assert e.value.status_code == 404


def test_chat_greedy_text_is_identical_to_the_openai_route(served: Served) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three prime numbers."}]
    r = client(served).chat(served.model, messages=messages, options={**GREEDY, "num_predict": 32})
    o = oai(served).chat.completions.create(model=served.model, messages=messages, temperature=0, max_tokens=32)
    assert r.message.content == o.choices[0].message.content
    assert r.message.role == "assistant" and r.done and r.done_reason in ("stop", "length")
    assert r.eval_count == o.usage.completion_tokens
    assert 1 <= r.prompt_eval_count <= o.usage.prompt_tokens  # only what was not cached yet
    # The same prompt again: all but its last token come from the KV cache the first request left.
    assert o.usage.prompt_tokens_details.cached_tokens == o.usage.prompt_tokens - 1


def test_chat_stream_is_ndjson_with_a_role_on_every_line_and_metrics_at_the_end(served: Served) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Count from one to five in words."}],
            "options": {**GREEDY, "num_predict": 24}}
    with served.client() as c, c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        raw = r.read().decode()
    assert raw.endswith("\n") and "\n\n" not in raw
    lines = [json.loads(x) for x in raw.splitlines()]
    assert all(x["message"]["role"] == "assistant" for x in lines)
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    final = lines[-1]
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"):
        assert isinstance(final[key], int) and final[key] >= 0, key
    assert final["eval_duration"] > 0 and final["total_duration"] >= final["eval_duration"]
    assert final["eval_count"] <= 24 and final["homespec"]["steps"] > 0
    streamed = "".join(x["message"]["content"] for x in lines)
    whole = client(served).chat(served.model, messages=body["messages"], options=body["options"])
    assert streamed == whole.message.content and final["eval_count"] == whole.eval_count
    # The client's own stream reassembles the same text.
    parts = client(served).chat(served.model, messages=body["messages"], options=body["options"], stream=True)
    assert "".join(p.message.content for p in parts) == streamed


def _weather_call(message: ollama.Message) -> dict:
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    args = dict(call.function.arguments)  # an object, Ollama's shape, not OpenAI's string
    jsonschema.validate(args, SCHEMAS["get_weather"])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_with_the_ollama_client(served: Served, stream: bool) -> None:
    cl = client(served)
    messages: list = [{"role": "user", "content": WEATHER_Q}]
    if stream:
        parts = list(cl.chat(served.model, messages=messages, tools=TOOLS, options={**GREEDY, "num_predict": 80}, stream=True))
        assert parts[-1].done
        message = next(p.message for p in parts if p.message.tool_calls)
    else:
        message = cl.chat(served.model, messages=messages, tools=TOOLS, options={**GREEDY, "num_predict": 80}).message
    assert "paris" in _weather_call(message)["city"].lower()
    # The call goes back as Ollama sends it (arguments as an object, no ids, no content) and the
    # result as a tool message named by tool_name.
    messages += [{"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature_c": 31, "sky": "clear"})}]
    answer = cl.chat(served.model, messages=messages, options={**GREEDY, "num_predict": 60})
    assert not answer.message.tool_calls and "31" in answer.message.content


def test_format_json_and_a_schema_constrain_the_answer(served: Served) -> None:
    cl = client(served)
    r = cl.chat(served.model, messages=[{"role": "user", "content": "Describe a cat as JSON."}], format="json",
                options={**GREEDY, "num_predict": 60})
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    for prompt in ("Invent a person.", "Who wrote Hamlet, and how old did he get?"):
        g = cl.generate(served.model, prompt=prompt, format=schema, options={**GREEDY, "num_predict": 60})
        jsonschema.validate(json.loads(g.response), schema)


def test_generate_with_suffix_fills_the_middle_as_the_openai_route_does(served: Served) -> None:
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    g = client(served).generate(served.model, prompt=prefix, suffix=suffix, options={**GREEDY, "num_predict": 16})
    o = oai(served).completions.create(model=served.model, prompt=prefix, suffix=suffix, temperature=0, max_tokens=16)
    assert g.response == o.choices[0].text and "a + b" in g.response


def test_generate_raw_and_with_system_prompt(served: Served) -> None:
    cl = client(served)
    raw = cl.generate(served.model, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 4})
    assert "Paris" in raw.response
    templated = cl.generate(served.model, prompt="Say only the word: yes", system="You answer in lowercase.",
                            options={**GREEDY, "num_predict": 8})
    o = oai(served).chat.completions.create(
        model=served.model, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "You answer in lowercase."}, {"role": "user", "content": "Say only the word: yes"}])
    assert templated.response == o.choices[0].message.content


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "think": True}, "thinking"),
        ("/api/chat", {"model": "M", "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}, "keep_alive"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "options": {"num_ctx": "big"}}, "num_ctx"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "options": {"typical_p": 0.5}}, "typical_p"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "format": "xml"}, "format"),
        ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "options": {"homespec_speculation": "warp"}}, "homespec"),
        ("/api/chat", {"model": "M", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}, "arguments"),
        ("/api/generate", {"model": "M", "prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
        ("/api/generate", {"model": "M", "prompt": "hi", "context": [1, 2, 3]}, "context"),
        ("/api/generate", {"model": "M", "prompt": "hi", "format": {"type": "no-such-type"}}, "format"),
        ("/api/show", {}, "model"),
    ],
)
def test_bad_inputs_get_ollama_errors_and_the_daemon_keeps_serving(served: Served, path: str, body: dict, words: str) -> None:
    if body.get("model") == "M":
        body = {**body, "model": served.model}
    assert_ollama_error(raw_post(served, path, body), 400, words)
    ok = client(served).generate(served.model, prompt="Say hi.", options={**GREEDY, "num_predict": 2})
    assert ok.done


def test_invalid_json_and_wrong_method_get_ollama_errors(served: Served) -> None:
    with served.client() as c:
        assert_ollama_error(c.post("/api/chat", content=b"{nope", headers={"content-type": "application/json"}), 400, "JSON")
        assert_ollama_error(c.get("/api/chat"), 405, "not allowed")
        assert_ollama_error(c.post("/api/embed", json={"model": served.model, "input": "hi"}), 501, "not supported")
        assert_ollama_error(c.get("/api/nope"), 404, "not found")
        assert c.head("/api/tags").status_code == 200 and c.head("/api/version").status_code == 200
        # A name that UTF-8 cannot encode, quoted back in the error: a 404, not a 500.
        lone = json.dumps({"model": "x\ud800"}).encode()  # JSON may escape it; UTF-8 cannot hold it
        assert_ollama_error(c.post("/api/show", content=lone, headers={"content-type": "application/json"}), 404, "not found")


def test_a_go_clients_empty_and_null_fields_mean_their_defaults(served: Served) -> None:
    """Ollama's Go client sends suffix, system and template as "" and unset options as null:
    an empty suffix is no fill-in-the-middle, and the answer is the plain one."""
    prompt = "Say only the word OK."
    go = raw_post(served, "/api/generate", {"model": served.model, "prompt": prompt, "suffix": "", "system": "", "template": "",
                                            "images": None, "context": None, "raw": None, "stream": False, "logprobs": None,
                                            "keep_alive": None, "options": {"temperature": 0, "num_predict": 8, "stop": None}})
    assert go.status_code == 200, go.text
    assert go.json()["response"] == client(served).generate(served.model, prompt=prompt, options={**GREEDY, "num_predict": 8}).response


def test_tools_with_keywords_that_cannot_be_enforced_still_work(served: Served) -> None:
    """MCP servers' and Home Assistant's tools carry uniqueItems, not, unknown formats, and Go
    clients send a tool without arguments as "properties": null. Ollama ignores such keywords."""
    odd = [{"type": "function", "function": {"name": "set_scene", "description": "Set a scene.", "parameters": {
               "type": "object", "properties": {"scene": {"type": "string", "format": "entity_id"},
                                                "colors": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
               "not": {"required": ["both"]}}}},
           {"type": "function", "function": {"name": "all_off", "description": "Switch everything off.",
                                             "parameters": {"type": "object", "properties": None, "required": None}}}]
    r = raw_post(served, "/api/chat", {"model": served.model, "messages": [{"role": "user", "content": WEATHER_Q}], "stream": False,
                                       "tools": TOOLS + odd, "options": {**GREEDY, "num_predict": 80}})
    assert r.status_code == 200, r.text
    (call,) = r.json()["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "paris" in call["function"]["arguments"]["city"].lower()


def test_tools_with_a_format_answer_with_a_call_or_the_json_asked_for(served: Served) -> None:
    """Home Assistant sends both when an AI task has an LLM API; Ollama allows it. The answer is a
    call or the format's JSON (which one is the model's choice; Ollama's own grammar allows only
    the JSON)."""
    cl = client(served)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    either = cl.chat(served.model, messages=[{"role": "user", "content": WEATHER_Q}], tools=TOOLS, format=schema,
                     options={**GREEDY, "num_predict": 80}).message
    if either.tool_calls:
        assert "paris" in _weather_call(either)["city"].lower()
    else:
        jsonschema.validate(json.loads(either.content), schema)
    person = cl.chat(served.model, messages=[{"role": "user", "content": "Invent a person."}], tools=TOOLS, format=schema,
                     options={**GREEDY, "num_predict": 60}).message
    assert not person.tool_calls
    jsonschema.validate(json.loads(person.content), schema)


def test_options_as_floats_and_durations_as_strings_are_accepted(served: Served) -> None:
    r = raw_post(served, "/api/generate", {"model": f"{served.model}:latest", "prompt": "Say hi.", "stream": False, "keep_alive": "5m",
                                           "options": {"num_ctx": 8192.0, "num_predict": 6.0, "temperature": 0, "seed": 42.0, "top_k": 40.0}})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] <= 6
    assert raw_post(served, "/api/generate", {"model": served.model, "prompt": "Hi", "stream": False, "keep_alive": -1,
                                              "options": {"num_predict": 2}}).status_code == 200


def test_speculation_override_in_options(served: Served) -> None:
    msgs = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    off = raw_post(served, "/api/chat", {"model": served.model, "messages": msgs, "stream": False,
                                         "options": {**GREEDY, "num_predict": 40, "homespec_speculation": "off"}}).json()
    ngram = raw_post(served, "/api/chat", {"model": served.model, "messages": msgs, "stream": False,
                                           "options": {**GREEDY, "num_predict": 40, "homespec_speculation": "ngram", "homespec_k": 3}}).json()
    assert off["homespec"]["mode"] == "off" and off["homespec"]["proposed"] == 0
    assert ngram["homespec"]["mode"] == "ngram"
    assert off["message"]["content"] == ngram["message"]["content"]


def test_api_key_guards_the_ollama_routes_too(served: Served) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client(served, served.auth_url).list()
    assert e.value.status_code == 401 and "API key" in e.value.error
    keyed = client(served, served.auth_url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert keyed.list().models
    assert httpx.head(f"{served.auth_url}/", timeout=10).status_code == 200  # the heartbeat stays open


def test_metadata_endpoints_answer_while_a_generation_runs(served: Served) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "options": {**GREEDY, "num_predict": 200, "homespec_speculation": "off"}}
    first_line = threading.Event()
    done = threading.Event()

    def generate() -> None:
        with httpx.Client(base_url=served.url, timeout=300) as c, c.stream("POST", "/api/chat", json=body) as r:
            for _ in r.iter_lines():
                first_line.set()
        done.set()

    t = threading.Thread(target=generate, daemon=True)
    t.start()
    assert first_line.wait(120), "the generation never started"
    with httpx.Client(base_url=served.url, timeout=2.0) as c:  # a client that gives up after 2 s
        for path in ("/api/tags", "/api/ps", "/api/version", "/v1/models", "/health"):
            assert c.get(path).status_code == 200, path
        assert c.post("/api/show", json={"model": served.model}).status_code == 200
    assert not done.is_set(), "the generation ended before the metadata was read: the test proved nothing"
    t.join(300)


def test_logprobs_come_per_token_and_spell_the_answer(served: Served) -> None:
    r = client(served).chat(served.model, messages=[{"role": "user", "content": "Say hello."}], logprobs=True, top_logprobs=2,
                            options={**GREEDY, "num_predict": 6})
    assert r.logprobs and len(r.logprobs) == r.eval_count
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    for lp in r.logprobs:  # greedy: the chosen token is the likeliest
        assert len(lp.top_logprobs) == 2 and lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-4)


def test_a_second_turn_reuses_the_kv_cache_of_the_first(served: Served) -> None:
    def turn(messages: list, n: int) -> dict:
        return raw_post(served, "/api/chat", {"model": served.model, "messages": messages, "stream": False,
                                              "options": {**GREEDY, "num_predict": n}}).json()

    messages: list = [{"role": "user", "content": "Write a haiku about tea."}]
    first = turn(messages, 30)
    messages += [first["message"], {"role": "user", "content": "Now one about coffee."}]
    second = turn(messages, 8)
    assert second["homespec"]["cached_tokens"] >= first["homespec"]["prompt_tokens"]
    # prompt_eval_count counts the tokens evaluated now, so clients' prompt tokens/s is the real rate.
    assert second["prompt_eval_count"] == second["homespec"]["prompt_tokens"] - second["homespec"]["cached_tokens"]


def test_keep_alive_zero_unloads_and_the_next_request_loads_again(served: Served) -> None:
    cl = client(served)
    loaded = cl.generate(served.model, prompt="")  # Ollama's way to load a model
    assert loaded.done_reason == "load" and loaded.response == ""
    r = cl.chat(served.model, messages=[{"role": "user", "content": "Say hi."}], options={"num_predict": 2}, keep_alive=0)
    assert r.done
    wait_for(lambda: not cl.ps().models, 30, "the models to unload after keep_alive 0")
    assert served.daemon.state == "unloaded"
    again = cl.chat(served.model, messages=[{"role": "user", "content": "Say hi."}], options={"num_predict": 2})
    assert again.done and again.load_duration > 10**8  # nanoseconds: it loaded the models again
    assert cl.ps().models
    # `ollama stop`, as the Go CLI sends it: every field, empty or null (api/types.go has no omitempty).
    stop = raw_post(served, "/api/generate", {"model": served.model, "prompt": "", "suffix": "", "system": "", "template": "",
                                              "options": None, "keep_alive": "0s", "stream": False})
    assert stop.status_code == 200 and stop.json()["done_reason"] == "unload", stop.text
    assert not cl.ps().models
    # Load (`ollama run` sends messages null) and stay loaded (-1: forever), so the tests after
    # this one find the models warm.
    load = raw_post(served, "/api/chat", {"model": served.model, "messages": None, "options": None, "keep_alive": -1, "stream": False})
    assert load.status_code == 200 and load.json()["done_reason"] == "load", load.text
    (running,) = cl.ps().models
    assert running.expires_at.year > 2200
