"""llama.cpp's /tokenize and /detokenize on the real daemon (uvicorn on loopback, httpx): the ids
are the target's own, as the engine tokenizes a prompt, and come back as the text."""

from __future__ import annotations

import httpx

from tests.integration.server_fixtures import API_KEY, Served

TEXT = "<|im_start|>user\nCount the lights: été, 日本, 🙂<|im_end|>"


def _post(s: Served, path: str, body: dict) -> httpx.Response:
    with s.client() as c:
        return c.post(path, json=body)


def test_tokenize_gives_the_ids_the_target_reads_and_detokenize_gives_the_text_back(served: Served):
    target = served.daemon.session.models.target  # type: ignore[union-attr]
    r = _post(served, "/tokenize", {"content": TEXT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == target.tokenize(TEXT, add_special=False, parse_special=True)
    assert ids[0] == target.tokenize("<|im_start|>", add_special=False)[0] and len(ids) < len(TEXT)  # the marker is one token
    literal = _post(served, "/tokenize", {"content": TEXT, "parse_special": False}).json()["tokens"]
    assert len(literal) > len(ids)  # the marker spelt out in characters
    r = _post(served, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"content": TEXT}, r.text


def test_pieces_are_text_or_the_bytes_of_part_of_a_character(served: Served):
    r = _post(served, "/tokenize", {"content": "é 𝄞 light", "with_pieces": True})
    assert r.status_code == 200, r.text
    pieces = r.json()["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == "é 𝄞 light"
    assert any(isinstance(p["piece"], list) for p in pieces), pieces  # 𝄞 is two tokens, neither of them whole UTF-8
    assert [p["id"] for p in pieces] == _post(served, "/tokenize", {"content": "é 𝄞 light"}).json()["tokens"]


def test_bad_tokenize_requests_get_a_400_naming_the_field(served: Served):
    r = _post(served, "/detokenize", {"tokens": [1, -5, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    assert "[-5, 1000000000]" in r.json()["error"]["message"]
    r = _post(served, "/tokenize", {"text": "no content field"})
    assert r.status_code == 400 and "content" in r.text, r.text


def test_tokenize_needs_the_api_key_where_one_is_set(served: Served):
    assert httpx.post(f"{served.auth_url}/tokenize", json={"content": "hi"}, timeout=30).status_code == 401
    r = httpx.post(f"{served.auth_url}/tokenize", json={"content": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"], r.text
