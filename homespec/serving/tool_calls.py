"""Tool calls: the format a model's chat template teaches, the grammar that keeps calls valid, and
the parser that turns the model's text back into OpenAI's `tool_calls`.

The format comes from the template, not from the model's name: a template that writes calls as
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (Qwen 2 / 2.5 / 3, Hermes, and
their fine-tunes; tool results go back in the template's own `<tool_response>` turn) gets the
Hermes format. A template without a tools section cannot be asked for tools; the request is
refused rather than answered in prose.

Generation is constrained in every mode that can call a tool, so a call is always one of the
declared functions with arguments valid for its parameters schema (llguidance, JSON_STYLE):
- auto: free text, then optionally calls (the text cannot contain the call marker);
- required / a named function: calls only (one, unless parallel_tool_calls);
- none: free text without the call marker.
The grammar's forced tokens (the marker's newline, `{"name": "`, the name when only one tool
fits, `", "arguments": {"` and the schema's keys) are the jump-forward drafts of the engine.

The answer goes back in OpenAI's shape: `message.tool_calls` (or the legacy `function_call`)
with finish_reason "tool_calls", or streamed as `delta.tool_calls` pieces (ChatDeltas).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from homespec.speculation.constraints import GrammarError, check_grammar, json_schema_grammar, json_style

ANY_TEXT = "/(.|\\n)+/"  # Lark: any text; the call markers are special tokens, so outside it


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # the marker before a call's JSON (a special token in Qwen's vocabulary)
    close: str  # the marker after it
    separator: str  # between two calls
    # Other wrappings models of this family write a call in when free to (auto): accepted when
    # parsing, as llama.cpp's Hermes parser accepts them. Measured: Qwen2.5-Coder 1.5B answers
    # every tool request under auto with a ```json fenced {"name": ..., "arguments": ...}.
    loose: tuple[tuple[str, str], ...] = ()

    @property
    def markers(self) -> tuple[tuple[str, str], ...]:
        """(open, close) pairs, the template's own first."""
        return ((self.open, self.close), *self.loose)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "\n", loose=(("```json", "```"),))


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The call format a chat template teaches, or None when it has no tools section."""
    if template_source and "tools" in template_source and HERMES.open in template_source:
        return HERMES
    return None


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: a string

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the grammar ---------------------------------------------------------------------------------


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def _marker(text: str) -> str:
    """A marker as Lark: the special token when the template's marker is one (`<...>`), so the
    model writes the token it was trained on."""
    return text if re.fullmatch(r"<[^<>\s]+>", text) else _literal(text)


def call_grammar(fmt: ToolFormat, tools: Mapping[str, Mapping[str, Any]], choice: str, parallel: bool,
                 answer: Mapping[str, Any] | bool | None = None, answer_lenient: bool = False) -> str:
    """The Lark grammar for a request's tool calls.

    tools: name -> parameters JSON schema; choice: "auto" | "required" | "none" | a tool name.
    answer: a JSON schema the answer follows when it calls no tool (response_format, Ollama's
    format); None: free text. answer_lenient: its unsupported keywords are ignored (Ollama's).
    Parameters schemas compile leniently: keywords llguidance cannot enforce (uniqueItems, not,
    an unknown format) are ignored, as Ollama and llama.cpp ignore them, so that one tool among
    an app's many (Home Assistant's, an MCP server's) does not refuse the request.
    """
    names = list(tools) if choice in ("auto", "required", "none") else [choice]
    parallel = parallel and choice in ("auto", "required")  # a named function: one call of it
    rules = [
        "%llguidance {}",
        f"TEXT: {ANY_TEXT}",
        f"call: {_marker(fmt.open)} \"\\n\" body \"\\n\" {_marker(fmt.close)}",
        # The separator may also end the calls: after a call's close marker the model writes it
        # whether or not another call follows (Qwen2.5-Coder 1.5B: "\n" at logprob -0.0, its end
        # of turn at -7.9), so a separator that could only lead to another call made every
        # `required` answer repeat its call until max_tokens.
        "calls: call" + (f" ({_literal(fmt.separator)} call)*" if parallel else "") + f" {_literal(fmt.separator)}?",
        "body: " + " | ".join(f"body_{i}" for i in range(len(names))),
    ]
    for i, name in enumerate(names):
        schema = {"x-guidance": json_style(lenient=True), **_object_schema(tools[name])}
        rules.append(f"body_{i}: {_literal('{' + json.dumps('name') + ': ' + json.dumps(name) + ', ' + json.dumps('arguments') + ': ')} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    if answer is None:
        start = {"auto": "start: TEXT? calls?", "none": "start: TEXT?"}.get(choice, "start: calls")
    else:  # the answer is the JSON asked for or calls, not both
        rules.append(f"answer: %json {json.dumps({'x-guidance': json_style(answer_lenient), **({} if answer is True else answer)})}")
        start = {"auto": "start: answer | calls", "none": "start: answer"}.get(choice, "start: calls")
    grammar = "\n".join([start, *rules]) + "\n"
    try:
        check_grammar(grammar)
    except GrammarError:
        _name_bad_schema(tools, names)  # llguidance's message quotes the Lark around the schema
        raise
    return grammar


def _name_bad_schema(tools: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> None:
    """GrammarError naming the first tool whose parameters schema does not compile alone."""
    for name in names:
        try:
            json_schema_grammar(_object_schema(tools[name]), lenient=True)  # as in the grammar
        except GrammarError as e:
            reason = str(e).removeprefix("invalid grammar: ").removeprefix("invalid JSON schema: ")
            raise GrammarError(f"tool {name!r}: invalid parameters schema: {reason}") from None


def _object_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema; OpenAI allows it to be omitted (no parameters)."""
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    # A Go client (Ollama's) sends the keywords it has no value for as null ("properties": null).
    return {k: v for k, v in parameters.items() if v is not None}


# -- parsing the model's text --------------------------------------------------------------------


def parse_calls(fmt: ToolFormat, text: str, known: Sequence[str], truncated: bool = False) -> tuple[str, list[Call]] | None:
    """(content before the calls, calls), or None when the text holds no well-formed call of a
    known tool (then the caller returns it as text: a malformed call is never an error).
    truncated: the answer hit max_tokens, so a last call still open is cut off, not malformed:
    the complete calls before it are returned."""
    found = _first_marker(fmt, text)
    if found is None:
        call = whole_answer_call(text, known)
        return ("", [call]) if call is not None else None
    content, rest = text[: found[0]], text[found[0] :]
    calls: list[Call] = []
    while rest.strip():
        rest = rest.lstrip()
        pair = next((p for p in fmt.markers if rest.startswith(p[0])), None)
        if pair is None:
            return None
        end = rest.find(pair[1], len(pair[0]))
        if end < 0:
            return (content.strip(), calls) if truncated and calls else None
        call = _parse_body(rest[len(pair[0]) : end], known, only_call_keys=pair[0] != fmt.open)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end + len(pair[1]) :]
    return content.strip(), calls


def whole_answer_call(text: str, known: Sequence[str]) -> Call | None:
    """A call written with no marker at all: an answer that is nothing but one call's JSON, bare
    or in the doubled braces of the Hermes template's example (`{{"name": ..., "arguments": ...}}`).
    Sampled at T 0.8 under tool_choice auto, Qwen2.5-Coder 1.5B answered 11 of 50 tool requests
    so, each naming a declared tool with valid arguments. Only a declared tool's name makes it a
    call: the same model answers "What is 2+2?" with a call to an `add` it was never given."""
    body = text.strip()
    if body.startswith("{{") and body.endswith("}}"):
        body = body[1:-1]
    return _parse_body(body, known, only_call_keys=True) if body.startswith("{") else None


CALL_KEYS = ("name", "arguments", "parameters")  # what a call's object holds (`parameters`: Llama 3 style)


class BareScan:
    """Reads a streamed call body that is not the template's own marker as it grows (an answer
    that opens with "{", which may be one call with no marker, or the inside of a ```json fence),
    to rule out early that it is a call: once a top-level key no call has appears, "name" is a
    complete string naming no declared tool, or the object has closed with more after it than
    `after` (the doubled brace, or the start of the fence's close). Until then the text is held;
    from then on it streams as text, so a JSON answer under tools is not withheld to its end.
    Incremental: each feed scans only what came since, except an unfinished string (rescanned
    from its quote, which str.find does in C)."""

    def __init__(self, known: Sequence[str], after: str = "") -> None:
        self.known, self.after = known, after
        self.at = 0  # where the scan resumes in the text (after its leading whitespace)
        self.depth = 0
        self.key: str | None = None  # the top-level key whose value comes next
        self.doubled: bool | None = None  # `{{...}}`, the template example's form
        self.closed = -1  # where the top-level object closed

    def may_be_call(self, text: str) -> bool:
        body = text.lstrip()
        if self.doubled is None:
            if body[:1] not in ("", "{"):
                return False  # a call is an object
            if len(body) < 2:
                return True
            self.doubled = body.startswith("{{")
            self.at = 1 if self.doubled else 0  # the doubled form's inner object is the call
        i, n = self.at, len(body)
        while i < n and self.closed < 0:
            ch = body[i]
            if ch == '"':
                end = _string_end(body, i)
                follows = _NON_SPACE.search(body, end) if end > 0 else None
                if follows is None:  # the string, or what follows it, has not come yet
                    break
                if self.depth == 1:
                    try:
                        word = json.loads(body[i:end])
                    except json.JSONDecodeError:
                        return False  # not JSON, so no call
                    if follows.group() == ":":
                        if word not in CALL_KEYS:
                            return False
                        self.key = word
                    elif self.key == "name" and word not in self.known:
                        return False
                i = end
                continue
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = i
            i += 1
        self.at = i
        if self.closed < 0:
            return True
        tail = body[self.closed + 1 :].lstrip()
        if self.after:  # in a fence: only its close may follow, which ends the scan when whole
            return self.after.startswith(tail)
        return tail.rstrip() in (("", "}") if self.doubled else ("",))


_NON_SPACE = re.compile(r"\S")


def _string_end(text: str, start: int) -> int:
    """Index after the JSON string literal opening at start, or -1 when it has not closed yet."""
    i = start + 1
    while (i := text.find('"', i)) >= 0:
        j = i
        while text[j - 1] == "\\":
            j -= 1
        if (i - j) % 2 == 0:  # an even run of backslashes escapes each other, not the quote
            return i + 1
        i += 1
    return -1


def _first_marker(fmt: ToolFormat, text: str) -> tuple[int, str, str] | None:
    """(position, open, close) of the earliest call marker in text."""
    hits = [(at, o, c) for o, c in fmt.markers if (at := text.find(o)) >= 0]
    return min(hits) if hits else None


def _parse_body(body: str, known: Sequence[str], only_call_keys: bool = False) -> Call | None:
    """only_call_keys: an object with any key beyond CALL_KEYS is no call (for a call with no
    marker, which is otherwise just a JSON answer that happens to have a "name")."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    if only_call_keys and not set(obj) <= set(CALL_KEYS):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class CallStream:
    """Splits streamed text into content and complete calls: content passes through at once,
    except a tail that may be the start of a call marker; a call is released when it closes.
    A malformed call turns the rest of the stream into text, and finish() returns what was
    held back (an unclosed call comes out as text too)."""

    def __init__(self, fmt: ToolFormat, known: Sequence[str]) -> None:
        self.fmt, self.known = fmt, list(known)
        self.buf = ""  # text not yet sent; inside a call: after its opening marker
        self.close: str | None = None  # inside a call: the marker that ends it
        self.broken = False  # a malformed call was seen: everything after is text
        # The answer opens with "{": it may be one call with no marker (whole_answer_call), so
        # it is held until its end or until `scan` rules that out. None: only whitespace yet.
        self.bare: bool | None = None
        self.scan = BareScan(self.known)
        self.inside: BareScan | None = None  # in a loose wrapping (a ```json fence): its body's scan
        self.calls: list[Call] = []

    def push(self, text: str) -> tuple[str, list[Call]]:
        """New text -> (content to send now, calls completed now)."""
        self.buf += text
        if self.bare is None and self.buf.strip():
            self.bare = self.buf.lstrip().startswith("{")
        if self.bare is None or (self.bare and self.scan.may_be_call(self.buf)):
            return "", []
        self.bare = False  # text, read for markers like any answer (as parse_calls reads it)
        if self.broken:
            out, self.buf = self.buf, ""
            return out, []
        content, done = "", []
        while True:
            if self.close is None:
                found = _first_marker(self.fmt, self.buf)
                if found is None:
                    cut = len(self.buf) - max(_partial_suffix(self.buf, o) for o, _ in self.fmt.markers)
                    content += self.buf[:cut] if not self.calls else self.buf[:cut].strip()
                    self.buf = self.buf[cut:]
                    return content, done
                at, opener, self.close = found
                self.inside = BareScan(self.known, after=self.close) if opener != self.fmt.open else None
                # Content before the first call is sent; whitespace between calls is not.
                content += self.buf[:at] if not self.calls else ""
                self.buf = self.buf[at + len(opener) :]
            end = self.buf.find(self.close)
            if end < 0 and (self.inside is None or self.inside.may_be_call(self.buf)):
                return content, done
            call = _parse_body(self.buf[:end], self.known, only_call_keys=self.inside is not None) if end >= 0 else None
            if call is None:
                self.broken = True
                content, self.buf = content + self._opened() + self.buf, ""
                self.close = None
                return content, done
            done.append(call)
            self.calls.append(call)
            self.buf = self.buf[end + len(self.close) :]
            self.close = None

    def _opened(self) -> str:
        """The marker of the call being read (its text was taken off the buffer)."""
        return next(o for o, c in self.fmt.markers if c == self.close)

    def finish(self, truncated: bool = False) -> tuple[str, list[Call]]:
        """(What was held back, as text; a call completed only now: an answer that is one call
        with no marker). truncated (max_tokens): a call cut off after complete ones is dropped,
        as parse_calls drops it."""
        head, calls = "", []
        if self.bare:
            call = whole_answer_call(self.buf, self.known)
            if call is not None:
                self.calls.append(call)
                self.buf = ""
                return "", [call]
            self.bare = False
            head, calls = self.push("")  # any markers in it are calls, as parse_calls finds them
        rest = (self._opened() if self.close is not None else "") + self.buf
        if truncated and self.close is not None and self.calls:
            rest = ""
        self.buf, self.close = "", None
        return head + rest, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# -- OpenAI's shape of the answer ------------------------------------------------------------------


@dataclass(frozen=True)
class ToolUse:
    """How this request's answer may call tools."""

    fmt: ToolFormat
    names: list[str]  # the tools a call may name; empty under tool_choice "none"
    legacy: bool  # answered as `function_call` (the deprecated `functions` API)


def chat_message(text: str, finish: str, tools: ToolUse | None) -> tuple[dict[str, Any], str]:
    """The assistant message and finish_reason: the model's calls, when it made any well-formed
    ones, as tool_calls (or the legacy function_call); otherwise its text."""
    parsed = parse_calls(tools.fmt, text, tools.names, truncated=finish == "length") if tools is not None else None
    if parsed is None or not parsed[1]:
        return {"role": "assistant", "content": text}, finish
    content, calls = parsed
    if finish == "length":  # complete calls before a cut-off one: sent, and said to be cut
        return {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in calls]}, finish
    if tools is not None and tools.legacy:
        fn = calls[0].openai()["function"]
        return {"role": "assistant", "content": content or None, "function_call": fn}, "function_call"
    return {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in calls]}, "tool_calls"


class ChatDeltas:
    """Streamed text -> chat deltas: content as it comes; with tools, each call once it closes,
    as OpenAI streams them (id, type and name first, then the arguments) so that clients'
    stream helpers reassemble them."""

    def __init__(self, tools: ToolUse | None) -> None:
        self.tools = tools
        self.calls = CallStream(tools.fmt, tools.names) if tools is not None else None
        self.n_calls = 0

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.calls is None:
            return [{"content": text}] if text else []
        content, calls = self.calls.push(text)
        return ([{"content": content}] if content else []) + [d for c in calls for d in self._call(c)]

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """Held-back text, and the finish_reason (tool_calls once a call was sent)."""
        if self.calls is None:
            return [], reason
        rest, calls = self.calls.finish(truncated=reason == "length")
        deltas = ([{"content": rest}] if rest else []) + [d for c in calls for d in self._call(c)]
        if self.n_calls and reason != "length":
            reason = "function_call" if self.tools is not None and self.tools.legacy else "tool_calls"
        return deltas, reason

    def _call(self, call: Call) -> list[dict[str, Any]]:
        if self.tools is not None and self.tools.legacy:
            if self.n_calls:  # the legacy API has one call per answer
                return []
            self.n_calls += 1
            return [{"function_call": {"name": call.name, "arguments": ""}}, {"function_call": {"arguments": call.arguments}}]
        i = self.n_calls
        self.n_calls += 1
        head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}]


# -- history: OpenAI's messages as chat templates expect them ------------------------------------


def template_tool_calls(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls as templates render them: arguments as an object
    (templates write them with `tojson`; a JSON string would be quoted twice)."""
    out = []
    for c in calls:
        fn = c["function"]
        args = fn.get("arguments")
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
