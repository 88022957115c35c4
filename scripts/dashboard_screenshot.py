#!/usr/bin/env python3
"""Screenshot the dashboard against a running daemon while a client streams from it.

    .venv/bin/python scripts/dashboard_screenshot.py --url http://127.0.0.1:8321 --out docs/dashboard.svg

Drives the real app headless at 100x30 (Textual's pilot), streams a few chat answers through the
`openai` client in a thread meanwhile, counts how often new stats reached the app, and saves the
screen as SVG at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

from openai import OpenAI

from homespec.dashboard.app import DashboardApp

PROMPTS = [
    "Rename the function `load` to `read_config` in this code and output the whole code:\n\n```python\n"
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def main():\n    cfg = load('config.json')\n    print(cfg['name'])\n    print(cfg['port'])\n```",
    "Explain in three sentences what a reverse proxy does.",
]


def stream_forever(url: str, stop: threading.Event) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id
    i = 0
    while not stop.is_set():
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=160, stream=True
        )
        for _ in stream:
            if stop.is_set():
                stream.close()
                break
        i += 1


async def main(url: str, out: Path, seconds: float) -> None:
    app = DashboardApp(url)
    updates: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(target=stream_forever, args=(url, stop), daemon=True)
    async with app.run_test(size=(100, 30)) as pilot:
        app.watch(app, "stats", lambda _: updates.append(time.monotonic()), init=False)
        streamer.start()
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            await pilot.pause(0.2)
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))
    stop.set()
    gaps = [b - a for a, b in zip(updates, updates[1:])]
    print(f"{len(updates)} stats updates in {seconds:.0f} s; longest gap {max(gaps, default=0):.2f} s; saved {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8321")
    ap.add_argument("--out", type=Path, default=Path("docs/dashboard.svg"))
    ap.add_argument("--seconds", type=float, default=45)
    args = ap.parse_args()
    asyncio.run(main(args.url, args.out, args.seconds))
