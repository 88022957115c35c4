#!/usr/bin/env python3
"""What flash attention costs or saves on this CPU (runtime.flash_attn): the target's prefill
and its passes of one and more rows (a decode step; verify passes, k = rows - 1: 5 by default,
17 and 49 for the long drafts of copies) over histories of several lengths, with it off and on.
Each setting runs in a process of its own (it is fixed per context), the processes alternate,
and each starts as the daemon does (huge pages where `homespec serve` asks for them).

    .venv/bin/python scripts/flash_attn_cost.py [--rounds 2] [--depths 300,1000,2000,3000] [--rows 1,5,17,49]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from homespec.llama.hugepages import environ_with_huge_pages
from homespec.llama.runtime import Runtime, RuntimeOptions, Slot, physical_cores

TARGET = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PREFILL = 512  # tokens read, in 128-token chunks (server.prefill_chunk)


def pass_ms(slot: Slot, rows: int, repeats: int) -> float:
    """Median ms of a pass of `rows` tokens with every row's logits (as a verify pass), rolled back."""
    base = len(slot.tokens)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        slot.eval([13] * rows, "all")
        times.append(time.perf_counter() - t0)
        slot.truncate(base)
    return statistics.median(times) * 1e3


def measure(flash_attn: bool, depths: list[int], rows: list[int]) -> dict:
    """One setting, in this process: prefill tok/s, and ms per pass of each of `rows` per depth."""
    rt = Runtime(TARGET, RuntimeOptions(n_ctx=4096, n_seq=4, n_threads=physical_cores(), flash_attn=flash_attn))
    rng = random.Random(0)
    tokens = [rng.randrange(100, 20000) for _ in range(max(depths + [PREFILL]))]
    slot = rt.slot(0)
    slot.eval(tokens[:8], "last")  # the first pass faults the weights in
    slot.reset()
    t0 = time.perf_counter()
    for a in range(0, PREFILL, 128):
        slot.eval(tokens[a : a + 128], "last" if a + 128 >= PREFILL else "none")
    out: dict = {"prefill": PREFILL / (time.perf_counter() - t0), "passes": {}}
    for d in depths:
        slot.reset()
        for a in range(0, d, 128):
            slot.eval(tokens[a : min(a + 128, d)], "none")
        out["passes"][d] = [pass_ms(slot, n, 15 if n == 1 else 7) for n in rows]
    rt.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--depths", default="300,1000,2000,3000", help="history lengths, tokens")
    ap.add_argument("--rows", default="1,5", help="pass sizes, tokens")
    ap.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # (a child: one setting)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rows = [int(n) for n in args.rows.split(",")]
    if args.one:
        print(json.dumps(measure(args.one == "on", depths, rows)))
        return
    env = environ_with_huge_pages() or dict(os.environ)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for setting in ("off", "on") if r % 2 == 0 else ("on", "off"):
            child = subprocess.run([sys.executable, __file__, "--one", setting, "--depths", args.depths, "--rows", args.rows],
                                   env=env, capture_output=True, text=True, check=True)
            runs[setting].append(json.loads(child.stdout.splitlines()[-1]))
    for setting, got in runs.items():
        prefill = statistics.median(g["prefill"] for g in got)
        cells = []
        for d in depths:
            ms = [statistics.median(g["passes"][str(d)][i] for g in got) for i in range(len(rows))]
            cells.append(f"{d}: " + " / ".join(f"{m:.1f}" for m in ms))
        print(f"flash attention {setting:3s}: prefill {prefill:5.1f} tok/s | ms per pass of {' / '.join(map(str, rows))} rows after "
              f"a history of " + " | ".join(cells) + f"  (medians of {len(got)} processes)")


if __name__ == "__main__":
    main()
