#!/usr/bin/env python3
"""Home Assistant voice commands, shaped as current HA core builds them, against homespec and
llama-server (same llama.cpp, model, context and threads, `plain`, `--jinja` for its tool calls).

The request: HA's default instructions, then the Assist API's prompt (how to call the intent
tools, then the exposed entities as YAML, without their states), and the Assist tools. The
Assist API brings a `GetDateTime` tool, so HA adds no time line (`conversation/chat_log.py`,
`helpers/llm.py` in home-assistant/core). Each command is a new conversation; homespec is
asked through the `ollama` client as HA's Ollama integration asks, llama-server through the
`openai` client. With --answers, homespec is also sent each call's result, as HA sends it back
for the spoken answer.

    .venv/bin/python scripts/ha_voice.py [--config config.yaml] [--lights 40] [--answers] [--no-peer]
                                         [--state-dir DIR]

Run twice with the same --state-dir to see the commands after a restart (the prefix cache kept
on disk, memory.prefix_cache_persist).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ollama
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_daemon import start, stop, write_config

from homespec.config import load_config
from homespec.llama.runtime import physical_cores
from homespec.models.fetch import resolve_model_path
from homespec.serving import peer_build
from homespec.serving.peer import LlamaServer, PeerSetting

AREAS = ["Kitchen", "Hall", "Bedroom", "Bathroom", "Office", "Living Room"]
KINDS = ["Ceiling Light", "Lamp", "Spots", "Strip", "Pendant", "Wall Light", "Reading Light"]
COMMANDS = ["Turn on the kitchen ceiling light", "Turn off the hall lamp", "Set the office spots to 40 percent",
            "Turn on the bedroom pendant"]

# HA's texts (DEFAULT_INSTRUCTIONS_PROMPT, DEVICE_CONTROL_TOOL_USAGE_PROMPT, the area and timer
# lines, DYNAMIC_CONTEXT_PROMPT), shortened where only their length matters.
INSTRUCTIONS = ("You are a voice assistant for Home Assistant.\nAnswer questions about the world truthfully.\n"
                "Answer in plain text. Keep it simple and to the point.\n")
API_PROMPT = (
    "When controlling Home Assistant always call the intent tools. Use HassTurnOn to lock and HassTurnOff to unlock "
    "a lock. When controlling a device, prefer passing just name and domain. When controlling an area, prefer passing "
    "just area name and domain.\n"
    "When a request names a generic device without an area, treat it as the user's current area and call "
    "`GetCurrentLocation` to resolve it before targeting.\n"
    "This device is not able to start timers.\n"
    "You ARE equipped to answer questions about the current state of\nthe home using the `GetLiveContext` tool. This "
    "is a primary function. Do not state you lack the\nfunctionality if the question requires live data.\n"
    "Static Context: An overview of the areas and the devices in this smart home:\n"
)
_TARGET = {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                            "floor": {"type": "string"}, "domain": {"type": "array", "items": {"type": "string"}}}}
_NONE = {"type": "object", "properties": {}}
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}} for n, d, p in [
    ("HassTurnOn", "Turns on/opens/presses a device or entity. For locks, this performs a 'lock' action.", _TARGET),
    ("HassTurnOff", "Turns off/closes a device or entity. For locks, this performs an 'unlock' action.", _TARGET),
    ("HassLightSet", "Sets the brightness percentage or color of a light",
     {**_TARGET, "properties": {**_TARGET["properties"], "brightness": {"type": "integer"}}}),
    ("GetDateTime", "Provides the current date and time.", _NONE),
    ("GetLiveContext", "Provides real-time information about the CURRENT state, value, or mode of devices, sensors, "
                       "entities, or areas.", _NONE),
]]


def system_prompt(lights: int) -> str:
    entities = "".join(f"- names: {AREAS[i % 6]} {KINDS[i % 7]}\n  domain: light\n  areas: {AREAS[i % 6]}\n"
                       for i in range(lights))
    return INSTRUCTIONS + "\n" + API_PROMPT + entities


def tool_result(name: str) -> str:
    """What HA's intent tool returns for a device it switched (IntentResponseDict, trimmed)."""
    return json.dumps({"speech": {}, "response_type": "action_done",
                       "data": {"targets": [], "success": [{"name": name, "type": "entity"}], "failed": []}})


def ask_homespec(url: str, system: str, answers: bool) -> None:
    client = ollama.Client(host=url, timeout=600)

    def chat(messages: list[dict]) -> tuple[ollama.ChatResponse, float, dict]:
        t0 = time.perf_counter()
        r = client.chat(model="homespec", messages=messages, tools=TOOLS, options={"temperature": 0}, keep_alive=-1)
        seconds = time.perf_counter() - t0
        return r, seconds, httpx.get(url + "/v1/homespec/stats", timeout=30).json()["requests"][0]

    for q in COMMANDS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        r, s, rec = chat(messages)
        calls = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []]
        print(f"homespec      {q!r}: {s:.2f} s, {rec['prompt_tokens']} prompt tokens, {rec['cached_tokens']} from "
              f"the cache; calls {calls}; text {r.message.content!r:.60}", flush=True)
        if answers and calls:
            name, args = calls[0]
            messages += [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name, "arguments": args}}]},
                         {"role": "tool", "content": tool_result(str(args.get("name")))}]
            r, s, rec = chat(messages)
            print(f"  its answer: {s:.2f} s, {rec['prompt_tokens']} prompt tokens, {rec['cached_tokens']} from the "
                  f"cache, {rec['completion_tokens']} tokens: {r.message.content!r}", flush=True)


def ask_peer(url: str, system: str) -> None:
    # No keep-alive: llama-server drops a connection idle for 5 s.
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600,
                           http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)))
    for q in COMMANDS:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="peer", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           tools=TOOLS, temperature=0, max_tokens=80)
        s = time.perf_counter() - t0
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens if u and u.prompt_tokens_details else None
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
        print(f"llama-server  {q!r}: {s:.2f} s, {u.prompt_tokens if u else '?'} prompt tokens, {cached} from the cache; "
              f"calls {calls}; text {r.choices[0].message.content!r:.60}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("config.yaml"))
    ap.add_argument("--lights", type=int, default=40, help="exposed lights in the prompt")
    ap.add_argument("--answers", action="store_true", help="send homespec each call's result for the spoken answer")
    ap.add_argument("--no-peer", action="store_true", help="homespec only")
    ap.add_argument("--peer-bin", type=Path, default=None, help="this llama-server (default: build or find the cached one)")
    ap.add_argument("--state-dir", type=Path, default=None,
                    help="homespec's state folder; the same one in two runs shows a restart (default: a new one)")
    args = ap.parse_args()
    system = system_prompt(args.lights)
    config = write_config(args.config, {}, Path(tempfile.mkdtemp(prefix="homespec-ha-")) / "config.yaml")
    cfg = load_config(config)
    proc, url, _ = start(config, state_dir=args.state_dir)
    try:
        ask_homespec(url, system, args.answers)
    finally:
        stop(proc)
    if args.no_peer:
        return
    with LlamaServer(args.peer_bin or peer_build.build(), resolve_model_path(cfg, cfg.models.target), PeerSetting("ls plain"),
                     cfg.runtime.n_ctx, cfg.runtime.n_threads or physical_cores(), extra=["--jinja"]) as server:
        ask_peer(server.url, system)


if __name__ == "__main__":
    main()
