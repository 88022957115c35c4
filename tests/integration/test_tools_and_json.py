"""Tool calls and structured output through the real daemon, with the official `openai` client.

The target is Qwen2.5-Coder 1.5B, whose chat template teaches the Hermes call format. Calls are
constrained, so every call the server returns is one of the declared functions with arguments
valid for its schema; the tests check that with `jsonschema`, never by trusting the server.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.server_fixtures import Served
from tests.integration.test_server import assert_openai_error, oai, post_chat

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
LIGHT = {
    "type": "object",
    "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}, "brightness": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["room", "on"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_light", "description": "Switch a light in a room of the house.", "parameters": LIGHT}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_Q = "What is the weather like in Paris right now?"


def _valid_call(call) -> dict:
    """The call's arguments, after checking them against the declared schema."""
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_tool_call_round_trip_with_the_openai_client(served: Served) -> None:
    client = oai(served)
    messages = [{"role": "user", "content": WEATHER_Q}]
    r = client.chat.completions.create(model=served.model, messages=messages, tools=TOOLS, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert "paris" in _valid_call(call)["city"].lower()
    # The result goes back as a tool message; the answer uses it. (The tools are not sent again:
    # with them in its prompt this 1.5B coder model repeats the call instead of answering.)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 31, "sky": "clear"})},
    ]
    r2 = client.chat.completions.create(model=served.model, messages=messages, max_tokens=60, temperature=0)
    assert r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    assert "31" in r2.choices[0].message.content


def test_streamed_tool_calls_reassemble_in_the_openai_stream_helper(served: Served) -> None:
    with oai(served).beta.chat.completions.stream(
        model=served.model, messages=[{"role": "user", "content": WEATHER_Q}], tools=TOOLS, max_tokens=80, temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "paris" in _valid_call(call)["city"].lower()


@pytest.mark.parametrize("choice", ["required", "set_light"])
@pytest.mark.parametrize("prompt", [
    "Hello! How are you today?",  # no reason to call anything: the choice forces a call
    "Turn on the kitchen light at half brightness.",
    "Is it going to rain in Oslo?",
])
def test_required_and_named_tool_choice_always_yield_a_schema_valid_call(served: Served, choice: str, prompt: str) -> None:
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    r = oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    _valid_call(call)
    if choice != "required":
        assert call.function.name == choice


@pytest.mark.parametrize("prompt", ["Turn on the kitchen light at half brightness.", "Is it going to rain in Oslo?"])
def test_required_calls_with_parallel_calls_allowed_end_with_the_models_turn(served: Served, prompt: str) -> None:
    """After a call's close marker this model writes the separator ("\n") whether or not another
    call follows; the grammar lets the answer end there, so it does not repeat its call until
    max_tokens (it did while the separator could only lead to another call)."""
    r = oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
        tool_choice="required", max_tokens=120, temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = [(call.function.name, call.function.arguments) for call in c.message.tool_calls]
    assert len(set(calls)) == len(calls), calls  # no call said twice
    for call in c.message.tool_calls:
        _valid_call(call)


def test_tool_choice_none_answers_in_text(served: Served) -> None:
    r = oai(served).chat.completions.create(model=served.model, messages=[{"role": "user", "content": WEATHER_Q}],
                                            tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    assert "<tool_call>" not in r.choices[0].message.content


def test_sampled_tool_calls_are_schema_valid(served: Served) -> None:
    for seed in range(3):
        r = oai(served).chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Dim the bedroom light a bit."}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0.9, seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            _valid_call(call)


def test_legacy_functions_get_a_function_call(served: Served) -> None:
    body = {"messages": [{"role": "user", "content": WEATHER_Q}], "functions": [t["function"] for t in TOOLS],
            "function_call": {"name": "get_weather"}, "max_tokens": 80, "temperature": 0}
    r = post_chat(served, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"]["name"] == "get_weather"
    jsonschema.validate(json.loads(choice["message"]["function_call"]["arguments"]), WEATHER)


# -- structured output ---------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "role": {"type": "string", "enum": ["developer", "designer", "manager"]},
    },
    "required": ["name", "age", "languages", "role"],
    "additionalProperties": False,
}
PEOPLE = ["Ada, 36, writes Python and Rust", "Grace, a manager in her sixties", "Linus, 28, designer who codes C",
          "Margaret, 33, Fortran and assembly", "Ken, developer, 50, knows Go"]
JSON_PROMPTS = [f"Describe this person as JSON: {p}." for p in PEOPLE] * 4  # 20 requests


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_twenty_json_schema_answers_all_validate(served: Served) -> None:
    client = oai(served)
    for i, prompt in enumerate(JSON_PROMPTS):
        temperature = 0 if i < len(PEOPLE) else 0.8  # greedy once each, then sampled
        r = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": prompt}],
                                           response_format=_schema_format(PERSON), max_tokens=120,
                                           temperature=temperature, seed=i)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_answer_is_a_json_object(served: Served) -> None:
    r = oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Give me the three primary colours as JSON."}],
        response_format={"type": "json_object"}, max_tokens=80, temperature=0,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tools_with_response_format_answer_with_a_call_or_the_json_asked_for(served: Served) -> None:
    """As OpenAI does (agent frameworks send both): the answer calls a tool or is the schema's JSON.
    (Which of the two is the model's choice: asked for the weather under auto, this 1.5B model
    answers with the schema's JSON, so the call is asked for with tool_choice "required".)"""
    client = oai(served)
    weather = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": WEATHER_Q}], tools=TOOLS,
                                             tool_choice="required", response_format=_schema_format(PERSON), max_tokens=80, temperature=0)
    (call,) = weather.choices[0].message.tool_calls
    assert weather.choices[0].finish_reason == "tool_calls" and "paris" in _valid_call(call)["city"].lower()
    person = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": JSON_PROMPTS[0]}], tools=TOOLS,
                                            response_format=_schema_format(PERSON), max_tokens=120, temperature=0)
    assert not person.choices[0].message.tool_calls
    jsonschema.validate(json.loads(person.choices[0].message.content), PERSON)


def test_response_format_holds_under_tool_choice_none_and_without_a_schema(served: Served) -> None:
    client = oai(served)
    r = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Give me a JSON object describing Paris weather."}],
                                       tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict) and not r.choices[0].message.tool_calls
    # json_schema's schema is optional in OpenAI's API: any JSON value.
    r = post_chat(served, {"messages": [{"role": "user", "content": "The three primary colours, as a JSON list."}], "max_tokens": 40,
                           "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "answer"}}})
    assert r.status_code == 200, r.text
    json.loads(r.json()["choices"][0]["message"]["content"])


def test_gbnf_grammar_constrains_the_answer(served: Served) -> None:
    r = post_chat(served, {"messages": [{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
                           "grammar": 'root ::= ("yes" | "no") "."', "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes.", "no.")


@pytest.mark.parametrize("mode", ["ngram", "draft", "auto"])
def test_greedy_constrained_output_is_the_same_with_speculation_off_and_on(served: Served, mode: str) -> None:
    def answer(m: str):
        return oai(served).chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": JSON_PROMPTS[0]}],
            response_format=_schema_format(PERSON), max_tokens=120, temperature=0,
            extra_body={"homespec": {"speculation": m, "k": 4}},
        )
    off, on = answer("off"), answer(mode)
    assert on.choices[0].message.content == off.choices[0].message.content
    # The schema's keys and punctuation came as free drafts, always accepted.
    forced = {c: n for c, n in on.model_extra["homespec"]["proposers"].items() if c.startswith("grammar:")}
    assert forced, on.model_extra["homespec"]["proposers"]


def test_jump_forward_tokens_are_accepted_and_cost_no_proposer_time(served: Served) -> None:
    r = oai(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": WEATHER_Q}], tools=TOOLS, tool_choice="required",
        max_tokens=80, temperature=0, extra_body={"homespec": {"speculation": "off"}},
    )
    ext = r.model_extra["homespec"]
    # Speculation is off, so every proposed token was a forced one: all accepted.
    assert ext["proposed"] >= 8 and ext["accepted"] == ext["proposed"], ext
    assert ext["draft_s"] == 0


# -- bad requests --------------------------------------------------------------------------------

BAD = [
    ("schema-not-a-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}}, "response_format"),
    ("json-schema-missing", {"response_format": {"type": "json_schema"}}, None),
    ("bad-grammar", {"grammar": "root ::= undefined"}, "grammar"),
    ("tool-choice-unknown-name", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, None),
    ("tool-choice-without-tools", {"tool_choice": "required"}, None),
    ("tools-and-grammar", {"tools": TOOLS, "grammar": 'root ::= "x"'}, None),
    ("bad-tool-name", {"tools": [{"type": "function", "function": {"name": "has space"}}]}, None),
    ("history-arguments-not-json", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}], "tools": TOOLS}, "messages[1].tool_calls"),
]


@pytest.mark.parametrize("body, param", [(b, p) for _, b, p in BAD], ids=[i for i, _, _ in BAD])
def test_bad_constraint_requests_get_a_400_naming_the_field(served: Served, body: dict, param: str | None) -> None:
    full = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    assert_openai_error(post_chat(served, full), 400, param=param)


def test_openai_client_raises_bad_request_for_an_invalid_schema(served: Served) -> None:
    with pytest.raises(openai.BadRequestError):
        oai(served).chat.completions.create(model=served.model, messages=[{"role": "user", "content": "hi"}],
                                            response_format=_schema_format({"type": "nonsense"}), max_tokens=4)


def test_the_same_tool_call_question_again_drafts_the_remembered_call(served: Served) -> None:
    # A tool call's grammar shapes its answer, so the memory files it under the prompt and the
    # grammar (engine.shaping): asked again with the same tools, the whole earlier call is the
    # draft. Forced ngram: what is drafted, not what auto judges worth it on this CPU.
    kw = dict(model=served.model, messages=[{"role": "user", "content": "Switch off the light in the hall, please."}],
              tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0,
              extra_body={"homespec": {"speculation": "ngram", "k": 8}})
    first = oai(served).chat.completions.create(**kw)
    again = oai(served).chat.completions.create(**kw)
    (call,), (call2,) = first.choices[0].message.tool_calls, again.choices[0].message.tool_calls
    assert (call2.function.name, _valid_call(call2)) == (call.function.name, _valid_call(call))
    f, a = first.model_extra["homespec"], again.model_extra["homespec"]
    assert a["steps"] < f["steps"], (f, a)
    assert a["accepted"] > f["accepted"], (f, a)


# A required property whose schema is itself: `{"a": ` and then no value can come (llguidance
# finds it at that mask). The answer used to end there with finish_reason "stop".
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}


def test_a_schema_that_allows_no_complete_answer_is_an_error_not_a_stopped_answer(served: Served) -> None:
    client = oai(served)
    ask = {"model": served.model, "messages": [{"role": "user", "content": "Give me a JSON object."}],
           "response_format": _schema_format(ENDLESS), "max_tokens": 16, "temperature": 0}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask)
    assert e.value.code == "grammar_dead_end" and "schema" in e.value.message
    text, raised = "", None
    try:  # streamed, the text so far has gone out; the stream ends with the error, not a finish
        for chunk in client.chat.completions.create(**ask, stream=True):
            if chunk.choices:
                assert chunk.choices[0].finish_reason is None
                text += chunk.choices[0].delta.content or ""
    except openai.APIError as err:
        raised = err
    assert raised is not None and "grammar or schema" in str(raised)
    assert text.startswith("{") and '"a"' in text
