"""Exact mode, measured: over 24 prompts, is greedy speculative output identical to plain greedy
decoding, by default and with `runtime.exact` (on a CPU with AMX, also with every weight unpacked,
as exact mode loads the target elsewhere), and what does exact mode cost?

    .venv/bin/python scripts/batch_invariance.py [--tokens 64]

Each mode runs in its own process (ggml fixes its tiled-matmul switch once per process). Per
mode and prompt: plain decoding (k = 0), ngram with the longest draft the mode allows up to 16
(Config.k_limit: 6 in exact mode on a build without the reference-kernel switch) and the draft
model k = 4, same prompt, cold cache, greedy; then the count of prompts whose speculative tokens
equal plain decoding's, the first divergence, the batch noise (max |Δlogit| of 17 positions
decoded alone against the same positions verified in batches of 2..7, and of 9 and 17 where the
mode allows such passes), and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Held out from the bench's prompts (which come first, from homespec/bench_prompts).
EXTRA = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a bash script that prints the ten largest files under the current directory.",
    "Write a SQL query that returns, for each customer, their most recent order date.",
    "Write a Python class `LRUCache` with get and put methods, using OrderedDict.",
    "Explain the difference between a process and a thread in a few sentences.",
    "Write a JavaScript function that debounces another function by a given delay.",
    "Write a Python function that parses a duration like '1h30m' into seconds.",
    "What are three good habits for writing readable code? One paragraph each.",
    "Write a Rust function that reverses the words in a string slice.",
    "Explain what a race condition is, with a short example in Python.",
    "Write a Go function that counts word frequencies in a text.",
    "Summarize the rules of tic-tac-toe for a child, in four sentences.",
]
LONG_TAIL = " Answer carefully, and explain each step of your reasoning in detail." * 30  # > 256 tokens


# exact: as the daemon loads the target (on a CPU with AMX, AMX's buffer kept: llama/kernels.py);
# exact-unpacked: every weight unpacked, as exact mode does without AMX (run where AMX is in use).
MODES = ("default", "exact", "exact-unpacked")


def prompts() -> list[list[dict[str, str]]]:
    from homespec.serving.bench import load_workloads

    out = [p.messages for w in load_workloads(("code", "edit", "chat", "json")) for p in w.prompts]
    return out + [[{"role": "user", "content": t}] for t in EXTRA]


def run_mode(mode: str, tokens: int) -> dict:

    from homespec.config import Config
    from homespec.llama.runtime import Runtime
    from homespec.llama.template import ChatTemplate
    from homespec.models.derived import served_draft
    from homespec.models.fetch import resolve_model_path
    from homespec.models.loader import open_target, runtime_options
    from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
    from homespec.speculation.proposers.draft import DraftProposer
    from homespec.speculation.proposers.ngram import NgramProposer
    from tests.integration.exactness import batch_noise, first_divergence

    cfg = Config()
    cfg.base_dir = ROOT
    cfg.runtime.exact = mode != "default"
    target = open_target(cfg, resolve_model_path(cfg, cfg.models.target), 2048, amx=mode != "exact-unpacked")
    draft = Runtime(served_draft(cfg, cfg.models.draft), runtime_options(cfg, 0, 2048, draft=True))
    tmpl = ChatTemplate(target.chat_template)
    engine = Engine(target)
    k = min(16, cfg.k_limit(target.opts.reference_decode))
    arms = {"plain": FixedPolicy(), "ngram": FixedPolicy(NgramProposer(2, 12), k),
            "draft k=4": FixedPolicy(DraftProposer(draft, target.n_vocab), 4)}
    rows, secs, toks, prefill = [], {a: 0.0 for a in arms}, {a: 0 for a in arms}, []
    for msgs in prompts():
        prompt = target.tokenize(tmpl.render(msgs), add_special=False)
        target.reset()
        t0 = time.perf_counter()
        target.sync(prompt)
        prefill.append((len(prompt), time.perf_counter() - t0))
        out = {}
        for arm, policy in arms.items():
            target.truncate(len(prompt))  # the prompt stays cached: arms differ in decoding only
            st = GenerationStats()
            t0 = time.perf_counter()
            out[arm] = [t for ev in engine.generate(prompt, max_tokens=tokens, policy=policy, stats=st) for t in ev.tokens]
            secs[arm] += time.perf_counter() - t0
            toks[arm] += len(out[arm])
        div = {}
        for arm in arms:
            if arm != "plain":
                j = first_divergence(out["plain"], out[arm])
                div[arm] = j if j is not None or len(out[arm]) == len(out["plain"]) else min(len(out[arm]), len(out["plain"]))
        rows.append({"tokens": len(prompt), "diverged_at": div})
    deltas = batch_noise(target, ["Write a Python function that reverses a string.", "Explain recursion." + LONG_TAIL],
                         positions=17, sizes=[n for n in (2, 3, 4, 5, 6, 7, 9, 17) if n <= k + 1])
    noise = max(d for ds in deltas.values() for d in ds)
    n_pre = sum(n for n, _ in prefill)
    return {
        "mode": mode,
        "kernels": f"{'repacked' if target.opts.repack else 'unpacked'} weights, tiled matmul "
                   f"{'on' if target.tiled_matmul else 'off'}, {target.opts.kv_type} KV, "
                   f"flash attention {'on' if target.opts.flash_attn else 'off'}"
                   f"{', decode passes on reference kernels' if target.opts.reference_decode else ''}",
        "ngram_k": k,
        "rows": rows,
        "tok_s": {a: toks[a] / secs[a] for a in arms},
        "prefill_tok_s": n_pre / sum(s for _, s in prefill),
        "noise": noise,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt and arm")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child process
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.tokens)))
        return
    from homespec.llama.kernels import amx_buffer_available

    results = []
    for mode in MODES if amx_buffer_available() else MODES[:2]:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--tokens", str(args.tokens)],
                             capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    n = len(results[0]["rows"])
    print(f"{n} prompts, {args.tokens} tokens each, greedy, cold cache\n")
    print("| mode | kernels | identical to plain: ngram (k) | draft k=4 | batch noise | plain tok/s | ngram / plain | draft / plain | prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        same = {a: sum(1 for row in r["rows"] if row["diverged_at"][a] is None) for a in ("ngram", "draft k=4")}
        t = r["tok_s"]
        print(f"| {r['mode']} | {r['kernels']} | {same['ngram']}/{n} (k={r['ngram_k']}) | {same['draft k=4']}/{n} | "
              f"{r['noise']:.3g} | {t['plain']:.2f} | {t['ngram'] / t['plain']:.2f}x | {t['draft k=4'] / t['plain']:.2f}x | "
              f"{r['prefill_tok_s']:.1f} |")
    print("\nfirst divergence (token index) per prompt, default mode:",
          [(row["diverged_at"]["ngram"], row["diverged_at"]["draft k=4"]) for row in results[0]["rows"]])


if __name__ == "__main__":
    main()
