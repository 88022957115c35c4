"""Chat messages -> prompt text, with the chat template the GGUF carries.

The template is Jinja2 (Hugging Face's `tokenizer.chat_template`), rendered in a sandbox as
transformers and llama-cpp-python do, with the helpers templates commonly call
(`raise_exception`, `strftime_now`).

`render_parts` keeps apart what the template wrote (its turn markers may be special tokens) and
what the messages say (always text): a message containing "<|im_end|>" must not close its turn.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import secrets
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from homespec.errors import UserError

# Used when a GGUF has no template: ChatML, which Qwen and many fine-tunes speak.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


log = logging.getLogger("homespec.llama.template")

# (text, trusted): trusted text was written by the template and may hold special-token markers;
# the rest is message content, to be tokenized as plain text.
Part = tuple[str, bool]


class TemplateError(UserError):
    """The chat template rejected the messages (e.g. roles out of order)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        # transformers' `tojson`: keys in the order given and text unescaped, as templates were
        # trained on (Jinja's own sorts keys and escapes HTML characters).
        env.filters["tojson"] = _tojson
        self.source = source or CHATML
        self._template = env.from_string(self.source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """tools: OpenAI-style function definitions, for templates with a tools section."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=[dict(t) for t in tools] if tools else None,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None

    def render_parts(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     special_texts: Collection[str] = ()) -> list[Part]:
        """The rendered prompt as (text, trusted) parts; joined, they equal `render(...)`.

        Renders once as usual and once with each message's content replaced by an unguessable
        placeholder; the placeholder render gives the template's own text, and the contents are
        located between those pieces in the real render (as given, or stripped: templates that
        `| trim` content are common). A template whose text depends on the content some other
        way falls back to the placeholder render with the content spliced in unchanged (logged).
        A template that cuts content (a slice) leaves no way to tell content from its own text:
        the whole render is trusted, so a message holding one of `special_texts` (the model's
        control-token texts) is refused rather than read as that token.
        """
        plain = self.render(messages, add_generation_prompt, tools)
        nonce = secrets.token_hex(8)
        contents: list[str] = []
        owners: list[int] = []  # [contents] the index in `messages` of each content
        masked = []
        for i, m in enumerate(messages):
            m = dict(m)
            c = m.get("content")
            if isinstance(c, str) and c:  # empty content has nothing to protect; templates test it
                m["content"] = f"\ue000{nonce}:{len(contents)}\ue001"
                contents.append(c)
                owners.append(i)
            masked.append(m)
        if not contents:
            return [(plain, True)]
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", self.render(masked, add_generation_prompt, tools))
        literals, order = pieces[0::2], [int(i) for i in pieces[1::2]]  # order: content index per slot
        if any("\ue000" in lit or "\ue001" in lit for lit in literals):
            # The template cut a placeholder (slices content): there is no telling content from
            # template text, so the prompt is tokenized as before.
            for i, c in enumerate(contents):
                marker = next((t for t in special_texts if t in c), None)
                if marker is not None:
                    raise TemplateError(f"messages[{owners[i]}].content holds {marker!r}, the text of "
                                        "a control token, and this model's chat template cuts message content, so it "
                                        "cannot be kept as text: remove it from the message")
            log.warning("the chat template cuts message content; messages are checked for control-token text instead")
            return [(plain, True)]
        parts = _locate(plain, literals, [contents[i] for i in order])
        if parts is None:
            log.warning("the chat template changes message content in a way homespec cannot follow; "
                        "content is passed to the model as the client sent it")
            parts = [(literals[0], True)]
            for i, lit in zip(order, literals[1:]):
                parts += [(contents[i], False), (lit, True)]
        return [p for p in parts if p[0]]


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _locate(plain: str, literals: list[str], contents: list[str]) -> list[Part] | None:
    """Split `plain` into literals[0] c0 literals[1] c1 ... where each c is its content as given
    or stripped; None when the render does not have that shape."""
    if not plain.startswith(literals[0]):
        return None
    parts: list[Part] = [(literals[0], True)]
    at = len(literals[0])
    for content, lit in zip(contents, literals[1:]):
        for cand in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if plain.startswith(cand + lit, at):
                parts += [(cand, False), (lit, True)]
                at += len(cand) + len(lit)
                break
        else:
            return None
    return parts if at == len(plain) else None
