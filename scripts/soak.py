#!/usr/bin/env python3
"""Soak the daemon as a bad day on a home server would (issue #12's bar): 8 clients x 25 chat
requests, streaming or not, a third of them hanging up early, while 1,100 sockets send half a
request header and stall (reopened when the daemon closes them). Everything stays on 127.0.0.1
and is bounded in count and time.

Reports: outcomes by status (anything but 200, 429 and 503 is a failure), /health polled every
0.5 s (failures and slowest answer), and the daemon's RSS over the run. Every answer read to the
end has its usage checked against the same prompt asked alone before the soak (greedy, so the
same text): prompt tokens always equal, completion tokens equal when the text is the same (it
may differ at a near-tie under batching), total = prompt + completion. A mismatch is a failure.

    .venv/bin/python scripts/soak.py [--config config.yaml] [--clients 8] [--requests 25] [--stalled 1100]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_daemon import start, stop, write_config

PROMPTS = [
    "Name three uses of a Raspberry Pi at home.",
    "Write a Python function that reverses a string.",
    "What is a reverse proxy? One sentence.",
    "Rename foo to bar in: def foo(x): return foo(x - 1) if x else 0",
    "List the planets of the solar system.",
]
SOAK_LIMIT_S = 1800  # hard bound on the whole run


MAX_TOKENS = 16


def answer(http: httpx.Client, prompt: str, stream: bool) -> tuple[int, str, dict | None]:
    """Status, text and usage of one request read to the end."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "stream": stream}
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        data = r.json() if r.status_code == 200 else {}
        return r.status_code, data.get("choices", [{}])[0].get("message", {}).get("content") or "", data.get("usage")
    text, usage = "", None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
                usage = chunk.get("usage") or usage
        return r.status_code, text, usage


def usage_problem(usage: dict | None, text: str, ref: tuple[str, dict]) -> str | None:
    """Why this answer's usage is wrong, or None (the module docstring's rule)."""
    ref_text, ref_usage = ref
    if usage is None:
        return "no usage"
    if usage["prompt_tokens"] != ref_usage["prompt_tokens"]:
        return f"prompt_tokens {usage['prompt_tokens']} != {ref_usage['prompt_tokens']}"
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return "total != prompt + completion"
    if not 1 <= usage["completion_tokens"] <= MAX_TOKENS:
        return f"completion_tokens {usage['completion_tokens']}"
    if text == ref_text and usage["completion_tokens"] != ref_usage["completion_tokens"]:
        return f"completion_tokens {usage['completion_tokens']} != {ref_usage['completion_tokens']} for the same text"
    return None


def client(url: str, n: int, seed: int, outcomes: Counter, lock: threading.Lock, refs: dict, usage: Counter) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as http:
        for _ in range(n):
            prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "stream": stream}
            hang_up = rng.random() < 1 / 3
            checked = None
            try:
                if hang_up and stream:
                    with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        status = r.status_code
                        for i, _line in enumerate(r.iter_lines()):
                            if i >= 1:
                                break  # leaving the with-block closes the connection mid-stream
                elif hang_up:  # give up on waiting: the client goes away before the answer
                    try:
                        http.post("/v1/chat/completions", json=body, timeout=0.5)
                        status = 200
                    except httpx.TimeoutException:
                        status = "hung-up"
                else:
                    status, text, got = answer(http, prompt, stream)
                    if status == 200:
                        checked = usage_problem(got, text, refs[prompt]) or "exact"
            except httpx.HTTPError as e:
                status = f"error {type(e).__name__}"
            with lock:
                outcomes[status] += 1
                if checked is not None:
                    usage[checked] += 1


def stall(port: int, count: int, stop_at: float, opened: Counter) -> None:
    """Hold `count` half-sent requests open; reopen each one the daemon closes, at most once a second."""
    socks: list[tuple[socket.socket | None, float]] = [(None, 0.0)] * count
    while time.monotonic() < stop_at:
        for i, (s, since) in enumerate(socks):
            alive = s is not None
            if alive:
                s.setblocking(False)
                try:
                    alive = s.recv(1, socket.MSG_PEEK) != b""
                except BlockingIOError:
                    pass  # nothing to read: still open
                except OSError:
                    alive = False
            if not alive and time.monotonic() - since >= 1.0:
                if s is not None:
                    s.close()
                    opened["closed by daemon"] += 1
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=2)
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
                    opened["opened"] += 1
                except OSError:
                    s = None
                    opened["refused"] += 1
                socks[i] = (s, time.monotonic())
        time.sleep(0.2)
    for s, _ in socks:
        if s is not None:
            s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("config.yaml"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--stalled", type=int, default=1100)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="homespec-soak-"))
    proc, url, ready_s = start(write_config(args.config, {}, tmp / "config.yaml"))
    port = int(url.rsplit(":", 1)[1])
    daemon = psutil.Process(proc.pid)
    print(f"daemon ready in {ready_s:.0f} s at {url}", file=sys.stderr)
    with httpx.Client(base_url=url, timeout=600) as http:  # each prompt alone: the usage to expect
        refs = {p: answer(http, p, stream=False)[1:] for p in PROMPTS}
    usage: Counter = Counter()
    t0 = time.monotonic()
    deadline = t0 + SOAK_LIMIT_S
    outcomes: Counter = Counter()
    sockets: Counter = Counter()
    health: list[float | str] = []
    rss: list[float] = [daemon.memory_info().rss / 2**20]
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set() and time.monotonic() < deadline:
            t = time.monotonic()
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                health.append(time.monotonic() - t if r.status_code == 200 else f"status {r.status_code}")
            except httpx.HTTPError as e:
                health.append(type(e).__name__)
            rss.append(daemon.memory_info().rss / 2**20)
            time.sleep(0.5)

    lock = threading.Lock()
    staller = threading.Thread(target=stall, args=(port, args.stalled, deadline, sockets), daemon=True)
    staller.start()
    time.sleep(3)  # let the stalled sockets pile up first
    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    clients = [threading.Thread(target=client, args=(url, args.requests, i, outcomes, lock, refs, usage)) for i in range(args.clients)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(max(1.0, deadline - time.monotonic()))
    done.set()
    poller.join(10)
    elapsed = time.monotonic() - t0
    rss_end = daemon.memory_info().rss / 2**20
    stop(proc)

    ok = {200, 429, 503, "hung-up"}
    failures = sum(n for s, n in outcomes.items() if s not in ok) + sum(n for s, n in usage.items() if s != "exact")
    times = [h for h in health if isinstance(h, float)]
    health_fail = [h for h in health if not isinstance(h, float)]
    print(f"soak: {args.clients} clients x {args.requests} requests in {elapsed:.0f} s, {args.stalled} stalled sockets alongside")
    print(f"  outcomes: {dict(outcomes)}  -> failures (not 200/429/503/hung-up, or usage wrong): {failures}")
    print(f"  usage of the answers read to the end: {dict(usage)}")
    print(f"  stalled sockets: {dict(sockets)}")
    print(f"  /health: {len(times)} answered, slowest {max(times, default=0):.2f} s; failed: {len(health_fail)} {Counter(health_fail)}")
    print(f"  daemon RSS MiB: after warm-up {rss[0]:.0f}, max {max(rss):.0f}, end {rss_end:.0f}")
    return 1 if failures or health_fail else 0


if __name__ == "__main__":
    sys.exit(main())
