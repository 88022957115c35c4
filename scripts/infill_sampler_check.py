#!/usr/bin/env python3
"""homespec's sampler chains against llama.cpp's own, token by token: the infill sampler
(speculation/infill_sampler.py) and llama.cpp's order, which tempers after the cuts.

llama-server (the bench's peer build, same model) completes fill-in-the-middle prompts with a
chain and reports, with `post_sampling_probs`, the distribution its chain ended with at every
token. homespec's Runtime reads the same tokens (the prompt and what llama-server wrote), and
`sampling.probabilities` with the same order gives its distribution at each position. The two
should keep the same tokens with the same probabilities, up to the two builds' logit noise.
Chains (--chain):
  editor     llama.vscode's and llama.vim's: ["top_k", "top_p", "infill"], top_k 40, top_p 0.99
  llama.cpp  its default order "edkypmxt" (penalties, dry, top_k, typ_p, top_p, min_p, xtc,
             temperature) at its defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05

    .venv/bin/python scripts/infill_sampler_check.py [--chain editor] [--tokens 16] [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import numpy as np

from homespec.llama.runtime import Runtime, RuntimeOptions, physical_cores
from homespec.serving import peer_build
from homespec.serving.peer import LlamaServer, PeerSetting
from homespec.speculation.infill_sampler import InfillVocab
from homespec.speculation.sampling import SamplingParams, probabilities

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
N_PROBS = 40  # top_k: every token a chain can keep
# (llama-server's sampling fields, homespec's SamplingParams for them)
CHAINS = {
    "editor": ({"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99},
               {"temperature": 1.0, "top_k": 40, "top_p": 0.99, "order": ("top_k", "top_p", "infill")}),
    "llama.cpp": ({"samplers": "edkypmxt", "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
                  {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "order": ("top_k", "top_p", "min_p", "temperature")}),
}
# Gaps of the kind an editor asks about (tests/integration/test_infill.py's snippets, and two open ones).
SNIPPETS = [
    ("def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"),
    ("def is_even(n: int) -> bool:\n    ", "\n\n\nassert is_even(4)\n"),
    ("import math\n\ndef circle_area(r):\n    return ", "\n"),
    ("def fib(n):\n    if n < 2:\n        return n\n    return ", "\n\nprint(fib(10))\n"),
    ("class Point:\n    def __init__(self, x, y):\n        ", "\n\n    def norm(self):\n        return 0\n"),
    ("import json\n\ndef load(path):\n    ", "\n\ndata = load('a.json')\n"),
    ("# parse the CSV file into rows\n", "\nprint(len(rows))\n"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", choices=sorted(CHAINS), default="editor")
    ap.add_argument("--tokens", type=int, default=16, help="tokens llama-server writes per gap")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per gap (each writes its own middle)")
    args = ap.parse_args()
    binary = peer_build.binary()
    if binary is None:
        sys.exit("no llama-server built for this CPU yet: run `homespec bench --peer llama-server` once (it builds it)")
    threads = physical_cores()
    rt = Runtime(TARGET, RuntimeOptions(n_ctx=2048, n_threads=threads))
    vocab = InfillVocab(piece=rt.piece, is_eog=rt.is_eog, eot=rt.eot_id)
    fields, ours_fields = CHAINS[args.chain]
    params = SamplingParams(**ours_fields, infill=vocab)  # type: ignore[arg-type]
    positions = same_set = 0
    worst = 0.0  # max |p_homespec - p_llama.cpp| over kept tokens
    differ: list[str] = []
    with LlamaServer(binary, TARGET, PeerSetting("ls plain"), n_ctx=2048, threads=threads) as ls:
        client = httpx.Client(base_url=ls.url, timeout=600)
        for prefix, suffix in SNIPPETS:
            prompt = rt.tokenize(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>", add_special=False, parse_special=True)
            for seed in range(1, args.seeds + 1):
                body = {"prompt": prompt, "n_predict": args.tokens, **fields, "seed": seed, "n_probs": N_PROBS,
                        "post_sampling_probs": True, "cache_prompt": False}
                r = client.post("/completion", json=body)
                r.raise_for_status()
                steps = r.json()["completion_probabilities"]
                # Read as llama-server reads them (the prompt in one pass, then a token a pass): a
                # row's logits move with the pass it is computed in (README, Exact mode).
                rt.truncate(0)
                logits = rt.eval(prompt, output="last")[-1]  # [vocab]
                context = list(prompt)
                for step in steps:
                    theirs = {int(t["id"]): float(t["prob"]) for t in step["top_probs"]}  # the kept tokens
                    if len(context) > len(prompt):
                        logits = rt.eval(context[-1:], output="last")[-1]  # [vocab] after the same tokens
                    p = probabilities(logits, params)  # [vocab]
                    ours = {int(t): float(p[t]) for t in np.flatnonzero(p)}
                    positions += 1
                    if set(ours) == set(theirs):
                        same_set += 1
                        worst = max(worst, max(abs(ours[t] - theirs[t]) for t in ours))
                    else:
                        differ.append(f"{prefix[:24]!r} seed {seed} at {len(context) - len(prompt)}: "
                                      f"homespec {fmt(ours, rt)} llama.cpp {fmt(theirs, rt)}")
                    context.append(int(step["id"]))
    print(f"{args.chain}: {positions} positions over {len(SNIPPETS)} gaps x {args.seeds} seeds: the same tokens kept at {same_set} "
          f"({100 * same_set / positions:.1f} %); there, max |p - p_llama.cpp| = {worst:.1e}")
    for line in differ:
        print("  differ:", line)


def fmt(dist: dict[int, float], rt: Runtime) -> str:
    return "{" + ", ".join(f"{rt.piece(t, special=True).decode(errors='replace')!r}: {p:.3f}" for t, p in
                           sorted(dist.items(), key=lambda kv: -kv[1])) + "}"


if __name__ == "__main__":
    main()
