"""The rest of the OpenAI request surface against the real daemon and models, with the official
client: logit_bias, logprobs in both endpoints (streamed and not), refused fields by name."""

from __future__ import annotations

import openai
import pytest

from tests.integration.server_fixtures import Served
from tests.integration.test_server import COMPLETION_PROMPT, DAYS, FOX, PARIS, oai, wait_idle

pytestmark = pytest.mark.integration

OFF = {"homespec": {"speculation": "off"}}


def token_id(s: Served, text: str) -> int:
    """The one token `text` is (read while the worker is idle: tokenizing only reads the vocab)."""
    wait_idle(s)
    ids = s.daemon.session.models.target.tokenize(text, add_special=False, parse_special=False)  # type: ignore[union-attr]
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_minus_100_bans_the_greedy_token(served: Served) -> None:
    c = oai(served)
    msgs = [{"role": "user", "content": PARIS}]
    free = c.chat.completions.create(model=served.model, messages=msgs, max_tokens=2, logprobs=True, top_logprobs=3, extra_body=OFF)
    first = free.choices[0].logprobs.content[0]
    assert first.token == "Paris"
    paris = token_id(served, "Paris")
    for mode in ("off", "draft"):
        banned = c.chat.completions.create(model=served.model, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=3,
                                           logit_bias={str(paris): -100}, extra_body={"homespec": {"speculation": mode}})
        content = banned.choices[0].logprobs.content
        assert all(t.token != "Paris" for t in content), (mode, banned.choices[0].message.content)
        assert all(alt.token != "Paris" for alt in content[0].top_logprobs)  # -100 under the others
        # Banning the argmax promotes the runner-up of the same row.
        assert content[0].token == first.top_logprobs[1].token, (mode, content[0], first.top_logprobs)


def test_chat_logprobs_parse_with_the_openai_client_streaming_and_not(served: Served) -> None:
    c = oai(served)
    msgs = [{"role": "user", "content": DAYS}]
    whole = c.chat.completions.create(model=served.model, messages=msgs, max_tokens=12, logprobs=True, top_logprobs=3, extra_body=OFF)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens  # no stop string, no EOS within 12 tokens
    for t in content:
        assert bytes(t.bytes).decode() == t.token and t.logprob <= 0
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the row's argmax
        assert t.top_logprobs[0].logprob == t.logprob  # the same number, from the same row
    chunks = list(c.chat.completions.create(model=served.model, messages=msgs, max_tokens=12, logprobs=True, top_logprobs=3,
                                            stream=True, extra_body=OFF))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # Not bit-equal: a cached prompt is evaluated in other batches (DESIGN.md, "Exactness").
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=0.3)


def test_completion_logprobs_parse_with_the_openai_client_streaming_and_not(served: Served) -> None:
    c = oai(served)
    whole = c.completions.create(model=served.model, prompt=COMPLETION_PROMPT, max_tokens=8, logprobs=2, extra_body=OFF)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text and len(lp.tokens) == whole.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 and max(top.values()) == x for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(c.completions.create(model=served.model, prompt=COMPLETION_PROMPT, max_tokens=8, logprobs=2, stream=True,
                                       extra_body=OFF))
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset


def test_logprobs_with_speculation_are_those_of_plain_decoding(served: Served) -> None:
    """From the verified rows: the same tokens and, up to batch noise, the same numbers."""
    c = oai(served)
    msgs = [{"role": "user", "content": FOX}]  # copies the prompt: prompt lookup has drafts to verify
    runs = {mode: c.chat.completions.create(model=served.model, messages=msgs, max_tokens=16, logprobs=True,
                                            extra_body={"homespec": {"speculation": mode, "k": 4}})
            for mode in ("off", "ngram", "draft")}
    off = runs.pop("off").choices[0].logprobs.content
    for mode, r in runs.items():
        spec = r.choices[0].logprobs.content
        assert [t.token for t in spec] == [t.token for t in off], mode
        assert [t.logprob for t in spec] == pytest.approx([t.logprob for t in off], abs=0.3), mode
        assert r.model_extra["homespec"]["proposed"] > 0, mode


@pytest.mark.parametrize(
    "field, value", [("n", 2), ("modalities", ["text", "audio"]), ("reasoning_effort", "high"), ("web_search_options", {})]
)
def test_a_refused_field_raises_bad_request_naming_it_in_the_openai_client(served: Served, field: str, value: object) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai(served).chat.completions.create(model=served.model, messages=[{"role": "user", "content": PARIS}], max_tokens=2,
                                            **{field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_null_flags_mean_their_defaults_and_a_stream_keeps_one_created(served: Served) -> None:
    """The openai client's types allow stream=None and echo=None and send them as null."""
    client = oai(served)
    chat = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PARIS}], max_tokens=4,
                                          stream=None, extra_body=OFF)
    assert chat.choices[0].message.content
    done = client.completions.create(model=served.model, prompt=COMPLETION_PROMPT, max_tokens=4, echo=None, stream=None, extra_body=OFF)
    assert done.choices[0].text
    count = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    chunks = list(client.chat.completions.create(model=served.model, messages=count, max_tokens=64, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=OFF))
    # Over more than a second of chunks (64 tokens): "each chunk has the same timestamp".
    assert len(chunks) > 30 and len({c.created for c in chunks}) == 1


def test_llama_vscodes_edit_request_samples_in_llama_cpps_order_the_same_with_and_without_speculation(served: Served) -> None:
    """llama.vscode's "edit with AI" body (llama.cpp's whole default sampling set, its default order
    "edkypmxt": cuts before temperature) is answered, not refused; seeded, the answer is the same
    for every proposer, as a seeded draw is a pure function of seed, position and distribution."""
    from tests.unit.test_llama_options import LLAMA_VSCODE_EDIT

    code = "def area(w, h):\n    return w * h\n"
    # Both names renamed: with only w to rename, keeping h or writing height was a near-tie where
    # llama.cpp's batch noise (of AMX builds at 9 rows; DESIGN.md's near-tie rule) chose either.
    body = {**LLAMA_VSCODE_EDIT, "seed": 3, "max_tokens": 32,
            "messages": [LLAMA_VSCODE_EDIT["messages"][0],
                         {"role": "user", "content": f"Rename w to width and h to height. Output only the modified code.\n\n{code}"}]}
    answers = {}
    with served.client() as c:
        for mode in ("off", "auto", "draft"):
            r = c.post("/v1/chat/completions", json={**body, "homespec": {"speculation": mode}})
            assert r.status_code == 200, r.text
            answers[mode] = r.json()["choices"][0]["message"]["content"]
        assert c.post("/v1/chat/completions", json={**body, "max_tokens": -1, "max_completion_tokens": 4}).status_code == 200
    assert len(set(answers.values())) == 1, answers
    assert "width" in answers["off"], answers["off"]


def test_llama_cpp_clients_requests_are_answered_as_llama_server_answers_them(served: Served) -> None:
    """What llama.vim and llama.vscode send beyond OpenAI's surface: an empty `model` (their model
    setting left empty), routes without /v1, llama.vim's instruct warm-up (n_predict 0,
    response_fields, samplers []), and a context size to size prompts by."""
    with served.client() as c:
        warm = c.post("/v1/chat/completions", json={
            "id_slot": 0, "model": "", "messages": [{"role": "user", "content": "Rename x to y."}], "samplers": [],
            "n_predict": 0, "stream": False, "cache_prompt": True, "response_fields": [""]})
        assert warm.status_code == 200, warm.text
        assert warm.json()["object"] == "chat.completion" and warm.json()["usage"]["completion_tokens"] == 1
        card = c.get("/models").json()["data"][0]
        assert card == c.get("/v1/models").json()["data"][0] and card["context_length"] == served.daemon.n_ctx
    # llama.vscode's OpenAI-compatible completion mode: the openai client at the server's root, model "".
    root = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0)
    done = root.completions.create(model="", prompt="def add(a, b):\n    return", max_tokens=4, temperature=0.1, top_p=0.99)
    assert done.choices[0].text and done.usage.completion_tokens <= 4
    chat = root.chat.completions.create(model="", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert chat.choices[0].message.content
