#!/usr/bin/env python3
"""What a target pass of n rows costs against a pass of one, on this CPU: the price of verifying a
draft (n rows of one sequence) and of decoding several requests together (one row each of m
sequences), after a history of --history tokens in every sequence. Medians of --rounds, the
sizes taking turns within a round. Compare the ratios of one run, not times across runs.

Speculation and batching both live on the ratio: where a 5-row pass costs 1.5x a 1-row pass
(the AVX-512 Xeon, llama-bench) verifying 4 drafted tokens is cheap; where it costs ~4x, neither
pays much. It runs again at once with huge pages asked for where the daemon would be
(hugepages.environ_with_huge_pages); PYTHONPATH may point at another llama_cpp build.

    .venv/bin/python scripts/pass_cost.py [--history 1000] [--rounds 6] [--no-repack] [--rows 1,5,17,33]
                                          [--flash-attn on|off] [--layouts "1,0,1,1;5,1,1,1"] [--kv-unified]

--layouts times passes of given rows per slot (0: the slot sits out), as several requests'
steps make them: with a KV stream per sequence (the default) llama.cpp runs steps of unequal
length, or slots with a gap between them, as several graphs; --kv-unified times one buffer.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import llama_cpp

from homespec.llama.hugepages import environ_with_huge_pages
from homespec.llama.runtime import Runtime, RuntimeOptions, physical_cores

TARGET = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
ROWS = (1, 2, 3, 4, 5, 8, 12, 16)  # rows of one sequence: a draft of n - 1 tokens and the bonus row
SEQS = (2, 4)  # sequences decoding one row each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=1000, help="tokens already in every sequence")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp's weights as stored (use_extra_bufts off)")
    ap.add_argument("--rows", type=lambda s: sorted({1, *(int(x) for x in s.split(","))}), default=list(ROWS),
                    help=f"comma-separated pass sizes of one sequence (1 is always timed; default {','.join(map(str, ROWS))})")
    ap.add_argument("--flash-attn", choices=["on", "off"], default="off",
                    help="llama.cpp's flash attention (runtime.flash_attn; default off, as the daemon)")
    ap.add_argument("--layouts", type=lambda s: [[int(x) for x in part.split(",")] for part in s.split(";")], default=[],
                    help="semicolon-separated passes, each the rows of slots 0.. (0: sits out), e.g. 1,0,1,1;5,1,1,1")
    ap.add_argument("--kv-unified", action="store_true", help="one KV buffer for all sequences (runtime.kv_unified)")
    args = ap.parse_args()
    if any(len(layout) > max(SEQS) or not any(layout) for layout in args.layouts):
        ap.error(f"--layouts: each pass names 1 to {max(SEQS)} slots' rows, some of them > 0")
    env = environ_with_huge_pages()  # None: already asked for, or nothing to change here
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    rng = random.Random(0)
    rt = Runtime(
        TARGET,
        RuntimeOptions(n_ctx=4096, n_seq=max(SEQS), n_threads=physical_cores(), kv_unified=args.kv_unified, repack=not args.no_repack,
                       flash_attn=args.flash_attn == "on"),
    )
    slots = [rt.slot(i) for i in range(max(SEQS))]
    history = [rng.randrange(100, 20000) for _ in range(args.history)]
    for s in slots:
        s.eval(history, output="none")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    times: dict[str, list[float]] = {}  # label -> seconds per pass
    for _ in range(args.rounds):
        for n in args.rows:
            t0 = time.perf_counter()
            slots[0].eval(tokens(n), output="all")
            times.setdefault(f"{n:>2} rows of one sequence", []).append(time.perf_counter() - t0)
            slots[0].truncate(args.history)
        for m in SEQS:
            t0 = time.perf_counter()
            rt.eval_many([(slots[i], tokens(1), "all") for i in range(m)])
            times.setdefault(f"{m:>2} sequences, a row each", []).append(time.perf_counter() - t0)
            for i in range(m):
                slots[i].truncate(args.history)
        for layout in args.layouts:
            parts = [(slots[i], tokens(n), "all") for i, n in enumerate(layout) if n]
            t0 = time.perf_counter()
            rt.eval_many(parts)
            times.setdefault(f"rows {','.join(map(str, layout))} by slot", []).append(time.perf_counter() - t0)
            for slot, _, _ in parts:
                slot.truncate(args.history)
    print(llama_cpp.llama_print_system_info().decode().strip())
    print(f"{physical_cores()} threads, {args.history} tokens of history, repack {'off' if args.no_repack else 'on'}, "
          f"{'one KV buffer' if args.kv_unified else 'a KV stream per sequence'}, "
          f"flash attention {args.flash_attn}, "
          f"medians of {args.rounds}")
    one = statistics.median(times[f"{1:>2} rows of one sequence"])  # seconds
    for label, ts in times.items():
        t = statistics.median(ts)
        print(f"{label}: {1e3 * t:6.1f} ms  {t / one:5.2f}x a 1-row pass")


if __name__ == "__main__":
    main()
