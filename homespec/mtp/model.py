"""The MTP head (torch): one decoder layer that reads the target's hidden state.

At head position j it reads h_j, the target's final post-norm hidden state, and the embedding of
t_{j+1}, the token sampled from L_j = W_out h_j, and predicts the target's next hidden state:

    x_j   = fc([RMSNorm(embed(t_{j+1})), RMSNorm(h_j)])          [d]   (Linear 2d -> d)
    x_j  += Attn(RMSNorm(x_j))     RoPE at position j, own KV cache, GQA like the target
    x_j  += SwiGLU(RMSNorm(x_j))
    ĥ_{j+1} = RMSNorm_out(x_j)                                   ≈ h_{j+1}
    logits  = W_out[V'] ĥ_{j+1}                                  ≈ L_{j+1}, the law of t_{j+2}

W_out and embed are the target's, frozen; V' is the head's output vocabulary (the most frequent
tokens of its training data; the others are never proposed). Drafting deeper feeds ĥ_{j+1} back
as the hidden state of position j + 1.

The decoder layer starts as a copy of the target's last layer (and RMSNorm_out as its final
norm). train.py keeps it frozen by default, so that fc learns to write, from (t_{j+1}, h_j), the
residual stream that the target's own last layer turns into h_{j+1}: with the ~40k positions a
2-core machine collects in an hour, training the layer as well overfitted (measured: train acc
0.68, held-out 0.34, against 0.39 held-out with it frozen) at 1.6x the training time.

`MTPHead` is the trainable module (whole windows, several drafting depths at once, see
`forward`); `HeadRunner` serves it one position at a time with a KV cache and int8 weights
(proposers/mtp.py drives it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from homespec.errors import ModelError
from homespec.mtp.weights import TargetShape, TargetWeights


@dataclass(frozen=True)
class HeadConfig:
    d: int  # target n_embd
    n_head: int
    n_kv: int
    head_dim: int
    ff: int  # SwiGLU width
    vocab_out: int  # |V'|
    n_vocab: int  # the target's full vocabulary
    rope_base: float
    eps: float
    window: int  # attention span in positions (training window = serving window)

    @classmethod
    def from_target(cls, s: TargetShape, vocab_out: int, window: int, ff: int | None = None) -> HeadConfig:
        return cls(s.n_embd, s.n_head, s.n_head_kv, s.head_dim, ff or s.n_ff, vocab_out, s.n_vocab,
                   s.rope_base, s.rms_eps, window)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(pos: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim / 2] for integer positions pos [T]."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [hd/2]
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, hd/2]
    return ang.cos().float(), ang.sin().float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX-style rotation (pairs i, i + hd/2), as llama.cpp runs Qwen2. x: [..., T, hd]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MTPHead(nn.Module):
    def __init__(self, cfg: HeadConfig, lm_head: torch.Tensor, vocab_ids: torch.Tensor) -> None:
        """lm_head: the target's output rows for vocab_ids, [V', d] (frozen, not saved)."""
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d, cfg.head_dim
        self.embed_norm = RMSNorm(d, cfg.eps)
        self.hidden_norm = RMSNorm(d, cfg.eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.attn_norm = RMSNorm(d, cfg.eps)
        self.q = nn.Linear(d, cfg.n_head * hd, bias=True)
        self.k = nn.Linear(d, cfg.n_kv * hd, bias=True)
        self.v = nn.Linear(d, cfg.n_kv * hd, bias=True)
        self.o = nn.Linear(cfg.n_head * hd, d, bias=False)
        self.ffn_norm = RMSNorm(d, cfg.eps)
        self.gate = nn.Linear(d, cfg.ff, bias=False)
        self.up = nn.Linear(d, cfg.ff, bias=False)
        self.down = nn.Linear(cfg.ff, d, bias=False)
        self.out_norm = RMSNorm(d, cfg.eps)
        self.register_buffer("lm_head", lm_head.float(), persistent=False)  # [V', d] frozen
        self.register_buffer("vocab_ids", vocab_ids.long())  # [V'] head index -> target token id

    # -- pieces shared by training and serving ----------------------------------------------

    def inputs(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e = embed(t_{j+1}), h = h_j: [..., d] each -> residual stream x_j [..., d]."""
        return self.fc(torch.cat([self.embed_norm(e), self.hidden_norm(h)], dim=-1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, d] -> q [B, H, T, hd], k and v [B, Hkv, T, hd] (q and k rotated)."""
        B, T, _ = x.shape
        c = self.cfg
        xn = self.attn_norm(x)
        q = self.q(xn).view(B, T, c.n_head, c.head_dim).transpose(1, 2)
        k = self.k(xn).view(B, T, c.n_kv, c.head_dim).transpose(1, 2)
        v = self.v(xn).view(B, T, c.n_kv, c.head_dim).transpose(1, 2)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [B, T, d], attn [B, H, T, hd] -> ĥ [B, T, d]: output proj, MLP, final norm."""
        B, T, _ = x.shape
        x = x + self.o(attn.transpose(1, 2).reshape(B, T, -1))
        xn = self.ffn_norm(x)
        x = x + self.down(F.silu(self.gate(xn)) * self.up(xn))
        return self.out_norm(x)

    def logits(self, h_pred: torch.Tensor) -> torch.Tensor:
        """ĥ [..., d] -> logits over V' [..., V']."""
        return h_pred @ self.lm_head.to(h_pred.dtype).T

    # -- training: whole windows, `depth` drafting steps at once -------------------------------

    def forward(self, e: torch.Tensor, h: torch.Tensor, depth: int = 1) -> list[torch.Tensor]:
        """Teacher-forced windows. e[:, p] = embed(t_{p+1}), h[:, p] = h_p: [B, T, d] each.

        Returns ĥ per depth s = 1..depth, each [B, T, d]; at every depth ĥ_s[:, p] predicts
        h_{p+1} (and through W_out, L_{p+1}). Depth s at position p reproduces drafting token s
        at serving time: its hidden input is ĥ_{s-1}[:, p-1] (the head's own prediction), and it
        attends to real keys at positions <= p - s + 1 plus the keys that depths 2..s wrote at
        positions p - s + 2 .. p, exactly as the serving KV cache holds them. Positions p < s - 1
        have no such history and must be masked out of the loss.
        """
        B, T, _ = h.shape
        c = self.cfg
        pos = torch.arange(T)
        cos, sin = rope_tables(pos, c.head_dim, c.rope_base)
        rep = c.n_head // c.n_kv
        idx = pos[:, None] - pos[None, :]  # [T, T] query p minus key position
        outs: list[torch.Tensor] = []
        ks: list[torch.Tensor] = []  # depth r >= 2: keys [B, H, T, hd], aligned by position
        vs: list[torch.Tensor] = []
        k1 = v1 = None
        h_in = h
        for s in range(1, depth + 1):
            x = self.inputs(e, h_in)
            q, k, v = self.qkv(x, cos, sin)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, H, T, hd]
            if s == 1:
                k1, v1 = k, v
            else:
                ks.append(k)
                vs.append(v)
            scale = 1.0 / math.sqrt(c.head_dim)
            real = (q @ k1.transpose(-1, -2)) * scale  # [B, H, T, T]
            real = real.masked_fill(idx < s - 1, float("-inf"))  # real keys at <= p - (s - 1)
            scores = [real]
            vals = []
            for r, (kr, vr) in enumerate(zip(ks, vs), start=2):
                shift = s - r  # depth r's key at position p - (s - r)
                kr_s, vr_s = _shift(kr, shift), _shift(vr, shift)
                scores.append((q * kr_s).sum(-1, keepdim=True) * scale)  # [B, H, T, 1]
                vals.append(vr_s)
            p = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)  # [B, H, T, T + s - 1]
            attn = p[..., :T] @ v1
            for i, vr_s in enumerate(vals):
                attn = attn + p[..., T + i : T + i + 1] * vr_s
            h_pred = self.finish(x, attn)  # [B, T, d]
            outs.append(h_pred)
            h_in = _shift(h_pred, 1)  # depth s + 1 at p reads ĥ_s[:, p - 1]
        return outs

    # -- initialisation ---------------------------------------------------------------------

    def init_from_layer(self, layer: dict[str, np.ndarray], out_norm: np.ndarray) -> None:
        """Copy a target decoder layer (weights.TargetWeights.layer) and its final norm.

        The layer starts as a working transformer block of the right scale; only fc starts
        from scratch. A narrower ff keeps the gate/up rows (and down columns) of the largest norm.
        """
        t = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in layer.items()}
        keep = torch.arange(self.cfg.ff)
        if self.cfg.ff < t["gate"].shape[0]:
            score = t["gate"].norm(dim=1) * t["up"].norm(dim=1) * t["down"].norm(dim=0)
            keep = score.topk(self.cfg.ff).indices.sort().values
        with torch.no_grad():
            for name, mod in (("attn_norm", self.attn_norm), ("ffn_norm", self.ffn_norm)):
                mod.weight.copy_(t[name])
            for name in ("q", "k", "v", "o"):
                getattr(self, name).weight.copy_(t[name])
                if getattr(self, name).bias is not None and f"{name}_bias" in t:
                    getattr(self, name).bias.copy_(t[f"{name}_bias"])
            self.gate.weight.copy_(t["gate"][keep])
            self.up.weight.copy_(t["up"][keep])
            self.down.weight.copy_(t["down"][:, keep])
            self.out_norm.weight.copy_(torch.from_numpy(np.array(out_norm, dtype=np.float32)))


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Move along the position axis (-2) by n: out[..., p, :] = x[..., p - n, :], zeros before."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[..., :n, :])
    return torch.cat([pad, x[..., :-n, :]], dim=-2)




# -- serving ---------------------------------------------------------------------------------


class _Linear:
    """y = x W^T + b with W int8 per output row (torch's weight-only int8 kernel, bf16
    activations): a 4x smaller weight read than float32, which is what a matrix-vector product
    on a CPU pays for. Falls back to float32 where the kernel is missing."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, int8: bool) -> None:
        self.b = None if b is None else b.detach().float()
        self.int8 = int8 and hasattr(torch, "_weight_int8pack_mm")
        w = w.detach().float()
        if self.int8:
            scale = w.abs().amax(1).clamp_min(1e-8) / 127.0  # [out]
            self.w = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in]
            self.scale = scale.bfloat16()
        else:
            self.w = w.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] float32
        if self.int8:
            y = torch._weight_int8pack_mm(x.bfloat16().contiguous(), self.w, self.scale).float()
        else:
            y = x @ self.w.T
        return y if self.b is None else y + self.b


class HeadRunner:
    """The head at serving time: a KV cache over positions [start, end), at most `window` long.

    extend() appends head positions pos0.. (pairs (h_j, t_{j+1})) in one batch and returns the
    prediction of the last one; the earlier ones only write their keys and values, so a batch
    of n positions costs fc + qkv for n rows and the rest of the layer for one.
    """

    def __init__(self, head: MTPHead, embed: Callable[[np.ndarray], np.ndarray], int8: bool = True) -> None:
        c = self.cfg = head.cfg
        self.embed = embed  # token ids [n] -> embeddings [n, d] float32
        self.vocab_ids = head.vocab_ids.numpy()  # [V']
        self.norms = {n: getattr(head, n).weight.detach().float() for n in
                      ("embed_norm", "hidden_norm", "attn_norm", "ffn_norm", "out_norm")}
        lin = lambda m: _Linear(m.weight, m.bias, int8)  # noqa: E731 - a local shorthand
        self.fc, self.q, self.k, self.v, self.o = (lin(getattr(head, n)) for n in ("fc", "q", "k", "v", "o"))
        self.gate_up = _Linear(torch.cat([head.gate.weight, head.up.weight]), None, int8)  # one read
        self.down = lin(head.down)
        self.lm_head = _Linear(head.lm_head, None, int8)  # [V', d]
        self.inv_freq = c.rope_base ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        self.reset()

    @property
    def window(self) -> int:
        return self.cfg.window

    def reset(self, pos: int = 0) -> None:
        c = self.cfg
        self.start = self.end = pos
        self.k_cache = torch.empty(c.n_kv, 0, c.head_dim)  # [Hkv, L, hd]
        self.v_cache = torch.empty(c.n_kv, 0, c.head_dim)

    def truncate(self, pos: int) -> None:
        """Keep cache entries of positions < pos."""
        if pos <= self.start:
            self.reset(pos)
        elif pos < self.end:
            n = pos - self.start
            self.k_cache, self.v_cache = self.k_cache[:, :n], self.v_cache[:, :n]
            self.end = pos

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * self.norms[name]

    @torch.inference_mode()
    def extend(self, hidden: np.ndarray, next_tokens: np.ndarray, pos0: int) -> tuple[np.ndarray, np.ndarray]:
        """hidden [n, d] (h_j for j = pos0..pos0+n-1), next_tokens [n] (t_{j+1}) ->
        (ĥ of the last position [d], its logits over V' [V'])."""
        c = self.cfg
        if pos0 < self.end:
            self.truncate(pos0)
        elif pos0 > self.end:  # a gap: earlier entries would sit at wrong distances
            self.reset(pos0)
        n = hidden.shape[0]
        e = torch.from_numpy(self.embed(np.asarray(next_tokens)))  # [n, d]
        h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))  # [n, d]
        x = self.fc(torch.cat([self._norm("embed_norm", e), self._norm("hidden_norm", h)], -1))  # [n, d]
        xn = self._norm("attn_norm", x)
        ang = torch.arange(pos0, pos0 + n, dtype=torch.float64)[:, None] * self.inv_freq  # [n, hd/2]
        cos, sin = ang.cos().float(), ang.sin().float()
        k = rope(self.k(xn).view(n, c.n_kv, c.head_dim).transpose(0, 1), cos, sin)  # [Hkv, n, hd]
        v = self.v(xn).view(n, c.n_kv, c.head_dim).transpose(0, 1)
        self.k_cache = torch.cat([self.k_cache, k], 1)[:, -c.window :]
        self.v_cache = torch.cat([self.v_cache, v], 1)[:, -c.window :]
        self.end = pos0 + n
        self.start = self.end - self.k_cache.shape[1]
        # Only the last position's output is needed: the rest were written for their K/V.
        xl, xnl = x[-1:], xn[-1:]  # [1, d]
        q = rope(self.q(xnl).view(1, c.n_head, c.head_dim).transpose(0, 1), cos[-1:], sin[-1:])  # [H, 1, hd]
        rep = c.n_head // c.n_kv
        kk = self.k_cache.repeat_interleave(rep, 0)  # [H, L, hd]
        vv = self.v_cache.repeat_interleave(rep, 0)
        p = torch.softmax((q @ kk.transpose(1, 2)) / math.sqrt(c.head_dim), -1)  # [H, 1, L]
        attn = (p @ vv).transpose(0, 1).reshape(1, -1)  # [1, H * hd]
        xl = xl + self.o(attn)
        xn2 = self._norm("ffn_norm", xl)
        gu = self.gate_up(xn2)  # [1, 2 ff]
        xl = xl + self.down(F.silu(gu[:, : c.ff]) * gu[:, c.ff :])
        h_pred = self._norm("out_norm", xl)  # [1, d]
        logits = self.lm_head(h_pred)  # [1, V']
        return h_pred[0].numpy(), logits[0].numpy()


# -- checkpoint ------------------------------------------------------------------------------

FORMAT = "homespec-mtp/1"


def meta_path(path: Path) -> Path:
    """models/x.mtp.safetensors -> models/x.mtp.json (config, data digest, metrics)."""
    return Path(path).with_suffix(".json")


def save_head(head: MTPHead, path: Path, meta: dict) -> None:
    """Trained weights (float32) and vocab_ids to .safetensors, meta to the .json beside it.

    The frozen output rows are not saved: load_head reads them from the target's GGUF, so a head
    cannot silently run against a target it was not trained for (the shapes are checked).
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in head.state_dict().items()}
    full = {"format": FORMAT, "config": head.cfg.to_dict(), **meta}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "config": json.dumps(head.cfg.to_dict())})
    os.replace(tmp, path)
    tmp_meta = meta_path(path).with_name(meta_path(path).name + ".tmp")
    tmp_meta.write_text(json.dumps(full, indent=2, default=str) + "\n")
    os.replace(tmp_meta, meta_path(path))


def load_head(path: Path, target: TargetWeights) -> MTPHead:
    """A trained head with its frozen output rows dequantised from the target's GGUF."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"MTP head {path} not found (train one with `homespec train-mtp`)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ModelError(f"{path}: not a homespec MTP head (format {meta.get('format')!r}, expected {FORMAT})")
    cfg = HeadConfig(**json.loads(meta["config"]))
    s = target.shape
    if (cfg.d, cfg.n_vocab, cfg.n_head, cfg.n_kv, cfg.head_dim) != (s.n_embd, s.n_vocab, s.n_head, s.n_head_kv, s.head_dim):
        raise ModelError(f"{path}: head was trained for another target (n_embd {cfg.d}, vocab {cfg.n_vocab}), "
                         f"not {target.path.name} (n_embd {s.n_embd}, vocab {s.n_vocab})")
    tensors = load_file(str(path))
    vocab_ids = tensors["vocab_ids"]
    head = MTPHead(cfg, torch.from_numpy(target.output(vocab_ids.numpy())), vocab_ids)
    head.load_state_dict(tensors, strict=True)
    return head.eval()
