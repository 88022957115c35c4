#!/usr/bin/env python3
"""Time to first token of a cold ~550-token chat prompt (issue #15's bar): homespec's daemon
against llama-server (same llama.cpp, same model, context and threads, `plain`), both through
the OpenAI chat API with the `openai` client, streaming, client-side timing, prompts interleaved.

Cold: every prompt opens with a line of its own, so no cache holds any of it but the chat
template's system turn, which both servers keep from the request before (homespec's live KV
cache, llama-server's slot), as a home server would.

    .venv/bin/python scripts/cold_ttft.py [--config config.yaml] [--rounds 3] [--words 440] [--peer-arg=-fa --peer-arg=off]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_daemon import start, stop, write_config

from homespec.config import load_config
from homespec.llama.runtime import physical_cores
from homespec.models.fetch import resolve_model_path
from homespec.serving import peer_build
from homespec.serving.peer import LlamaServer, PeerSetting

# Prose of ordinary words (no repeats a tokenizer would fold): a household manual, as a voice
# assistant's retrieved context would be.
BODY = (
    "The heating system in this house runs on a heat pump in the garage. In winter the pump keeps the "
    "floors at twenty degrees during the day and eighteen at night. The thermostat in the hallway "
    "overrides the schedule for two hours when its dial is turned. The filter behind the grille "
    "next to the washing machine should be cleaned every three months; a blinking orange light on "
    "the pump means the filter is clogged or the outdoor unit is iced. Defrosting takes twenty "
    "minutes and needs nothing from you. The solar panels on the south roof feed the battery in the "
    "cellar first, then the car charger, then the grid. When the battery is below ten percent the "
    "dishwasher and the dryer wait for cheaper night power unless you press start twice. "
)


def prompt(words: int) -> list[dict]:
    text = " ".join((BODY * 20).split()[:words])
    first = f"Note {uuid.uuid4().hex[:8]}: answer from the text below only."
    return [{"role": "user", "content": f"{first}\n\n{text}\n\nWhen does the dishwasher wait for night power?"}]


def ttft(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[float, int]:
    """(seconds to the first content chunk, prompt tokens)."""
    t0 = time.perf_counter()
    first, prompt_tokens = None, 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    assert first is not None, "no content came back"
    return first, prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("config.yaml"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--words", type=int, default=440, help="words of context (~550 prompt tokens at 440)")
    ap.add_argument("--peer-bin", type=Path, default=None, help="this llama-server (default: build or find the cached one)")
    ap.add_argument("--peer-arg", action="append", default=[],
                    help="one more llama-server argument (repeat it: --peer-arg=-fa --peer-arg=off)")
    args = ap.parse_args()
    config = write_config(args.config, {}, Path(tempfile.mkdtemp(prefix="homespec-ttft-")) / "config.yaml")
    cfg = load_config(config)
    binary = args.peer_bin or peer_build.build()
    with LlamaServer(binary, resolve_model_path(cfg, cfg.models.target), PeerSetting("ls plain", tuple(args.peer_arg)), cfg.runtime.n_ctx,
                     cfg.runtime.n_threads or physical_cores()) as server:
        proc, url, _ = start(config)
        try:
            clients = {
                "homespec": (openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600), "homespec"),
                # No keep-alive: llama-server drops a connection idle for 5 s (homespec's turn is longer).
                "llama-server": (openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600,
                                               http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))),
                                 "peer"),
            }
            for client, model in clients.values():  # warm: the system turn cached, first-request costs paid
                ttft(client, model, prompt(args.words))
            got: dict[str, list[float]] = {name: [] for name in clients}
            for r in range(args.rounds):
                for name, (client, model) in (clients.items() if r % 2 == 0 else reversed(clients.items())):
                    s, n = ttft(client, model, prompt(args.words))
                    got[name].append(s)
                    print(f"round {r + 1}: {name:12s} TTFT {s:.2f} s ({n} prompt tokens)", flush=True)
            med = {name: statistics.median(v) for name, v in got.items()}
            print(f"cold TTFT, median of {args.rounds}: homespec {med['homespec']:.2f} s, llama-server "
                  f"{med['llama-server']:.2f} s: homespec / llama-server = {med['homespec'] / med['llama-server']:.2f}x")
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
