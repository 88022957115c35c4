#!/usr/bin/env python3
"""An editor's autocomplete while you type: a burst of keystrokes, each firing a fill-in-the-middle
request and abandoning the one before (the client hangs up after `--abandon-ms`, as editors
cancel a stale completion), then the last keystroke's request read to its end. Reports that last
request's time to first token, against the same request on an idle daemon.

Every request is `POST /v1/completions` with a `suffix` at the end of a ~400-token Python file,
streamed through httpx; each keystroke adds a new name, so its last tokens are new.

    .venv/bin/python scripts/typing_burst.py [--config config.yaml] [--bursts 6] [--keys 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_daemon import start, stop, write_config

FILE = "".join(f"def function_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40))
SUFFIX = "\n\nprint(done)\n"


def first_token(url: str, prefix: str, abandon_s: float | None = None) -> float | None:
    """Seconds to the first streamed piece; with abandon_s, None: the client reads until then
    (each read waits at most that long) and hangs up."""
    body = {"prompt": prefix, "suffix": SUFFIX, "max_tokens": 24, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    timeout = httpx.Timeout(abandon_s or 300, connect=10)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if abandon_s is not None:
                    if time.perf_counter() - t0 >= abandon_s:
                        return None  # the next keystroke came: hang up
                elif line.startswith("data: {"):
                    return time.perf_counter() - t0
    except httpx.TimeoutException:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("config.yaml"))
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--keys", type=int, default=6, help="abandoned requests per burst before the last one")
    ap.add_argument("--abandon-ms", type=float, default=150, help="also the time between keystrokes")
    args = ap.parse_args()
    config = write_config(args.config, {}, Path(tempfile.mkdtemp(prefix="homespec-typing-")) / "config.yaml")
    proc, url, _ = start(config)
    try:
        first_token(url, FILE + "def warm(y):\n    ")  # the file read once, as an open editor has
        gap = args.abandon_ms / 1000
        last: list[float] = []
        for b in range(args.bursts):
            typed = [threading.Thread(target=first_token, args=(url, FILE + f"def typed_{b}_{i}(y):\n    ", gap))
                     for i in range(args.keys)]
            for t in typed:
                t.start()
                time.sleep(gap)
            s = first_token(url, FILE + f"def typed_{b}_last(y):\n    ")
            assert s is not None, "the last request streamed nothing"
            last.append(s)
            for t in typed:
                t.join()
            time.sleep(1.0)  # the editor idles; the burst's requests are gone
        idle = [first_token(url, FILE + f"def idle_{i}(y):\n    ") or float("nan") for i in range(4)]
        print(f"last keystroke's first token after a burst: {', '.join(f'{s:.2f}' for s in last)} s, "
              f"median {statistics.median(last):.2f} s; idle: {', '.join(f'{s:.2f}' for s in idle)} s")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
