"""Training the MTP head on collected chunks (collect.py): data, loss, loop, checkpoint.

Training pairs, for every position p of a chunk with a successor (the one-position shift:
t_{p+1} was sampled from L_p, which came from h_p):

    inputs   h_p, embed(t_{p+1})
    labels   L_{p+1} (top-k log-probabilities, over the full vocabulary) and h_{p+1}

    loss = sum_s w_s * [ CE(q_s, p_target) + REG_WEIGHT * SmoothL1(ĥ_s, h_{p+1}) ] / sum_s w_s

CE is the cross-entropy to the target's next-token distribution restricted to the head's
vocabulary V' (its top-k, renormalised over V'); the regression term keeps ĥ close to the real
hidden state, which deeper drafting feeds back (EAGLE). Depth s > 1 is trained on the head's own
ĥ, as serving will feed it (MTPHead.forward).

Token accuracy = P(argmax q == the target's argmax): greedy acceptance, per depth, teacher-forced.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from homespec.mtp.collect import chunk_paths, data_digest, load_record
from homespec.mtp.model import HeadConfig, MTPHead, load_head, meta_path, save_head
from homespec.mtp.weights import TargetWeights

# Hidden-state regression next to the cross-entropy. EAGLE weighs its feature loss 10x its token
# loss; here tokens are the goal and depth 2 is trained end to end, so the regression is a helper.
REG_WEIGHT = 0.3
DEPTH_DECAY = 0.5  # weight of depth s is DEPTH_DECAY ** (s - 1): the first draft matters most


@dataclass(frozen=True)
class TrainConfig:
    vocab: int = 16_384  # |V'|: the most frequent output tokens of the data (0 = full vocabulary)
    # Measured on 19k positions (2 cores): the fc alone learns fastest; training the copied
    # layer too (lr 1e-4) overfits (train acc 0.68, val 0.34 vs frozen: val 0.39) at 1.6x the cost.
    epochs: float = 6.0
    lr: float = 1e-3
    weight_decay: float = 0.01
    seq: int = 128  # window in positions = the head's attention span at serving time
    batch: int = 4  # windows per step: small data wants more, smaller steps
    depth: int = 2
    ff: int | None = None  # SwiGLU width; None = the target's
    init_layer: int | None = -1  # target layer to start from (-1 = last); None = random
    val_every: int = 10  # about one chunk in val_every is held out (by name: stable as data grows)
    layer_lr: float | None = 0.0  # learning rate of the decoder layer (None = lr, 0 = frozen)
    seed: int = 0
    threads: int | None = None
    dtype: str = "auto"  # "auto" measures bfloat16 against float32 matmuls and takes the faster


@dataclass
class Data:
    """All chunks in memory, positions concatenated; windows never cross a chunk."""

    tokens: np.ndarray  # [N] int32
    hidden: np.ndarray  # [N, d] float16
    top_ids: np.ndarray  # [N, K] int32
    top_logp: np.ndarray  # [N, K] float32
    starts: list[int]  # first position of each chunk
    names: list[str]  # chunk file stems

    def windows(self, chunks: list[int], seq: int) -> list[tuple[int, int]]:
        """(first position, positions used) per window: seq inputs plus their successors."""
        out = []
        ends = self.starts[1:] + [len(self.tokens)]
        for c in chunks:
            s, e = self.starts[c], ends[c]
            for w in range(s, e - 1, seq):
                out.append((w, min(seq + 1, e - w)))
        return out


def load_data(data_dir: Path) -> Data:
    paths = chunk_paths(data_dir)
    if not paths:
        raise FileNotFoundError(f"no chunks in {data_dir}: run `homespec train-mtp --collect-only` first")
    recs = [load_record(p) for p in paths]
    starts = list(np.cumsum([0] + [len(r.tokens) for r in recs[:-1]]))
    return Data(
        np.concatenate([r.tokens for r in recs]),
        np.concatenate([r.hidden for r in recs]),
        np.concatenate([r.top_ids for r in recs]),
        np.concatenate([r.top_logp for r in recs]),
        [int(s) for s in starts],
        [p.stem for p in paths],
    )


def choose_vocab(data: Data, chunks: list[int], n: int, n_vocab: int) -> np.ndarray:
    """The n tokens the target most often predicts (its argmax) or emits in the training chunks,
    sorted by id. Tokens outside are never proposed; exactness does not depend on it."""
    ends = data.starts[1:] + [len(data.tokens)]
    counts = np.zeros(n_vocab, dtype=np.int64)
    for c in chunks:
        s, e = data.starts[c], ends[c]
        np.add.at(counts, data.top_ids[s:e, 0], 2)  # the labels that matter for greedy acceptance
        np.add.at(counts, data.tokens[s:e], 1)
    if n <= 0 or n >= n_vocab:
        return np.arange(n_vocab, dtype=np.int64)
    order = np.argsort(-counts, kind="stable")[:n]
    return np.sort(order).astype(np.int64)


class Batches:
    """Turns windows into tensors: inputs (e, h) [B, T, d], labels and masks [B, T(, K)]."""

    def __init__(self, data: Data, embed_rows: np.ndarray, embed_index: np.ndarray, full2red: np.ndarray) -> None:
        self.data, self.embed_rows, self.embed_index, self.full2red = data, embed_rows, embed_index, full2red

    def make(self, wins: list[tuple[int, int]], seq: int) -> dict[str, torch.Tensor]:
        d = self.data
        B, K, D = len(wins), d.top_ids.shape[1], d.hidden.shape[1]
        h = np.zeros((B, seq, D), np.float32)
        h_next = np.zeros((B, seq, D), np.float32)
        e = np.zeros((B, seq, D), np.float32)
        ids = np.full((B, seq, K), -1, np.int64)
        logp = np.full((B, seq, K), -np.inf, np.float32)
        mask = np.zeros((B, seq), bool)
        for b, (w, n) in enumerate(wins):
            t = n - 1  # pairs in this window
            h[b, :t] = d.hidden[w : w + t]
            h_next[b, :t] = d.hidden[w + 1 : w + n]
            e[b, :t] = self.embed_rows[self.embed_index[d.tokens[w + 1 : w + n]]]
            ids[b, :t] = self.full2red[d.top_ids[w + 1 : w + n]]
            logp[b, :t] = d.top_logp[w + 1 : w + n]
            mask[b, :t] = True
        return {k: torch.from_numpy(v) for k, v in
                dict(h=h, h_next=h_next, e=e, ids=ids, logp=logp, mask=mask).items()}


def head_loss(head: MTPHead, batch: dict[str, torch.Tensor], depth: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The training objective and its parts (ce_s, reg_s, acc_s per depth)."""
    outs = head(batch["e"], batch["h"], depth)
    ids, mask = batch["ids"], batch["mask"]  # [B, T, K] reduced ids (-1: outside V'), [B, T]
    p = torch.where(ids >= 0, batch["logp"].exp(), torch.zeros(()))  # [B, T, K] target mass in V'
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    top1 = ids[..., 0]  # [B, T] the target's argmax (-1 if outside V': counts as a miss)
    total, weights, parts = torch.zeros(()), 0.0, {}
    T = mask.shape[1]
    for s, h_pred in enumerate(outs, start=1):
        valid = mask & (torch.arange(T) >= s - 1)  # [B, T] depth s needs s - 1 earlier positions
        valid = valid & (p.sum(-1) > 0)  # some target mass inside V'
        n = valid.sum().clamp_min(1)
        logq = F.log_softmax(head.logits(h_pred).float(), -1)  # [B, T, V']
        ce = -(p * logq.gather(-1, ids.clamp_min(0))).sum(-1)  # [B, T]
        reg = F.smooth_l1_loss(h_pred.float(), batch["h_next"], reduction="none").mean(-1)  # [B, T]
        ce_s, reg_s = (ce * valid).sum() / n, (reg * valid).sum() / n
        w = DEPTH_DECAY ** (s - 1)
        total = total + w * (ce_s + REG_WEIGHT * reg_s)
        weights += w
        acc_valid = mask & (torch.arange(T) >= s - 1)
        hit = (logq.argmax(-1) == top1) & acc_valid
        parts[f"ce{s}"], parts[f"reg{s}"] = ce_s.item(), reg_s.item()
        parts[f"acc{s}"] = float(hit.sum()) / max(1, int(acc_valid.sum()))
    return total / weights, parts


LAYER = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")  # copied from the target


def make_optimizer(head: MTPHead, tc: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; the decoder layer, initialised from the target's, may learn slower or not at all."""
    layer = [p for n, p in head.named_parameters() if n.split(".")[0] in LAYER]
    rest = [p for n, p in head.named_parameters() if n.split(".")[0] not in LAYER]
    layer_lr = tc.lr if tc.layer_lr is None else tc.layer_lr
    for p in layer:
        p.requires_grad_(layer_lr > 0)
    groups = [{"params": rest, "lr": tc.lr, "base_lr": tc.lr}]
    if layer_lr > 0:
        groups.append({"params": layer, "lr": layer_lr, "base_lr": layer_lr})
    return torch.optim.AdamW(groups, weight_decay=tc.weight_decay, betas=(0.9, 0.95))


def pick_dtype(setting: str) -> torch.dtype:
    """bfloat16 autocast where the CPU runs it fast (AMX, AVX512-BF16: measured ~6x float32
    here), float32 where bfloat16 is emulated (plain AVX2)."""
    if setting in ("float32", "bfloat16"):
        return getattr(torch, setting)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)

    def timed(x: torch.Tensor, y: torch.Tensor) -> float:
        x @ y
        t = time.perf_counter()
        for _ in range(3):
            x @ y
        return time.perf_counter() - t

    return torch.bfloat16 if timed(a.bfloat16(), b.bfloat16()) < 0.7 * timed(a, b) else torch.float32


@dataclass
class TrainResult:
    steps: int
    seconds: float
    train: dict[str, float] = field(default_factory=dict)  # last logged training figures
    val: dict[str, float] = field(default_factory=dict)


def evaluate(head: MTPHead, batches: Batches, wins: list[tuple[int, int]], tc: TrainConfig, dtype: torch.dtype) -> dict[str, float]:
    """Mean loss parts over the validation windows, weighted by window size."""
    head.eval()
    sums: dict[str, float] = {}
    total = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for i in range(0, len(wins), tc.batch):
            chunk = wins[i : i + tc.batch]
            _, parts = head_loss(head, batches.make(chunk, tc.seq), tc.depth)
            n = sum(w[1] - 1 for w in chunk)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v * n
            total += n
    head.train()
    return {k: v / max(total, 1) for k, v in sums.items()}


def _bar(frac: float, width: int = 24) -> str:
    done = int(round(frac * width))
    return "[" + "#" * done + "." * (width - done) + "]"


def lr_scale(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    f = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, f)))


@dataclass
class _Setup:
    """Everything the loop needs, built once: data, head, optimiser, metadata."""

    data: Data
    batches: Batches
    head: MTPHead
    opt: torch.optim.Optimizer
    train_wins: list[tuple[int, int]]
    val_wins: dict[str, list[tuple[int, int]]]  # "" = all held-out chunks, "chat", "code"
    step0: int
    meta: dict


def _prepare(target: Path, data_dir: Path, out: Path, tc: TrainConfig, resume: bool,
             log: Callable[[str], None]) -> _Setup:
    tw = TargetWeights(target)
    data = load_data(data_dir)
    val_chunks = [c for c, name in enumerate(data.names) if zlib.crc32(name.encode()) % tc.val_every == 0]
    train_chunks = [c for c in range(len(data.names)) if c not in set(val_chunks)] or val_chunks
    old = load_head(out, tw) if resume and out.is_file() else None
    # A resumed head keeps its vocabulary even when more data has been collected since.
    vocab_ids = old.vocab_ids.numpy() if old is not None else choose_vocab(data, train_chunks, tc.vocab, tw.shape.n_vocab)
    full2red = np.full(tw.shape.n_vocab, -1, np.int64)  # [n_vocab] target id -> head index
    full2red[vocab_ids] = np.arange(len(vocab_ids))
    used = np.unique(data.tokens)  # input embeddings: only the tokens the data holds
    embed_index = np.zeros(tw.shape.n_vocab, np.int64)
    embed_index[used] = np.arange(len(used))
    batches = Batches(data, tw.embed(used), embed_index, full2red)
    cover = float(np.mean(full2red[data.top_ids[:, 0]] >= 0))
    log(f"train: {len(data.tokens)} positions in {len(data.names)} chunks ({len(val_chunks)} held out); "
        f"output vocabulary {len(vocab_ids)} tokens covers {cover:.3f} of the target's argmax labels")

    cfg = HeadConfig.from_target(tw.shape, len(vocab_ids), tc.seq, tc.ff)
    head = MTPHead(cfg, torch.from_numpy(tw.output(vocab_ids)), torch.from_numpy(vocab_ids))
    if old is not None:
        if old.cfg != cfg:
            raise ValueError(f"{out} was trained with another configuration; train afresh without --resume")
        head.load_state_dict(old.state_dict())
        log(f"train: resuming from {out}")
    elif tc.init_layer is not None:
        head.init_from_layer(tw.layer(tc.init_layer % tw.shape.n_layer), tw.output_norm())
    opt = make_optimizer(head, tc)
    step0 = 0
    state = _state_path(out)
    if old is not None and state.is_file():
        st = torch.load(state, weights_only=False)
        opt.load_state_dict(st["optimizer"])
        step0 = int(st["step"])
    kind = lambda c: data.names[c].split("-")[0]  # noqa: E731 - chunk index -> "chat" | "code"
    val_wins = {"": data.windows(val_chunks, tc.seq)}
    for k in ("chat", "code"):
        val_wins[k] = data.windows([c for c in val_chunks if kind(c) == k], tc.seq)
    meta = {
        "target": target.name,
        "target_bytes": target.stat().st_size,
        "data_dir": str(data_dir),
        "data_digest": data_digest(data_dir),
        "data_positions": int(len(data.tokens)),
        "data_chunks": {k: sum(kind(c) == k for c in range(len(data.names))) for k in ("chat", "code")},
        "val_chunks": [data.names[c] for c in val_chunks],
        "vocab_coverage": cover,
        "train_config": asdict(tc),
        "torch": torch.__version__,
    }
    return _Setup(data, batches, head, opt, data.windows(train_chunks, tc.seq), val_wins, step0, meta)


def _state_path(out: Path) -> Path:
    return out.with_name(out.name + ".train-state.pt")  # optimiser state, for --resume


def train(target: Path, data_dir: Path, out: Path, tc: TrainConfig = TrainConfig(), *, resume: bool = False,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train a head on the chunks in data_dir; checkpoint the best epoch (by held-out accuracy
    at the first position) to `out`, the optimiser after every epoch."""
    t0 = time.perf_counter()
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    s = _prepare(target, data_dir, out, tc, resume, log)
    head, opt = s.head, s.opt
    steps_per_epoch = max(1, math.ceil(len(s.train_wins) / tc.batch))
    total_steps = max(1, int(round(tc.epochs * steps_per_epoch)))
    warmup = min(50, total_steps // 10 + 1)
    dtype = pick_dtype(tc.dtype)
    log(f"train: {len(s.train_wins)} windows of {tc.seq}, {total_steps} steps of {tc.batch}, depth {tc.depth}, "
        f"{dtype}, {torch.get_num_threads()} threads")
    result = TrainResult(s.step0, 0.0)
    best, ema, positions, t_loop = -1.0, {}, 0, time.perf_counter()
    order = rng.permutation(len(s.train_wins))
    head.train()
    for step in range(s.step0, total_steps):
        i = (step % steps_per_epoch) * tc.batch
        if i == 0 and step > s.step0:
            order = rng.permutation(len(s.train_wins))
        wins = [s.train_wins[j] for j in order[i : i + tc.batch]]
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * lr_scale(step, total_steps, warmup)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss, parts = head_loss(head, s.batches.make(wins, tc.seq), tc.depth)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        positions += sum(w[1] - 1 for w in wins)
        parts["loss"] = loss.item()
        for k, v in parts.items():
            ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
        done = step + 1
        if done % 10 == 0 or done == total_steps:
            rate = positions / max(time.perf_counter() - t_loop, 1e-9)
            eta = (total_steps - done) * tc.batch * tc.seq / max(rate, 1e-9)
            accs = " ".join(f"acc{d} {ema[f'acc{d}']:.3f}" for d in range(1, tc.depth + 1))
            log(f"  {_bar(done / total_steps)} step {done}/{total_steps} loss {ema['loss']:.3f} "
                f"ce1 {ema['ce1']:.3f} {accs} | {rate:.0f} pos/s, eta {eta / 60:.1f} min")
        if done % steps_per_epoch and done != total_steps:
            continue
        # End of an epoch: held-out figures (all, and per corpus part), checkpoint if best.
        val = {}
        for part, wins_v in s.val_wins.items():
            if wins_v:
                val.update({(f"{part}_" if part else "") + k: v for k, v in evaluate(head, s.batches, wins_v, tc, dtype).items()})
        result.train, result.val, result.steps = dict(ema), val, done
        log("  val: " + " ".join(f"{k} {val[k]:.3f}" for k in sorted(val) if "reg" not in k))
        score = val.get("acc1", ema.get("acc1", 0.0))
        if score >= best:
            best = score
            result.seconds = time.perf_counter() - t0
            save_head(head, out, {**s.meta, "steps": done, "epochs_done": done / steps_per_epoch,
                                  "train_metrics": result.train, "val_metrics": val, "train_seconds": result.seconds})
            log(f"  saved {out} (val acc1 {score:.3f})")
        torch.save({"optimizer": opt.state_dict(), "step": done}, _state_path(out))
    result.seconds = time.perf_counter() - t0
    log(f"train: {result.steps} steps in {result.seconds / 60:.1f} min; meta in {meta_path(out)}")
    return result


def read_meta(out: Path) -> dict:
    """The JSON written beside a checkpoint (config, data digest, metrics)."""
    import json

    return json.loads(meta_path(out).read_text())
