#!/usr/bin/env python3
"""What a KV state copy costs the prefix cache: PrefixCache.prepare through the real target, a
1,228-token history (a long chat, ~34 MiB of f16 cells for the 1.5B target) borrowed from another
stream (Slot.share_prefix), then saved before an unrelated prompt takes the slot, in a cache with
room for one such history (a full cache: each save evicts the other conversation, which takes
turns with it). In the cache's arena, touched first as the host's warm-up does, against a cache
whose every copy goes into a buffer the runtime maps anew (what a cache without its own memory
would do), interleaved in one process.

    .venv/bin/python scripts/kv_state_copy.py [--tokens 1228] [--rounds 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from homespec.llama.prefix_cache import PrefixCache
from homespec.llama.runtime import Runtime, RuntimeOptions, physical_cores

TARGET = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1228)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    rt = Runtime(TARGET, RuntimeOptions(n_ctx=4096, n_seq=3, n_threads=physical_cores(), kv_unified=False))
    history = [random.Random(0).randrange(100, 20000) for _ in range(args.tokens)]
    other = [t + 1 for t in history]  # another conversation as long
    rt.slot(1).eval(history, output="none")
    rt.slot(2).eval(other, output="none")
    saver = rt.slot(0)
    saver.share_prefix(rt.slot(1), len(history))
    room = saver.state_size() + 4 * len(history) + (1 << 20)  # bytes: one history and its tokens
    saver.truncate(0)
    caches = {"arena": PrefixCache(room), "fresh": PrefixCache(room)}
    print(f"arena of {room >> 20} MiB touched in {1e3 * caches['arena'].touch():.0f} ms")
    caches["fresh"]._alloc = lambda size: None  # type: ignore[method-assign]  # the runtime maps a buffer each time
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        conv, lender = ((history, rt.slot(1)), (other, rt.slot(2)))[r % 2]
        for name, cache in caches.items() if r % 2 else reversed(caches.items()):
            t0 = time.perf_counter()
            cache.prepare(saver, [*conv, 5], peers=[lender])  # borrowed from the other stream
            t1 = time.perf_counter()
            assert saver.tokens == conv
            cache.prepare(saver, [7, 8, 9])  # an unrelated prompt: the history is saved first
            t2 = time.perf_counter()
            assert len(cache) == 1
            saver.truncate(0)  # as the engine's sync would
            if r >= 2:  # both caches full
                times.setdefault((name, "share"), []).append(t1 - t0)
                times.setdefault((name, "save"), []).append(t2 - t1)
    n = args.rounds - 2
    for what, label in (("share", "borrowed from another stream"), ("save", "saved into a full cache")):
        a, f = statistics.median(times[("arena", what)]), statistics.median(times[("fresh", what)])
        print(f"{args.tokens} tokens {label}: in the arena {1e3 * a:.1f} ms, in new buffers {1e3 * f:.1f} ms "
              f"(medians of {n}, interleaved)")


if __name__ == "__main__":
    main()
