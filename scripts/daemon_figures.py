#!/usr/bin/env python3
"""The daemon's start-up and serving figures: cold load + warm-up time, warm TTFT for a
~100-token prompt, RSS with the models loaded, and the speculative counters moving in /metrics.

    .venv/bin/python scripts/daemon_figures.py [--config config.yaml] [--drop-caches]

--drop-caches (root) empties the page cache first, so the load reads the weights from disk.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from local_daemon import start, stop, write_config
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
# ~100 tokens with the chat template around it.
PROMPT = (
    "I keep my home server's configuration in a git repository. Every service has a folder with a "
    "docker-compose file and an .env file. Write a short Python script that walks the repository, "
    "finds every docker-compose.yml, and prints the services it defines with their image names, "
    "sorted by folder. Keep it under forty lines and use only the standard library plus PyYAML."
)
COUNTERS = ("homespec_spec_decode_num_draft_tokens_total", "homespec_spec_decode_num_accepted_tokens_total",
            "homespec_generation_tokens_total")


def counters(url: str) -> dict[str, float]:
    """Sums over labels of the speculative counters in /metrics."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--runs", type=int, default=3, help="TTFT measurements (median reported)")
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before loading (root)")
    args = ap.parse_args()
    if args.drop_caches:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(args.config.resolve(), {}, Path(tmp) / "config.yaml")
        proc, url, ready_s = start(config)
        try:
            stats = httpx.get(f"{url}/v1/homespec/stats", timeout=10).json()
            print(f"process start -> /ready: {ready_s:.1f} s (load {stats.get('load_s') or 0:.1f} s, "
                  f"warm-up {stats.get('warmup_s') or 0:.1f} s)")
            client = OpenAI(base_url=f"{url}/v1", api_key="none")
            model = client.models.list().data[0].id
            before = counters(url)
            ttfts, prompt_tokens = [], 0
            for i in range(args.runs):
                # A different opening each run: only the template's header can come from the
                # prefix cache, as for a new question from a home app.
                text = f"Question {i + 1} of the day. {PROMPT}"
                t0 = time.perf_counter()
                ttft = None
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": text}], max_tokens=64, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                        ttft = time.perf_counter() - t0
                    if chunk.usage:
                        prompt_tokens = chunk.usage.prompt_tokens
                ttfts.append(ttft or float("nan"))
            after = counters(url)
            rss = psutil.Process(proc.pid).memory_info().rss / 2**20
            models = stats.get("models", {})
            print(f"warm TTFT, {prompt_tokens}-token prompt: median {statistics.median(ttfts):.2f} s "
                  f"({', '.join(f'{t:.2f}' for t in ttfts)})")
            loaded = [f"{role} {m['name']}" for role, m in models.items() if isinstance(m, dict) and m.get("name")]
            print(f"daemon RSS: {rss:.0f} MiB with {', '.join(loaded)}")
            for name in COUNTERS:
                print(f"  {name}: {before[name]:.0f} -> {after[name]:.0f}")
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
