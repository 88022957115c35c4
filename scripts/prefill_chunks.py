#!/usr/bin/env python3
"""How fast the target reads a prompt in chunks of different sizes (server.prefill_chunk): the
same tokens after a 27-token cached prefix (a chat template's system turn), read in passes of
each size in turn, interleaved in one process, medians.

    .venv/bin/python scripts/prefill_chunks.py [--tokens 513] [--chunks 64,128,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from homespec.llama.runtime import Runtime, RuntimeOptions, Slot, physical_cores

TARGET = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PREFIX = 27  # tokens already cached


def read(slot: Slot, tokens: list[int], chunk: int) -> float:
    """Seconds to read tokens[PREFIX:] in passes of `chunk` tokens, logits of the last only."""
    slot.truncate(PREFIX)
    t0 = time.perf_counter()
    for a in range(PREFIX, len(tokens), chunk):
        slot.eval(tokens[a : a + chunk], "last" if a + chunk >= len(tokens) else "none")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=513, help="prompt tokens read (after the cached prefix)")
    ap.add_argument("--chunks", default="64,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    # n_seq 4, a stream each: the daemon's default (server.parallel 4); n_batch fits the largest chunk.
    rt = Runtime(TARGET, RuntimeOptions(n_ctx=4096, n_seq=4, n_batch=max(512, *chunks), n_threads=physical_cores()))
    rng = random.Random(0)
    tokens = [rng.randrange(100, 20000) for _ in range(PREFIX + args.tokens)]
    slot = rt.slot(1)
    slot.eval(tokens[:PREFIX], "none")
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for r in range(args.rounds):
        for c in chunks if r % 2 == 0 else reversed(chunks):
            times[c].append(read(slot, tokens, c))
    for c in chunks:
        m = statistics.median(times[c])
        print(f"chunks of {c:4d}: {args.tokens / m:6.1f} tok/s (median of {args.rounds}: {m:.2f} s; "
              f"runs {', '.join(f'{t:.2f}' for t in times[c])})")
    rt.close()


if __name__ == "__main__":
    main()
