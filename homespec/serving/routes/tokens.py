"""llama.cpp server's POST /tokenize and POST /detokenize: the served model's token ids for a
text, and the text of ids. Clients of llama-server count tokens with them (to fit a prompt or a
chat history in the context) and show what a token is.

The bodies are llama-server's (tools/server/README.md): `content`, `add_special` (default false),
`parse_special` (default true), `with_pieces` (each id with its text; a piece that is not whole
UTF-8 comes as its byte values); and `tokens`. The tokenizer is the target's vocabulary alone
(`Daemon.vocabulary`), so these answer without the worker thread, also while a generation runs
or after the model was unloaded.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from homespec.errors import ModelError
from homespec.llama.runtime import Vocabulary
from homespec.serving import openai_api as oa
from homespec.serving.request_types import Flag, Integer
from homespec.serving.routes.common import daemon_of

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as llama-server ignores fields it does not know
    content: str
    add_special: Flag = False  # the BOS a prompt would begin with (none for Qwen)
    parse_special: Flag = True  # "<|im_start|>" in the text is the control token, not its characters
    with_pieces: Flag = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[Integer]


# Plain `def`: FastAPI runs them on its thread pool, so reading the vocabulary the first time
# (~0.2 s) and tokenizing a long text keep the event loop free.
@router.post("/tokenize")
def tokenize(request: Request, body: TokenizeRequest) -> dict:
    vocab = _vocabulary(request)
    ids = vocab.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(vocab.piece(t))} for t in ids]}


@router.post("/detokenize")
def detokenize(request: Request, body: DetokenizeRequest) -> dict:
    vocab = _vocabulary(request)
    bad = [t for t in body.tokens if not 0 <= t < vocab.n_vocab]
    if bad:
        raise oa.ApiError(400, f"token ids out of the vocabulary (0 to {vocab.n_vocab - 1}): {bad[:8]}", param="tokens")
    return {"content": b"".join(vocab.piece(t) for t in body.tokens).decode("utf-8", "replace")}


def _vocabulary(request: Request) -> Vocabulary:
    try:
        return daemon_of(request).vocabulary()
    except ModelError as e:  # the model file went away or changed since the daemon started
        raise oa.ApiError(503, str(e), type="server_error") from None


def _piece(raw: bytes) -> str | list[int]:
    """A piece as llama-server writes it: its text, or its bytes where it is part of a character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
