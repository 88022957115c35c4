"""Shared tools for the exactness rules of DESIGN.md (batch noise, near-ties)."""

from __future__ import annotations

import numpy as np

from homespec.llama.template import ChatTemplate
from homespec.tokens import common_prefix

# Code, prose and a list: the noise differs with the content, and a dozen positions of one
# prompt under-sample it.
PROBE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a hash map is in two sentences.",
    "List three uses of the Python `itertools` module, with a one-line example each.",
]


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
        elif output == "last" and len(tokens):  # a prompt: the row its first answer token comes from
            self.rows.append((start + len(tokens) - 1, out[-1]))
        return out

    def __getattr__(self, name):
        return getattr(self.rt, name)


def encode(rt, text):
    tmpl = ChatTemplate(rt.chat_template)
    return rt.tokenize(tmpl.render([{"role": "user", "content": text}]), add_special=False)


def batch_noise(target_rt, prompts=PROBE_PROMPTS, positions: int = 12, sizes=(2, 5, 9)) -> dict[str, list[float]]:
    """Per prompt (its first 24 characters), per batch size: max |logit difference| of the same
    positions of the target's greedy continuation evaluated alone vs inside batches of that size."""
    deltas: dict[str, list[float]] = {}
    for text in prompts:
        ctx = encode(target_rt, text)
        target_rt.reset()
        row = target_rt.sync(ctx)[0]  # [vocab] after the prompt
        base = len(target_rt.tokens)
        cont, alone = [], []
        for _ in range(positions):  # the target's own greedy continuation, one token a pass
            cont.append(int(np.argmax(row)))
            row = target_rt.eval(cont[-1:], "all")[0]
            alone.append(row)
        alone_arr = np.stack(alone)  # [positions, vocab]
        for n in sizes:
            target_rt.truncate(base)
            batched = np.concatenate([target_rt.eval(cont[i : i + n], "all") for i in range(0, len(cont), n)])
            deltas.setdefault(text[:24], []).append(float(np.abs(batched - alone_arr).max()))
    target_rt.reset()
    return deltas


def prompt_pass_noise(target_rt, prompts=PROBE_PROMPTS, positions: int = 12) -> float:
    """max |logit difference| of the same positions decoded one at a time vs read in one pass with
    everything before them, as a prompt is read: a pass wider than the 65 rows the wheel's
    row-invariant kernels take (each prompt said 4 times over), which ggml's tiled kernels compute
    in other bits. A warm prefix (read as a prompt, then grown by decode passes) against the same
    text read cold meets this noise, also where decode passes of 2-65 rows have none."""
    worst = 0.0
    for text in prompts:
        ctx = encode(target_rt, "\n\n".join([text] * 4))
        target_rt.reset()
        row = target_rt.sync(ctx)[0]  # [vocab] after the prompt
        cont, alone = [], []
        for _ in range(positions):
            cont.append(int(np.argmax(row)))
            row = target_rt.eval(cont[-1:], "all")[0]
            alone.append(row)
        target_rt.reset()
        wide = target_rt.eval([*ctx, *cont], "all")[len(ctx) :]  # [positions, vocab] in one pass of len(ctx) + positions rows
        worst = max(worst, float(np.abs(wide - np.stack(alone)).max()))
    target_rt.reset()
    return worst


def measure_batch_noise(target_rt, prompts=PROBE_PROMPTS, positions: int = 12) -> float:
    """Batch noise epsilon: max |logit difference| of the same positions evaluated alone vs inside
    batches of 2, 5 and 9, and vs inside a prompt's wide pass, over the greedy continuation of
    several prompts. Noise moves each of the two top logits, so a top-2 margin below 2 epsilon can
    flip."""
    deltas = batch_noise(target_rt, prompts, positions)
    eps = max(d for ds in deltas.values() for d in ds)
    wide = prompt_pass_noise(target_rt, prompts, positions)
    print(f"\nbatch noise: max |Δlogit| alone vs batched = {eps:.4f} (per prompt, batches of 2/5/9: {deltas}); "
          f"vs a prompt's pass = {wide:.4f}")
    return max(eps, wide, 1e-3)


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def margin(row):
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])




def borrowed_prefix(rt, lender_text: str, text: str, lender, borrower, reader) -> tuple[list[int], int]:
    """A prefix borrowed and the same prefix read, side by side: the lender slot reads
    lender_text, the borrower takes (Slot.share_prefix) the prefix that it shares with `text`
    (the chat template's system prompt), the reader reads that prefix itself. Returns (text's
    tokens, the prefix length)."""
    lender_prompt, prompt = encode(rt, lender_text), encode(rt, text)
    n = common_prefix(lender_prompt, prompt)
    assert n >= 16  # the chat template's system prompt
    for s in (lender, borrower, reader):
        s.reset()
    lender.eval(lender_prompt, "none")
    borrower.share_prefix(lender, n)
    assert borrower.tokens == prompt[:n] and lender.tokens == lender_prompt
    reader.eval(prompt[:n], "none")
    return prompt, n
