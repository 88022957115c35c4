#!/usr/bin/env python3
"""What a KV state copy costs the prefix cache: PrefixCache.prepare through the real target,
a 1,228-token history (a long chat, ~34 MiB of f16 cells for the 1.5B target) borrowed from
another stream (Slot.share_prefix) and saved before an unrelated prompt takes the slot, with
the cache's spare buffers and without them (SPARE_BUFFERS = 0), interleaved in one process;
then a history saved into a cache already full of others, into the buffer of the history it
evicts and into a fresh one.

    .venv/bin/python scripts/kv_state_copy.py [--tokens 1228] [--rounds 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import homespec.llama.prefix_cache as pc
from homespec.llama.runtime import Runtime, RuntimeOptions, physical_cores

TARGET = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1228)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    rt = Runtime(TARGET, RuntimeOptions(n_ctx=4096, n_seq=3, n_threads=physical_cores(), kv_unified=False))
    history = [random.Random(0).randrange(100, 20000) for _ in range(args.tokens)]
    borrower, lender = rt.slot(0), rt.slot(1)
    lender.eval(history, output="none")
    caches = {n: pc.PrefixCache(512 << 20) for n in (0, pc.SPARE_BUFFERS)}
    spares = pc.SPARE_BUFFERS
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for n, cache in (caches.items() if r % 2 else reversed(caches.items())):
            pc.SPARE_BUFFERS = n
            t0 = time.perf_counter()
            cache.prepare(borrower, [*history, 5], peers=[lender])  # borrowed from the other stream
            t1 = time.perf_counter()
            assert borrower.tokens == history
            cache.prepare(borrower, [7, 8, 9])  # an unrelated prompt: the history is saved first
            t2 = time.perf_counter()
            borrower.truncate(0)  # as the engine's sync would
            if r:  # the first round fills the spares
                times.setdefault((n, "share"), []).append(t1 - t0)
                times.setdefault((n, "save"), []).append(t2 - t1)
    for what, label in (("share", "borrowed from another stream"), ("save", "saved before a new prompt")):
        a, b = statistics.median(times[(0, what)]), statistics.median(times[(spares, what)])
        print(f"{args.tokens} tokens {label}: without spare buffers {1e3 * a:.1f} ms, with {1e3 * b:.1f} ms "
              f"(medians of {args.rounds - 1}, interleaved)")

    pc.SPARE_BUFFERS = spares
    full_cache(rt, history, args.rounds)


def full_cache(rt: Runtime, history: list[int], rounds: int) -> None:
    """A save into a cache already full of other histories (a daemon's steady state): into the
    buffer of the history it evicts, against a fresh buffer (the eviction after the save freeing
    the old one), as before PrefixCache._buffer_for. Two conversations take turns, each evicting
    the other from a cache with room for one."""
    other = [t + 1 for t in history]  # another conversation as long
    rt.slot(2).eval(other, output="none")
    lenders = {tuple(history): rt.slot(1), tuple(other): rt.slot(2)}
    saver = rt.slot(0)
    caches = {}
    for name in ("fresh", "evicted"):
        saver.reset()
        saver.share_prefix(rt.slot(1), len(history))
        room = saver.state_size() * 9 // 8 + (1 << 20)  # bytes: one history with its headroom
        caches[name] = pc.PrefixCache(room)
    caches["fresh"]._buffer_for = lambda size, room: caches["fresh"]._take_spare(size)  # the code before: a spare or none
    times: dict[str, list[float]] = {name: [] for name in caches}
    for r in range(rounds):
        conv = (history, other)[r % 2]
        for name, cache in (caches.items() if r % 2 else reversed(caches.items())):
            saver.share_prefix(lenders[tuple(conv)], len(conv))
            t0 = time.perf_counter()
            cache.prepare(saver, [7, 8, 9])  # saves conv, evicting the other conversation
            dt = time.perf_counter() - t0
            assert len(cache) == 1
            saver.truncate(0)
            if r >= 2:  # both caches full
                times[name].append(dt)
    print(f"{len(history)} tokens saved into a full cache: into a fresh buffer {1e3 * statistics.median(times['fresh']):.1f} ms, "
          f"into the evicted history's {1e3 * statistics.median(times['evicted']):.1f} ms (medians of {rounds - 2}, interleaved)")


if __name__ == "__main__":
    main()
