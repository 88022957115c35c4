"""Shared tools for the exactness rules of DESIGN.md (batch noise, near-ties)."""

from __future__ import annotations

import numpy as np

from homespec.llama.template import ChatTemplate

PROBE_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."


class Recording:
    """Delegates to a Runtime and keeps every logits row it returns, with the token it scored."""

    def __init__(self, rt):
        self.rt = rt
        self.rows: list[tuple[int, np.ndarray]] = []  # (position, logits [vocab])

    def eval(self, tokens, output="all"):
        start = len(self.rt.tokens)
        out = self.rt.eval(tokens, output)
        if output == "all":
            self.rows += [(start + i, out[i]) for i in range(len(tokens))]
        return out

    def __getattr__(self, name):
        return getattr(self.rt, name)


def encode(rt, text):
    tmpl = ChatTemplate(rt.chat_template)
    return rt.tokenize(tmpl.render([{"role": "user", "content": text}]), add_special=False)


def measure_batch_noise(target_rt) -> float:
    """Batch noise: max |logit difference| of the same positions evaluated alone vs in a batch."""
    ctx = encode(target_rt, PROBE_PROMPT)
    cont = target_rt.tokenize(" def fib(n):\n    a, b = 0, 1\n    for _ in range(n):", add_special=False)[:12]
    target_rt.reset()
    target_rt.sync(ctx)
    base = len(target_rt.tokens)
    alone = np.stack([target_rt.eval([t], "all")[0] for t in cont])  # [12, vocab]
    deltas = []
    for n in (2, 5, 9):
        target_rt.truncate(base)
        batched = np.concatenate([target_rt.eval(cont[i : i + n], "all") for i in range(0, len(cont), n)])
        deltas.append(float(np.abs(batched - alone).max()))
    target_rt.reset()
    eps = max(deltas)
    print(f"\nbatch noise: max |Δlogit| alone vs batched = {eps:.4f} (batches of 2/5/9: {deltas})")
    return max(eps, 1e-3)


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def margin(row):
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


