"""Where does a greedy answer, asked again, leave the remembered one? By its argmax gaps.

    .venv/bin/python scripts/near_tie_flips.py [--tokens 128] [--rows 65] [--workload chat --workload code]

For each bench prompt: decode the answer plainly (one-row passes) and keep each token's argmax
gap (sampling.argmax_gaps); then verify that answer as the same question's draft is verified,
in passes of --rows rows from the prompt on, and stop at the first token whose argmax differs
(a flip). Per prompt: where it flipped, the gap there, and the gaps under 0.4 it kept before.
Then kept / seen by costs.NearTieModel's buckets, over every token tested: what that model's
PRIOR was read from (on a 2-core EPYC, with the bench's repeats in one process).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="answer tokens per prompt")
    ap.add_argument("--rows", type=int, default=65, help="rows of each verifying pass (k_max + 1)")
    ap.add_argument("--workload", action="append", choices=("chat", "code", "edit"), help="repeatable; default chat and code")
    args = ap.parse_args()

    from homespec.config import Config
    from homespec.llama.runtime import Runtime
    from homespec.llama.template import ChatTemplate
    from homespec.models.fetch import resolve_model_path
    from homespec.models.loader import runtime_options
    from homespec.serving.bench import load_workloads
    from homespec.speculation.costs import NearTieModel
    from homespec.speculation.sampling import argmax_gaps

    cfg = Config()
    cfg.base_dir = ROOT
    target = Runtime(resolve_model_path(cfg, cfg.models.target), runtime_options(cfg, 0, 2048))
    template = ChatTemplate(target.chat_template)
    seen = np.zeros(len(NearTieModel.PRIOR), dtype=np.int64)  # [buckets] tokens tested
    kept = np.zeros(len(NearTieModel.PRIOR), dtype=np.int64)  # [buckets] of them given again
    for wl in load_workloads(tuple(args.workload or ("chat", "code"))):
        for i, prompt in enumerate(wl.prompts):
            tokens = target.tokenize(template.render(prompt.messages), add_special=False)
            target.reset()
            target.sync(tokens[:-1], output="none")
            answer, gaps, last = [], [], tokens[-1]
            for _ in range(args.tokens):  # plain decoding, as the first answer is mostly given
                row = target.eval([last], output="last")  # [1, vocab]
                last = int(np.argmax(row[0]))
                answer.append(last)
                gaps.append(float(argmax_gaps(row, [last])[0]))
            target.truncate(len(tokens) - 1)
            flip, pos, inputs = None, 0, [tokens[-1], *answer[:-1]]  # row j chooses answer[j]
            while pos < len(answer) and flip is None:
                rows = target.eval(inputs[pos : pos + args.rows], output="all")  # [rows, vocab]
                chosen = np.argmax(rows, axis=1)
                for j, tok in enumerate(chosen):
                    b = int(NearTieModel.bucket(gaps[pos + j]))
                    seen[b] += 1
                    if tok != answer[pos + j]:
                        flip = pos + j
                        break
                    kept[b] += 1
                pos += len(chosen)
            before = [round(g, 3) for g in gaps[: flip if flip is not None else len(gaps)] if g < 0.4]
            where = f"flipped at token {flip}, gap {gaps[flip]:.3f}" if flip is not None else "given again whole"
            print(f"{wl.name} #{i + 1}: {where}; gaps under 0.4 kept before: {before}", flush=True)
    bounds = [0.0, *NearTieModel.EDGES.tolist(), float("inf")]
    print("kept / seen by gap: " + ", ".join(f"[{lo:g}, {hi:g}) {k}/{n}" for lo, hi, k, n in zip(bounds, bounds[1:], kept, seen, strict=False)))
    target.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
