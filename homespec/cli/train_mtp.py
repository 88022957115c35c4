"""`homespec train-mtp`: collect the target's hidden states, train the MTP head, validate it.

Three phases, each resumable, each skippable:
  1. collect   run the target over the corpus (self-distilled chat answers + stdlib code) and
               store hidden states and next-token top-k in chunks under --data
  2. train     fit the head on the chunks; checkpoint to --out (+ a .json beside it)
  3. validate  greedy acceptance per draft position through the real engine with the `mtp`
               proposer, on held-out code prompts

Collection is the slow part on a CPU (a target pass per ~17 tokens of code, one per token of
answer). On a busy machine run it with one thread per process; two processes with disjoint
--kinds may fill the same --data folder at the same time.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from homespec.cli.common import add_config_argument, config_path

if TYPE_CHECKING:
    from homespec.speculation.engine import StepTally


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument("--data", type=Path, default=None, help="chunk folder (default models/<target>.mtp-data)")
    p.add_argument("--out", type=Path, default=None, help="head checkpoint (default models/<target>.mtp.safetensors)")
    p.add_argument("--tokens", type=int, default=60_000, help="collection budget in target positions (default 60000)")
    p.add_argument("--kinds", default="chat,code", help="corpus parts to collect: chat (self-distilled), code (stdlib)")
    p.add_argument("--max-answer", type=int, default=192, help="tokens per self-distilled answer (default 192)")
    p.add_argument("--resume", action="store_true", help="keep collected chunks and continue training from --out")
    p.add_argument("--fresh", action="store_true", help="delete collected chunks of --kinds and start over")
    phase = p.add_mutually_exclusive_group()
    phase.add_argument("--collect-only", action="store_true", help="stop after collecting")
    phase.add_argument("--skip-collect", action="store_true", help="train on the chunks already collected")
    phase.add_argument("--validate-only", action="store_true", help="only measure acceptance of --out")
    p.add_argument("--vocab", type=int, default=16_384, help="output vocabulary: most frequent N tokens (0 = all)")
    p.add_argument("--epochs", type=float, default=6.0, help="passes over the training chunks (default 6)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default 1e-3)")
    p.add_argument("--seq", type=int, default=128, help="training window in positions (the head's attention span)")
    p.add_argument("--batch", type=int, default=4, help="windows per optimiser step (default 4)")
    p.add_argument("--layer-lr", type=float, default=0.0,
                   help="learning rate of the decoder layer copied from the target (default 0: frozen, only fc and norms learn)")
    p.add_argument("--depth", type=int, default=2, help="drafting depth trained (2: also learn from its own hidden)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for llama.cpp and torch (default: cores)")
    p.add_argument("--no-validate", action="store_true", help="skip the acceptance measurement")
    p.add_argument("--k", type=int, default=4, help="draft length for validation (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per validation prompt (default 128)")


def main(args: argparse.Namespace) -> int:
    from homespec.config import load_config
    from homespec.errors import UserError
    from homespec.models.fetch import resolve_model_path

    cfg = load_config(config_path(args.config))
    target = resolve_model_path(cfg, cfg.models.target)
    data = args.data or target.with_name(target.stem + ".mtp-data")
    out = args.out or target.with_name(target.stem + ".mtp.safetensors")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not set(kinds) <= {"chat", "code"}:
        raise UserError(f"--kinds takes chat and/or code, got {args.kinds!r}")
    t_start = time.perf_counter()
    if not (args.skip_collect or args.validate_only):
        _collect(args, cfg, target, data, kinds)
        if args.collect_only:
            return 0
    if importlib.util.find_spec("torch") is None:
        raise UserError("training and validating the MTP head need torch: pip install 'homespec[mtp]' "
                        "(--collect-only works without it)")
    if not args.validate_only:
        _train(args, target, data, out)
    if not args.no_validate:
        _validate(args, cfg, target, out)
    print(f"train-mtp: done in {(time.perf_counter() - t_start) / 60:.1f} min", file=sys.stderr)
    return 0


def _collect(args: argparse.Namespace, cfg, target: Path, data: Path, kinds: tuple[str, ...]) -> None:
    from homespec.errors import UserError
    from homespec.llama.runtime import Runtime, RuntimeOptions
    from homespec.mtp.collect import chunk_paths, collect

    existing = [p for p in chunk_paths(data) if p.stem.split("-")[0] in kinds] if data.exists() else []
    if existing and not (args.resume or args.fresh):
        raise UserError(f"{data} already holds {len(existing)} chunks: pass --resume to keep them or --fresh to start over")
    opts = RuntimeOptions(n_ctx=1024, n_batch=512, n_threads=args.threads, embeddings=True)
    rt = Runtime(target, opts)
    print(f"collect: {target.name} -> {data} (budget {args.tokens} positions, kinds {','.join(kinds)})", file=sys.stderr)

    def progress(key: str, total: int, budget: int, rate: float) -> None:
        print(f"  {key}: {total}/{budget} positions, {rate:.1f} positions/s", file=sys.stderr, flush=True)

    try:
        s = collect(rt, data, args.tokens, kinds=kinds, resume=not args.fresh, max_answer=args.max_answer,
                    progress=progress)
    finally:
        rt.close()
    print(f"collect: {s.items} chunks, {s.tokens} positions ({s.new_tokens} new) in {s.seconds / 60:.1f} min", file=sys.stderr)


def _train(args: argparse.Namespace, target: Path, data: Path, out: Path) -> None:
    from homespec.mtp.train import TrainConfig, train

    tc = TrainConfig(
        vocab=args.vocab, epochs=args.epochs, lr=args.lr, layer_lr=args.layer_lr, seq=args.seq, batch=args.batch,
        depth=args.depth,
        threads=args.threads,
    )
    train(target, data, out, tc, resume=args.resume, log=lambda s: print(s, file=sys.stderr, flush=True))


def _validate(args: argparse.Namespace, cfg, target: Path, out: Path) -> None:
    from homespec.mtp.collect import HELDOUT_PROMPTS

    print(f"validate: {out.name} on {len(HELDOUT_PROMPTS)} held-out code prompts, greedy, k={args.k}", file=sys.stderr)
    tally, tokens = measure_acceptance(target, out, HELDOUT_PROMPTS, k=args.k, max_tokens=args.max_tokens, threads=args.threads)
    print(format_acceptance(tally, tokens, args.k), file=sys.stderr)


def format_acceptance(tally: StepTally, tokens: int, k: int) -> str:
    """Greedy acceptance per draft position, as StepTally summed it over the validation run."""
    f = lambda x: "   —" if x is None else f"{x:.3f}"  # noqa: E731 - table cell
    tries = tally.pos_tries + [0] * (k - len(tally.pos_tries))  # [k] steps that reached position i
    hits = tally.pos_hits + [0] * (k - len(tally.pos_hits))  # [k] of those, accepted
    conditional = [h / n if n else None for h, n in zip(hits, tries)]  # a_i
    absolute = [h / tally.steps if tally.steps else 0.0 for h in hits]  # what a step gains at position i
    lines = [
        "  position      " + " ".join(f"{i + 1:>6}" for i in range(k)),
        "  a_i (cond.)   " + " ".join(f"{f(x):>6}" for x in conditional),
        "  P(accepted)   " + " ".join(f"{f(x):>6}" for x in absolute),
        "  tested        " + " ".join(f"{n:>6}" for n in tries),
        f"  {tally.steps} steps, {tokens} tokens, acceptance length {tally.acceptance_length or 0:.2f}, "
        f"draft {tally.draft_s * 1000 / max(tally.proposed, 1):.1f} ms per proposed token, "
        f"verify {tally.verify_s * 1000 / max(tally.steps, 1):.0f} ms per step",
    ]
    return "\n".join(lines)


def chat_tokens(rt, user: str, system: str | None) -> list[int]:
    from homespec.llama.template import ChatTemplate

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return rt.tokenize(ChatTemplate(rt.chat_template).render(messages), add_special=False, parse_special=True)


def measure_acceptance(target: Path, head: Path, prompts: list[str], *, k: int = 4, max_tokens: int = 128,
                       threads: int | None = None) -> tuple[StepTally, int]:
    """Greedy generation with the head at a fixed k on each prompt: (the steps, output tokens)."""
    from homespec.llama.runtime import Runtime, RuntimeOptions
    from homespec.mtp.checkpoint import head_window, open_head
    from homespec.mtp.collect import CODE_SYSTEM
    from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats, StepTally
    from homespec.speculation.proposers.mtp import MTPProposer

    rt = Runtime(target, RuntimeOptions(n_ctx=2048, n_threads=threads, hidden_window=head_window(head)))
    try:
        policy = FixedPolicy(MTPProposer(rt, open_head(rt, head, target, threads=threads)), k)
        engine, tally, tokens = Engine(rt), StepTally(), 0
        for text in prompts:
            rt.reset()
            st = GenerationStats()
            for ev in engine.generate(chat_tokens(rt, text, CODE_SYSTEM), max_tokens=max_tokens, policy=policy, stats=st):
                if ev.step is not None:
                    tally.add(ev.step)
            tokens += st.completion_tokens
        return tally, tokens
    finally:
        rt.close()
