"""A conversation with tool calls through /api/chat, with the official `ollama` client, against a
running daemon (`homespec serve --port 11434`). Prints Ollama's stats as the client returns them,
and homespec's speculative figures for the first request (sent again over raw HTTP: the client
drops fields Ollama's schema lacks).

    .venv/bin/python scripts/ollama_tool_demo.py [URL]
"""

from __future__ import annotations

import json
import sys

import httpx
import ollama

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:11434"
c = ollama.Client(host=URL, timeout=600)
model = c.list().models[0].model
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "set_light", "description": "Switch a light in a room of the house.",
     "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}}, "required": ["room", "on"]}}},
]
def stats(r):
    return (f"done_reason={r.done_reason} prompt_eval_count={r.prompt_eval_count} "
            f"({r.prompt_eval_count / (r.prompt_eval_duration / 1e9):.1f} tok/s) eval_count={r.eval_count} "
            f"({r.eval_count / (r.eval_duration / 1e9):.2f} tok/s) total={r.total_duration / 1e9:.2f} s")

msgs = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
print("user     :", msgs[-1]["content"])
r = c.chat(model, messages=msgs, tools=tools, options={"temperature": 0})
print("assistant:", [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls or []] or repr(r.message.content))
print("   stats :", stats(r))
# The tools as the client sends them (its pydantic models reorder keys), so the prompt is the same.
sent = [ollama._types.Tool.model_validate(t).model_dump(exclude_none=True) for t in tools]
raw = httpx.post(f"{URL}/api/chat", json={"model": model, "messages": msgs, "tools": sent, "stream": False, "options": {"temperature": 0}}, timeout=600).json()
print("   homespec (same request again, raw HTTP):", json.dumps({k: raw["homespec"][k] for k in ("mode", "proposers", "proposed", "accepted", "acceptance_length", "cached_tokens")}))
msgs += [{"role": "assistant", "tool_calls": [{"function": {"name": t.function.name, "arguments": dict(t.function.arguments)}} for t in r.message.tool_calls]},
         {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature_c": 31, "sky": "clear"})}]
print("tool     :", msgs[-1]["content"])
r = c.chat(model, messages=msgs, options={"temperature": 0, "num_predict": 60})
print("assistant:", repr(r.message.content))
print("   stats :", stats(r))
msgs += [{"role": "assistant", "content": r.message.content}, {"role": "user", "content": "Thanks. Now switch on the kitchen light."}]
print("user     :", msgs[-1]["content"])
parts = list(c.chat(model, messages=msgs, tools=tools, options={"temperature": 0}, stream=True))
calls = [t for p in parts for t in (p.message.tool_calls or [])]
print(f"assistant (streamed, {len(parts)} lines):", [(t.function.name, dict(t.function.arguments)) for t in calls] or repr("".join(p.message.content for p in parts)))
print("   stats :", stats(parts[-1]))
