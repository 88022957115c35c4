#!/usr/bin/env python3
"""Measure prefix reuse end to end: a three-turn chat through the `openai` client whose history
grows past 800 tokens, against the daemon with runtime.prefix_reuse on and off (same run,
same machine). Prints TTFT per turn and the ratio.

    .venv/bin/python scripts/prefix_chat_ttft.py [--config config.yaml]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from local_daemon import start, stop, write_config
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = (
    "You are the assistant of a home server. You know its services: Home Assistant on port 8123, "
    "a Jellyfin media server, Nextcloud for files, Pi-hole for DNS, a Mosquitto MQTT broker, "
    "Zigbee2MQTT for the sensors, Frigate for the cameras, and nightly restic backups to a NAS. "
) * 8
QUESTIONS = [
    "Which of these services would you restart first if the lights stop responding, and why?",
    "Write a short shell script that checks that each of those services is running.",
    "Now make the script send an MQTT message when something is down.",
]


def chat_turns(url: str, max_tokens: int) -> list[tuple[float, int, int]]:
    client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("HOMESPEC_API_KEY", "none"))
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        t0 = time.perf_counter()
        ttft, text, usage = None, [], None
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        messages.append({"role": "assistant", "content": "".join(text)})
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        out.append((ttft or float("nan"), usage.prompt_tokens if usage else 0, cached))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for reuse in (True, False):
            # speculation off: this measures prefill, not speculation
            overrides = {"runtime": {"prefix_reuse": reuse}, "speculation": {"mode": "off"}}
            config = write_config(args.config.resolve(), overrides, Path(tmp) / f"config-{reuse}.yaml")
            proc, url, _ = start(config)
            try:
                results[reuse] = chat_turns(url, args.max_tokens)
            finally:
                stop(proc)
    print(f"{'turn':>4} {'prompt tok':>10} {'cached':>7} {'TTFT reuse on':>14} {'TTFT off':>9} {'ratio':>6}")
    for i, ((t_on, n, cached), (t_off, _, _)) in enumerate(zip(results[True], results[False]), start=1):
        print(f"{i:>4} {n:>10} {cached:>7} {t_on:>12.2f} s {t_off:>7.2f} s {t_on / t_off:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
