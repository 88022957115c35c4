"""A trained MTP head on disk: its header (window, memory) read without torch, and opening it
to serve (torch, imported only then)."""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from homespec.errors import ModelError

if TYPE_CHECKING:
    from homespec.mtp.model import HeadRunner

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


def open_head(target, head_path: str | Path, target_gguf: str | Path, *, threads: int | None = None,
              int8: bool = True) -> HeadRunner:
    """Load a trained head to serve beside `target` (a Runtime opened with hidden_window >=
    head_window); speculation/proposers/mtp.py's MTPProposer drafts with it."""
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
    return HeadRunner(head, _EmbedRows(weights), int8=int8)
