"""Where a row's logits start to depend on its batch: the target's graph op by op, for a token
evaluated alone and the same token as row 0 of a batch of n, from the same KV prefix.

    .venv/bin/python scripts/trace_batch_ops.py [--rows 5] [--exact] [--long] [--all]

Every float tensor llama.cpp computes is read through ggml's eval callback (llama_context_params
.cb_eval); tensors of the two graphs are paired by name, row 0 of the batch against the lone row.
Prints the logits difference, then each op of layers 0 and 1 (or, with --all, every op that
differs) with max |Δ|: the first op that differs names the kernel path that changed. Findings
are in homespec/llama/kernels.py.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from homespec.config import Config  # noqa: E402
from homespec.llama import runtime as R  # noqa: E402
from homespec.models.fetch import resolve_model_path  # noqa: E402
from homespec.models.loader import runtime_options  # noqa: E402
from tests.integration.exactness import encode  # noqa: E402

llama_cpp = R.llama_cpp


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of ggml/include/ggml.h (ggml 0.25.3)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


_DTYPES = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16
_ggml = ctypes.CDLL(str(next(Path(llama_cpp.__file__).parent.glob("lib/libggml-base.so"))))
_ggml.ggml_op_desc.restype = ctypes.c_char_p
_ggml.ggml_op_desc.argtypes = [ctypes.c_void_p]
captured: list[tuple[str, str, np.ndarray]] | None = None  # (name, op, [ne3, ne2, ne1, ne0]) while recording


@llama_cpp.ggml_backend_sched_eval_callback
def _observe(ptr: int, ask: bool, user_data: ctypes.c_void_p) -> bool:
    if ask or captured is None:
        return True  # ask: we want every tensor; the answer call must return True to go on
    t = GgmlTensor.from_address(ptr)
    if t.type in _DTYPES and t.data:
        ne, nb = list(t.ne), list(t.nb)
        size = np.dtype(_DTYPES[t.type]).itemsize
        buf = (ctypes.c_char * (sum((ne[i] - 1) * nb[i] for i in range(4)) + size)).from_address(t.data)
        a = np.ndarray(ne[::-1], _DTYPES[t.type], buf, strides=nb[::-1]).astype(np.float32)  # a copy
        captured.append((t.name.decode(), _ggml.ggml_op_desc(ptr).decode(), a))
    return True


def open_target(exact: bool) -> R.Runtime:
    cfg = Config()
    cfg.base_dir = ROOT
    cfg.runtime.exact = exact
    default_params = llama_cpp.llama_context_default_params

    def with_callback():  # Runtime builds its context from these defaults
        p = default_params()
        p.cb_eval = _observe
        return p

    llama_cpp.llama_context_default_params = with_callback
    try:
        return R.Runtime(resolve_model_path(cfg, cfg.models.target), runtime_options(cfg, 0, 2048))
    finally:
        llama_cpp.llama_context_default_params = default_params


def record(rt: R.Runtime, tokens: list[int]) -> tuple[np.ndarray, list[tuple[str, str, np.ndarray]]]:
    global captured
    captured = []
    try:
        return rt.eval(tokens, "all"), captured
    finally:
        captured = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5, help="tokens in the batch")
    ap.add_argument("--exact", action="store_true", help="load the target with runtime.exact")
    ap.add_argument("--long", action="store_true", help="a prompt past 256 tokens (512+ KV cells)")
    ap.add_argument("--all", action="store_true", help="every op that differs, not layers 0 and 1 only")
    args = ap.parse_args()
    rt = open_target(args.exact)
    text = "Write a Python function that returns the n-th Fibonacci number iteratively."
    if args.long:
        text += " Explain each step of your reasoning in detail." * 30
    prompt = encode(rt, text)
    row = rt.sync(prompt)[0]
    base = len(rt.tokens)
    cont = []
    for _ in range(args.rows):  # the target's greedy continuation, the tokens the batch holds
        cont.append(int(np.argmax(row)))
        row = rt.eval(cont[-1:], "all")[0]
    rt.truncate(base)
    batch_logits, batch = record(rt, cont)
    rt.truncate(base)
    alone_logits, alone = record(rt, cont[:1])
    print(f"{len(prompt)}-token prompt, row 0 of {args.rows} against alone: logits max |Δ| {np.abs(batch_logits[0] - alone_logits[0]).max():.4g}")
    by_name: dict[str, list[tuple[str, np.ndarray]]] = {}
    for name, op, a in alone:
        by_name.setdefault(name, []).append((op, a))
    for name, op, a in batch:
        if not by_name.get(name):
            continue
        _, b = by_name[name].pop(0)
        axes = [i for i in range(4) if a.shape[i] != b.shape[i]]
        if len(axes) > 1:
            continue  # not a per-token tensor (e.g. a view of the KV cache)
        rows = np.take(a, range(b.shape[axes[0]]), axis=axes[0]) if axes else a
        d = float(np.abs(rows - b).max())
        layer = name.rsplit("-", 1)[-1]
        if (args.all and d > 0) or (not args.all and (layer in ("0", "1") or name.startswith("result"))):
            print(f"  {name:28s} {op:16s} max |Δ| {d:.3g}")


if __name__ == "__main__":
    main()
