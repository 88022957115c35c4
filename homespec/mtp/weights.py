"""The target's frozen tensors, read from its GGUF and dequantised with the `gguf` package.

The head reuses three things of the target: its token embedding (the input t_{i+1}), its output
projection (restricted to the head's output vocabulary) and, for initialisation only, one of
its decoder layers. Only the rows asked for are dequantised: the full embedding in float32
would be 933 MB, the rows of a 16k-token vocabulary are 100 MB.

The file is memory-mapped and its header parsed with homespec.llama.gguf_info (well under a second;
`gguf.GGUFReader` takes ~10 s on Qwen2.5's 151,936-token vocabulary). A 2-D GGUF tensor with
dims [ne0, ne1] is ne1 rows of ne0 values, which is torch's Linear layout [out, in].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homespec.errors import ModelError
from homespec.llama.gguf_info import _read_header


@dataclass(frozen=True)
class TargetShape:
    """What the head copies from the target's architecture (GGUF metadata)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rope_base: float
    rms_eps: float


class TargetWeights:
    def __init__(self, path: str | Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES  # deferred: importing gguf costs ~0.1 s

        self.path = Path(path)
        h = _read_header(self.path, want_tokens=False)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        # name -> (dims, ggml type, absolute byte offset)
        self._tensors = {name: (dims, t, h.data_start + off) for name, dims, t, off in h.tensors}
        self._sizes = GGML_QUANT_SIZES
        kv = h.kv
        arch = kv.get("general.architecture")

        def need(key: str):
            v = kv.get(f"{arch}.{key}")
            if v is None:
                raise ModelError(f"{self.path}: metadata {arch}.{key} missing: cannot shape an MTP head")
            return max(v) if isinstance(v, list) else v

        n_embd, n_head = int(need("embedding_length")), int(need("attention.head_count"))
        self.shape = TargetShape(
            n_embd=n_embd,
            n_layer=int(need("block_count")),
            n_head=n_head,
            n_head_kv=int(need("attention.head_count_kv")),
            head_dim=int(kv.get(f"{arch}.attention.key_length", n_embd // n_head)),
            n_ff=int(need("feed_forward_length")),
            n_vocab=int(self._tensors["token_embd.weight"][0][1]),
            rope_base=float(kv.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        )

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _raw_rows(self, name: str) -> tuple[np.ndarray, int, int]:
        """The tensor as [rows, bytes per row] uint8 (a view of the mapped file), its type, cols."""
        if name not in self._tensors:
            raise ModelError(f"{self.path}: tensor {name} not found")
        dims, ggml_type, off = self._tensors[name]
        cols = dims[0]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        block, type_size = self._sizes[ggml_type]
        row_bytes = cols // block * type_size
        raw = self._data[off : off + rows * row_bytes].reshape(rows, row_bytes)
        return raw, ggml_type, cols

    def rows(self, name: str, ids: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Rows of a tensor dequantised to float32: [len(ids), cols], or all rows when ids is None."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw, ggml_type, cols = self._raw_rows(name)
        sel = raw if ids is None else raw[np.asarray(ids, dtype=np.int64)]
        out = dequantize(np.ascontiguousarray(sel), GGMLQuantizationType(ggml_type))
        return np.asarray(out, dtype=np.float32).reshape(sel.shape[0], cols)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weights, biases) as float32 [n]."""
        return self.rows(name).reshape(-1)

    def embed(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token embeddings [len(ids), n_embd]."""
        return self.rows("token_embd.weight", ids)

    def output(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Output projection rows [len(ids), n_embd]; tied models reuse the embedding."""
        name = "output.weight" if self.has("output.weight") else "token_embd.weight"
        return self.rows(name, ids)

    def output_norm(self) -> np.ndarray:
        return self.vector("output_norm.weight")

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Decoder layer i in torch layout: name -> float32 array (Linear weights [out, in])."""
        names = {
            "attn_norm": "attn_norm.weight", "q": "attn_q.weight", "q_bias": "attn_q.bias",
            "k": "attn_k.weight", "k_bias": "attn_k.bias", "v": "attn_v.weight", "v_bias": "attn_v.bias",
            "o": "attn_output.weight", "ffn_norm": "ffn_norm.weight", "gate": "ffn_gate.weight",
            "up": "ffn_up.weight", "down": "ffn_down.weight",
        }
        out = {}
        for key, suffix in names.items():
            name = f"blk.{i}.{suffix}"
            if self.has(name):
                arr = self.rows(name)
                out[key] = arr.reshape(-1) if arr.shape[0] == 1 else arr
        return out
