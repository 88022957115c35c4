"""The MTP head as a proposer: drafts from the target's own last hidden state.

Indexing (the one-position shift). Head entry j pairs h_j, the target's hidden state at
position j, with t_{j+1}, the token sampled from L_j; its output ĥ_{j+1} predicts the target's
next hidden state and, through W_out, the token after t_{j+1}. Between steps the target's cache
holds ctx[:-1] (engine.py), so with m = len(ctx) its hidden states reach position m - 2, and

    entry m - 2  = (h_{m-2}, t_{m-1})  -> d_1       real: the last one the target evaluated
    entry m - 1  = (ĥ_{m-1}, d_1)      -> d_2       speculative: the head's own prediction
    entry m - 2 + i = (ĥ, d_i)         -> d_{i+1}

After verification accepts a tokens the target has evaluated positions up to m + a - 1 = m' - 2,
so the next proposal drops the speculative entries and rebuilds entries m - 1 .. m' - 2 from the
target's real hidden states (a + 1 rows in one batch: fc and K/V only, the rest of the layer runs
for the last row). Entries older than the head's window are not needed.

The head proposes only tokens of its output vocabulary V'. Under sampling, q is its
distribution over the FULL target vocabulary (zero outside V') through sampling.probabilities
with the request's params, so rejection sampling stays exact; under greedy decoding q is None.

Requires the target runtime to keep hidden states (RuntimeOptions.hidden_window >= the head's
window) and torch (`homespec[mtp]`), which is imported only when a head is opened.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

from homespec.errors import ModelError
from homespec.speculation.proposers.base import Proposal
from homespec.llama.runtime import common_prefix
from homespec.speculation.sampling import SamplingParams, penalize, probabilities, sample, window


class MTPProposer:
    name = "mtp"

    def __init__(self, target, runner, n_vocab: int) -> None:
        """target: the Runtime (with hidden_window); runner: a model.HeadRunner."""
        self.target = target
        self.runner = runner
        self.n_vocab = n_vocab
        self.vocab_ids = runner.vocab_ids  # [V'] head index -> target token id
        self.window = runner.cfg.window
        self._seen: list[int] = []  # the context the real entries were built from
        self._real_end = 0  # entries < this were built from the target's real hidden states
        self._step_entries = 1  # entries a normal step adds (k + 1); more is a catch-up

    # -- the head's cache follows the target ---------------------------------------------------

    def _keep(self, context: Sequence[int]) -> int:
        """Real entries still valid for `context`: entry j needs context[:j + 2] unchanged."""
        return max(0, min(self._real_end, common_prefix(self._seen, context) - 1, self.runner.end))

    def lag(self, context: Sequence[int]) -> int:
        """Head entries to (re)build before proposing for `context` (at most the window)."""
        last = len(context) - 2
        return max(0, min(self.window, last + 1 - self._keep(context)))

    def _sync(self, context: Sequence[int], last: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Make real entries ..last valid; return (ĥ, logits [V'], entries built) of entry
        `last`, or None when the target kept no hidden state for it."""
        keep = min(self._keep(context), last)  # entry `last` runs again: its output is the draft
        lo = max(keep, last + 1 - self.window, self.target.hidden_start)
        if lo > last:
            return None
        self.runner.truncate(keep)
        if lo > keep:  # a gap the target has no hidden states for: start the cache at lo
            self.runner.reset(lo)
        hidden = self.target.hidden_rows(lo, last + 1)  # [n, d]
        nxt = np.asarray(context[lo + 1 : last + 2], dtype=np.int64)  # [n] t_{j+1}
        h_pred, logits = self.runner.extend(hidden, nxt, lo)
        self._seen = list(context[: last + 2])
        self._real_end = last + 1
        return h_pred, logits, last + 1 - lo

    def begin(self, prompt: Sequence[int]) -> None:
        # The target has just read the prompt: build the entries it allows now, during prefill.
        # Entry len(prompt) - 1 needs the first generated token; the first proposal adds it.
        if len(prompt) >= 2 and list(self.target.tokens[: len(prompt) - 1]) == list(prompt[:-1]):
            self._sync(prompt, len(prompt) - 2)

    # -- drafting ------------------------------------------------------------------------------

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        t0 = time.perf_counter()
        m = len(context)
        if k <= 0 or m < 2 or len(self.target.tokens) != m - 1:
            return Proposal([], None, time.perf_counter() - t0)
        synced = self._sync(context, m - 2)
        if synced is None:
            return Proposal([], None, time.perf_counter() - t0)
        h_pred, logits, built = synced
        # Rebuilding more than a step could have added means the head sat out some steps: a
        # switching cost, reported apart so the controller's cost per token stays clean.
        catchup_s = time.perf_counter() - t0 if built > self._step_entries else 0.0
        self._step_entries = k + 1
        tokens: list[int] = []
        qs: list[np.ndarray] = []  # each [n_vocab]
        conf: list[float] = []
        recent = list(window(context, params))
        for i in range(k):
            tok, q, c = self._choose(logits, params, window(recent + tokens, params), rng)
            tokens.append(tok)
            conf.append(c)
            if q is not None:
                qs.append(q)
            if i + 1 < k:  # speculative entry m - 1 + i: the head's own ĥ with the token it drafted
                h_pred, logits = self.runner.extend(h_pred[None, :], np.asarray([tok]), m - 1 + i)
        info = {"confidence": float(np.mean(conf)), "catchup_s": catchup_s,
                "catchup_tokens": float(built if catchup_s else 0)}
        return Proposal(tokens, np.stack(qs) if qs else None, time.perf_counter() - t0, info)

    def _choose(
        self, z: np.ndarray, params: SamplingParams, recent: Sequence[int], rng: np.random.Generator
    ) -> tuple[int, np.ndarray | None, float]:
        """Head logits over V' [V'] -> (token id, q over the full vocabulary or None, confidence)."""
        if params.greedy and not params.has_penalties:
            i = int(np.argmax(z))  # the common case stays in V' (16k rows, not 152k)
            return int(self.vocab_ids[i]), None, float(1.0 / np.exp(z - z[i]).sum())
        full = np.full(self.n_vocab, -np.inf, dtype=np.float32)  # [n_vocab]
        full[self.vocab_ids] = z
        full = penalize(full, params, recent)
        if params.greedy:
            tok = int(np.argmax(full))
            return tok, None, float(1.0 / np.exp(full - full[tok]).sum())
        q = probabilities(full, params)  # zero outside V': never proposed, exactness kept
        tok = sample(q, rng)
        return tok, q, float(q[tok])

    def close(self) -> None:
        self.runner = None


# -- opening a trained head ------------------------------------------------------------------


EMBED_CACHE_ROWS = 8192  # embedding rows kept dequantised: a step needs a handful, a chat a few thousand
# bytes: what opening the head adds beyond its serving weights. Measured with the 16k-vocabulary
# head of the default target: RSS grew 660 MiB in a bare process (importing torch 184 MiB of it;
# the rest is allocator slack from loading in float32 and the target's GGUF pages it reads) and
# 782 MiB in the daemon, against 121 MiB of serving weights and caches.
TORCH_OVERHEAD = 640 * 2**20


def _header(path: str | Path) -> tuple[dict, dict]:
    """(tensor table, head config) from a head's safetensors header, without torch."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__")
        return header, json.loads(meta["config"])
    except FileNotFoundError:
        raise ModelError(f"MTP head {path} not found (train one with `homespec train-mtp`)") from None
    except (KeyError, ValueError, TypeError, struct.error) as e:
        raise ModelError(f"{path}: not a homespec MTP head ({e})") from None


def head_window(path: str | Path) -> int:
    """The attention window a head was trained with: the target runtime must keep at least this
    many hidden states (hidden_window)."""
    return int(_header(path)[1]["window"])


def head_ram(path: str | Path) -> int:
    """Bytes the served head occupies (for the memory plan): int8 weights, its output rows,
    the embedding row cache, and torch itself."""
    tensors, cfg = _header(path)
    params = sum(math.prod(t["shape"]) for t in tensors.values() if t["dtype"] in ("F32", "F16", "BF16"))
    d = int(cfg["d"])
    return params + int(cfg["vocab_out"]) * d + EMBED_CACHE_ROWS * d * 4 + TORCH_OVERHEAD


class _EmbedRows:
    """Token id -> the target's embedding row, dequantised on demand (~0.1 ms a row) and kept
    in an LRU cache: a step needs a handful, and the full table would be 933 MB."""

    def __init__(self, weights, capacity: int = EMBED_CACHE_ROWS) -> None:
        self.weights, self.capacity = weights, capacity
        self.rows: OrderedDict[int, np.ndarray] = OrderedDict()

    def __call__(self, ids: np.ndarray) -> np.ndarray:  # [n] -> [n, d] float32
        missing = [int(t) for t in dict.fromkeys(ids.tolist()) if int(t) not in self.rows]
        if missing:
            for t, row in zip(missing, self.weights.embed(missing)):
                self.rows[t] = row
        out = []
        for t in ids.tolist():
            self.rows.move_to_end(int(t))
            out.append(self.rows[int(t)])
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)
        return np.stack(out)


def open_mtp(target, head_path: str | Path, target_gguf: str | Path, *, threads: int | None = None,
             int8: bool = True) -> MTPProposer:
    """Load a trained head for `target` (a Runtime opened with hidden_window >= head_window)."""
    try:
        import torch

        from homespec.mtp.model import HeadRunner, load_head
        from homespec.mtp.weights import TargetWeights
    except ImportError as e:
        raise ModelError(f"the MTP head needs torch ({e.name} missing): pip install 'homespec[mtp]'") from None
    weights = TargetWeights(target_gguf)
    head = load_head(Path(head_path), weights)
    if getattr(target, "opts", None) is not None and target.opts.hidden_window < head.cfg.window:
        raise ModelError(f"target runtime keeps {target.opts.hidden_window} hidden states; the MTP head "
                         f"needs {head.cfg.window} (RuntimeOptions.hidden_window)")
    if threads:
        torch.set_num_threads(threads)
    runner = HeadRunner(head, _EmbedRows(weights), int8=int8)
    return MTPProposer(target, runner, target.n_vocab)
