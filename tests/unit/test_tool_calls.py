"""Tool calls without weights: the format read from a template, the grammar, the parser and the
stream splitter."""

from __future__ import annotations

import json

import pytest

from homespec.llama.template import CHATML
from homespec.serving.tool_calls import (
    HERMES,
    CallStream,
    ChatDeltas,
    ToolUse,
    call_grammar,
    chat_message,
    parse_calls,
    template_tool_calls,
    tool_format,
)
from homespec.speculation.constraints import GrammarError, check_grammar

QWEN_LIKE = "{%- if tools %}{{ tools | tojson }} <tool_call>\n{\"name\": ...}\n</tool_call>{%- endif %}" + CHATML
KNOWN = ["get_weather", "set_light"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_format_comes_from_the_template_and_a_template_without_tools_has_none():
    assert tool_format(QWEN_LIKE) is HERMES
    assert tool_format(CHATML) is None
    assert tool_format(None) is None


def test_a_well_formed_call_parses_into_an_openai_call_with_string_arguments():
    content, (call,) = parse_calls(HERMES, "Let me check." + CALL, KNOWN)
    assert content == "Let me check."
    body = call.openai()
    assert body["type"] == "function" and body["id"].startswith("call_")
    assert body["function"]["name"] == "get_weather"
    assert json.loads(body["function"]["arguments"]) == {"city": "Paris"}


def test_parallel_calls_and_a_fenced_call_parse():
    _, calls = parse_calls(HERMES, CALL + "\n" + CALL.replace("get_weather", "set_light"), KNOWN)
    assert [c.name for c in calls] == ["get_weather", "set_light"]
    fenced = '```json\n{\n  "name": "set_light",\n  "arguments": {"room": "hall", "on": true}\n}\n```'
    _, (call,) = parse_calls(HERMES, fenced, KNOWN)
    assert call.name == "set_light" and json.loads(call.arguments) == {"room": "hall", "on": True}


@pytest.mark.parametrize("text", [
    "Just prose, no call.",
    CALL.replace("get_weather", "launch_rockets"),  # not a declared tool
    CALL.replace('{"city": "Paris"}', '{"city": "Par'),  # broken JSON
    CALL[:-5],  # unclosed
    "```json\n[1, 2]\n```",  # a code block that is not a call
    CALL + " and then some text that is not a call",
])
def test_anything_but_well_formed_calls_of_known_tools_stays_text(text):
    assert parse_calls(HERMES, text, KNOWN) is None


def _stream(pieces: list[str]) -> tuple[str, list[str]]:
    s = CallStream(HERMES, KNOWN)
    content, names = "", []
    for p in pieces:
        c, calls = s.push(p)
        content += c
        names += [x.name for x in calls]
    rest, calls = s.finish()
    return content + rest, names + [x.name for x in calls]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_text_splits_into_content_and_calls_whatever_the_chunking(size):
    text = "Sure. " + CALL + "\n" + CALL
    content, names = _stream([text[i : i + size] for i in range(0, len(text), size)])
    assert content == "Sure. " and names == ["get_weather", "get_weather"]


def test_streaming_a_malformed_call_returns_it_as_text():
    broken = CALL.replace("get_weather", "nope")
    content, names = _stream(["Hi ", broken[:9], broken[9:]])
    assert names == [] and content == "Hi " + broken
    content, names = _stream(["Hi ", CALL[:20]])  # cut off (max_tokens) inside the call
    assert names == [] and content == "Hi " + CALL[:20]


BARE = '{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}'


@pytest.mark.parametrize("text", [BARE, '{{"name": "get_weather", "arguments": {"city": "Oslo"}}}', "\n" + BARE + "\n"])
def test_an_answer_that_is_one_call_with_no_marker_is_that_call(text):
    """Bare, or in the doubled braces of the template's example: how this model family writes a
    call at T > 0 under auto, one time in five here."""
    content, (call,) = parse_calls(HERMES, text, KNOWN)
    assert content == "" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    for size in (1, 5, 1000):  # streamed: held to the end, then sent as the call
        assert _stream([text[i : i + size] for i in range(0, len(text), size)]) == ("", ["get_weather"])


@pytest.mark.parametrize("text", [
    '{"name": "add", "arguments": {"a": 2, "b": 2}}',  # a tool it was not given
    '{"a": 1, "b": 2}',  # JSON asked for
    BARE + " and some words after it",
])
def test_an_answer_that_opens_with_a_brace_but_is_no_declared_call_stays_text(text):
    assert parse_calls(HERMES, text, KNOWN) is None
    assert _stream([text[:7], text[7:]]) == (text, [])


@pytest.mark.parametrize("pieces, sent", [
    (['{"lig', 'hts": [1, 2'], '{"lights": [1, 2'),  # a key no call has
    (['{\n  "name": "ad', 'd", "arguments": {'], '{\n  "name": "add", "arguments": {'),  # an undeclared tool
    (['{"na\\"me', '": 1'], '{"na\\"me": 1'),  # an escaped quote inside the key
    (['{"name": "get_weather"}', ' and then'], '{"name": "get_weather"} and then'),  # more after the object
    (['```json\n{\n  "fru', 'its": ['], '```json\n{\n  "fruits": ['),  # a fenced JSON answer
    (['```json\n', '[1, 2'], '```json\n[1, 2'),  # a fence that holds no object
    (['```json\n{"name": "get_weather"}', '\n``\n'], '```json\n{"name": "get_weather"}\n``\n'),
])
def test_an_answer_that_opens_like_a_call_streams_as_soon_as_it_cannot_be_one(pieces, sent):
    """Bare or in a ```json fence (how these models answer in JSON under tools), held only until
    it cannot be a call; the template's own marker is left to the grammar."""
    s = CallStream(HERMES, KNOWN)
    assert s.push(pieces[0]) == ("", [])
    assert s.push(pieces[1]) == (sent, [])
    assert s.push(" more") == (" more", []) and s.finish() == ("", [])


@pytest.mark.parametrize("text", [
    BARE,
    '{{"name": "set_light", "arguments": {"room": "a \\"quoted\\" hall}"}}}',
    '{"arguments": {"city": "Oslo"}, "name": "get_weather"}',  # keys in the other order
    '{"name": "get_weather", "arguments": {}, "note": "x"}',  # a key beyond a call's: a JSON answer
    '{"a": 1}' + CALL,  # text, then a call with its marker
    '{"name": "get_weather", "argu',  # cut off
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n\n{"name": "set_light"}',
    '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',  # a fenced call
    '```json\n{"name": "get_weather", "arguments": {}, "note": "x"}\n```',
    'Here: ```json\n{"fruits": ["apple"]}\n```',
])
def test_a_streamed_answer_that_opens_like_a_call_ends_as_the_whole_answer_parses(text):
    parsed = parse_calls(HERMES, text, KNOWN)
    names = [c.name for c in parsed[1]] if parsed else []
    for size in (1, 2, 5, 1000):
        content, streamed = _stream([text[i : i + size] for i in range(0, len(text), size)])
        assert streamed == names
        assert content.strip() == (parsed[0] if parsed else text.strip())


def test_a_call_with_no_marker_streams_as_openai_deltas_at_the_end():
    deltas = ChatDeltas(ToolUse(HERMES, KNOWN, False))
    assert deltas.push(BARE[:10]) == [] and deltas.push(BARE[10:]) == []
    held, reason = deltas.finish("stop")
    assert reason == "tool_calls" and held[0]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_plain_text_with_backticks_is_sent_once_the_marker_is_ruled_out():
    content, names = _stream(["use `x", "` here"])
    assert content == "use `x` here" and names == []


@pytest.mark.parametrize("choice", ["auto", "required", "none", "set_light"])
@pytest.mark.parametrize("parallel", [True, False])
def test_call_grammars_compile_for_every_choice(choice, parallel):
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
             "set_light": {}}
    check_grammar(call_grammar(HERMES, tools, choice, parallel))


class ByteTokenizer:
    """A vocabulary of single bytes plus the Hermes call markers as special tokens, as llguidance's
    TokenizerWrapper wants it: enough to ask a call grammar which texts it allows, without weights."""

    SPECIAL = (b"<tool_call>", b"</tool_call>")

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [*self.SPECIAL, b"<eos>"]
        self.eos_token_id = len(self.tokens) - 1
        self.special_token_ids = [256, 257, self.eos_token_id]
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((256 + j for j, m in enumerate(self.SPECIAL) if text.startswith(m, i)), None)
            ids.append(special if special is not None else text[i])
            i += len(self.SPECIAL[special - 256]) if special is not None else 1
        return ids


def allows(grammar: str, text: str) -> bool:
    """Whether the grammar allows `text` as a whole answer."""
    import llguidance

    bt = ByteTokenizer()
    m = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(bt)), grammar, log_level=0)
    ids = bt(text.encode())
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
BODY = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("parallel", [True, False])
def test_calls_may_end_after_the_separator_the_model_writes_after_each(parallel):
    grammar = call_grammar(HERMES, WEATHER, "required", parallel)
    call = f"<tool_call>\n{BODY}\n</tool_call>"
    assert allows(grammar, call) and allows(grammar, call + "\n")
    assert allows(grammar, call + "\n" + call) == parallel


def test_under_tool_choice_none_an_answer_may_open_like_a_call_and_stays_text():
    assert allows(call_grammar(HERMES, WEATHER, "none", True), '```json\n[1, 2]\n```')


def test_a_tool_schema_that_does_not_compile_is_refused_naming_the_tool_not_the_lark_around_it():
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
             "set_light": {"type": "object", "properties": {"room": {"type": "bogus"}}}}
    with pytest.raises(GrammarError) as e:
        call_grammar(HERMES, tools, "auto", True)
    assert str(e.value) == "tool 'set_light': invalid parameters schema: Invalid type: bogus"


def test_history_calls_carry_arguments_as_objects_for_the_template():
    (call,) = template_tool_calls([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert call["function"]["arguments"] == {"a": 1}
    with pytest.raises(ValueError):
        template_tool_calls([{"function": {"name": "f", "arguments": "{oops"}}])


def test_a_call_cut_off_by_max_tokens_drops_only_that_call():
    cut = CALL + "\n" + CALL[:30]
    assert parse_calls(HERMES, cut, KNOWN) is None  # not a well-formed answer
    content, calls = parse_calls(HERMES, cut, KNOWN, truncated=True)
    assert [c.name for c in calls] == ["get_weather"]
    s = CallStream(HERMES, KNOWN)
    _, done = s.push(cut)
    assert [c.name for c in done] == ["get_weather"] and s.finish(truncated=True) == ("", [])


@pytest.mark.parametrize("legacy", [False, True])
def test_calls_stream_as_openai_deltas_and_the_finish_reason_says_so(legacy):
    deltas = ChatDeltas(ToolUse(HERMES, KNOWN, legacy))
    out = deltas.push("Sure. " + CALL[:17]) + deltas.push(CALL[17:] + "\n" + CALL)
    held, reason = deltas.finish("stop")
    assert out[0] == {"content": "Sure. "} and held == []
    if legacy:  # one call, as function_call pieces
        assert reason == "function_call"
        assert [d["function_call"].get("name") for d in out[1:]] == ["get_weather", None]
    else:  # each call: its id and name first, then its arguments, under its own index
        assert reason == "tool_calls"
        assert [d["tool_calls"][0]["index"] for d in out[1:]] == [0, 0, 1, 1]
        assert json.loads(out[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    message, finish = chat_message("Sure. " + CALL, "stop", ToolUse(HERMES, KNOWN, legacy))
    assert finish == ("function_call" if legacy else "tool_calls") and message["content"] == "Sure."


def test_under_tool_choice_none_a_call_shaped_answer_is_text():
    message, finish = chat_message(CALL, "stop", ToolUse(HERMES, [], False))
    assert finish == "stop" and message == {"role": "assistant", "content": CALL}


def test_tool_schemas_compile_leniently_so_one_odd_tool_does_not_refuse_the_request():
    odd = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                                            "scene": {"type": "string", "format": "entity_id"}},
           "not": {"required": ["both"]}}
    grammar = call_grammar(HERMES, {**WEATHER, "set_scene": odd, "all_off": {"type": "object", "properties": None}}, "auto", True)
    assert allows(grammar, f"<tool_call>\n{BODY}\n</tool_call>")
    assert allows(grammar, '<tool_call>\n{"name": "all_off", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_with_an_answer_schema_the_answer_is_that_json_or_calls_and_nothing_else(choice):
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}
    grammar = call_grammar(HERMES, WEATHER, choice, True, answer=person)
    assert allows(grammar, '{"name": "Ada"}')
    assert not allows(grammar, "Ada is a person.") and not allows(grammar, '{"age": 3}')
    assert allows(grammar, f"<tool_call>\n{BODY}\n</tool_call>") == (choice == "auto")
