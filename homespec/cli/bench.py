"""`homespec bench`: speedup of each proposer and k against plain decoding, measured here."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from homespec.cli.common import add_config_argument, config_path, positive_int
from homespec.errors import UserError

WORKLOADS = ("code", "edit", "chat", "json", "fim")  # serving/bench.py's, without importing it at parse time


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument("--quick", action="store_true", help="one prompt per workload, short outputs (< 3 min)")
    p.add_argument("--workload", action="append", choices=WORKLOADS, help="repeatable; default: all")
    p.add_argument("--arms", default=None, help="e.g. 'off,reference,draft:2,ngram:4,auto' (default: all)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="output tokens per run (default 128, quick 48)")
    p.add_argument("--prompts", type=positive_int, default=None, help="prompts per workload (default 3, quick 1)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every prompt this many times (arms in alternating order)")
    p.add_argument("--json", type=Path, default=None, help="write results here (default bench-results/<time>.json)")
    p.add_argument("--no-reference", action="store_true", help="skip llama-cpp-python's own create_completion arm")
    p.add_argument("--peer", choices=("llama-server",), default=None,
                   help="add llama-server arms (same llama.cpp, built for this CPU once and cached): plain, "
                        "ngram-simple, ngram-mod and the draft model, on the same prompts")
    p.add_argument("--peer-bin", type=Path, default=None, help="run this llama-server instead of building one")
    p.add_argument("--peer-settings", default=None, help="e.g. 'plain,ngram-mod' (default: all)")


def main(args: argparse.Namespace) -> int:
    from homespec.config import load_config
    from homespec.llama.runtime import ReferenceDecoder
    from homespec.models.loader import runtime_options
    from homespec.serving.bench import default_arms, load_workloads, parse_arms, peer_arms, run_bench
    from homespec.serving.host import Host
    from homespec.serving.peer import LlamaServer, peer_settings, select_settings

    cfg = load_config(config_path(args.config))
    peer_bin = _peer_binary(args) if args.peer else None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per peer request drowns the progress
    max_tokens = args.max_tokens or (48 if args.quick else 128)
    prompts = args.prompts or (1 if args.quick else 3)
    workloads = load_workloads(args.workload or WORKLOADS)
    with Host.open(cfg) as session, ExitStack() as peers_open:
        names = session.proposers
        arms = parse_arms(args.arms) if args.arms else default_arms(names, reference=not args.no_reference)
        reference = None
        if any(a.mode == "reference" for a in arms):
            reference = ReferenceDecoder(session.models.target_path, runtime_options(cfg, cfg.models.target.n_gpu_layers))
        peers = {}
        if peer_bin is not None:
            settings = select_settings(args.peer_settings, peer_settings(session.models.draft_path))
            target = session.models.target
            for s in settings:
                print(f"  starting llama-server ({s.name})", file=sys.stderr)
                peers[s.name] = peers_open.enter_context(
                    LlamaServer(peer_bin, session.models.target_path, s, target.n_ctx, target.n_threads))
            arms = [*arms, *peer_arms(settings)]
        t0 = time.perf_counter()
        report = run_bench(
            session, workloads, arms, max_tokens, prompts, reference,
            progress=lambda s: print(f"  {s}", file=sys.stderr), rounds=args.rounds, peers=peers,
        )
        if reference is not None:
            reference.close()
    print(format_report(report))
    print(f"\nbench took {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    out = args.json or Path("bench-results") / time.strftime("bench-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.to_json())
    print(f"results: {out}", file=sys.stderr)
    return 0


def _peer_binary(args: argparse.Namespace) -> Path:
    from homespec.serving import peer_build

    if args.peer_bin is not None:
        if not (args.peer_bin.is_file() and os.access(args.peer_bin, os.X_OK)):
            raise UserError(f"--peer-bin: {args.peer_bin} is not an executable file")
        return args.peer_bin
    return peer_build.build(log=lambda s: print(f"  {s}", file=sys.stderr))


def _f(x: float | None, fmt: str) -> str:
    width = int(fmt.split(".")[0] or 0)
    return "—".rjust(width) if x is None else format(x, fmt)


def _ceilings(calibration: dict[str, dict[str, float]]) -> str:
    """What each proposer could give at most on this machine's cost curve: prompt lookup costs
    microseconds, a model proposer its calibrated seconds per token (costs.ceiling)."""
    from homespec.speculation.costs import ceiling

    curve = {int(n): float(s) for n, s in calibration["target"].items()}
    per_token = {"ngram": 0.0, **{p: float(c["1"]) for p, c in calibration.items() if p != "target"}}
    parts = []
    for p, c in per_token.items():
        k, gain = ceiling(curve, c)
        parts.append(f"{p} {gain:.2f}x" + (f" (k={k})" if k else " (off)"))
    return ", ".join(parts)


def _by_round(rows: list, plain) -> str:  # rows: bench.ArmResult
    """tok/s (and ÷ off) of each arm with each prompt asked the first time and asked again: the
    two say different things (a memory of answers drafts the repeats whole), so neither hides in
    the mean."""
    def at(r, i: int) -> str:
        t, base = r.round_tok_s(i), plain.round_tok_s(i)
        ratio = f" ({t / base:.2f}x)" if t and base and r is not plain else ""
        return f"{_f(t, '.1f')}{ratio}"

    again = range(1, len(plain.by_round))
    parts = [f"{r.arm} {at(r, 0)} / " + " / ".join(at(r, i) for i in again) for r in rows if r.by_round]
    return "asked first / again, tok/s (÷ off): " + "; ".join(parts)


def format_report(report) -> str:  # report: bench.BenchReport
    c = report.config
    cal = report.calibration.get("target", {})
    lines = [
        f"target {c['target']}, draft {c['draft']}; {c['max_tokens']} output tokens per run, greedy; "
        f"{report.machine['cpu_threads']} threads",
        "target pass cost (ms): " + ", ".join(f"n={n} {float(s) * 1000:.0f}" for n, s in cal.items()),
    ]
    if "draft" in report.calibration:
        lines.append(f"draft pass cost: {float(report.calibration['draft']['1']) * 1000:.0f} ms/token")
    if cal:
        lines.append(f"ceiling, every drafted token accepted: {_ceilings(report.calibration)}")
    header = (
        f"{'arm':<15} {'tok/s':>6} {'speedup':>7} {'exp.':>5} {'acc.rate':>8} {'acc.len':>7} "
        f"{'TTFT s':>6} {'draft ms':>8} {'verify ms':>9} {'RSS MiB':>7} {'=off':>6}  chosen"
    )
    by_wl: dict[str, list] = {}
    for r in report.results:
        by_wl.setdefault(r.workload, []).append(r)
    for wl, rows in by_wl.items():
        lines += ["", f"== {wl} (target prefill {report.prefill.get(wl, 0):.0f} tok/s)", header]
        for r in rows:
            ttft = sum(r.ttft_s) / len(r.ttft_s) if r.ttft_s else None
            chosen = ", ".join(f"{k}×{v}" for k, v in sorted(r.tally.by_choice.items(), key=lambda kv: -kv[1])[:4]) if r.arm == "auto" else ""
            same = f"{r.same_as_plain}/{r.runs}" if r.arm != "off" else ""
            tok_s = r.tok_s if r.arm != "llama.cpp" else r.e2e_tok_s
            lines.append(
                f"{r.arm:<15} {_f(tok_s, '6.2f')} {_f(r.speedup, '6.2f')}{'x' if r.speedup else ' '} {_f(r.expected_gain, '5.2f')} "
                f"{_f(r.acceptance_rate, '8.2f')} {_f(r.acceptance_length, '7.2f')} {_f(ttft, '6.2f')} "
                f"{_f(r.draft_ms, '8.1f')} {_f(r.verify_ms, '9.1f')} {r.rss_mib:7.0f} {same:>6}  {chosen}"
            )
        plain = next((r for r in rows if r.arm == "off"), None)
        ref = next((r for r in rows if r.arm == "llama.cpp"), None)
        auto = next((r for r in rows if r.arm == "auto"), None)
        jump = next((r for r in rows if r.arm == "jump-forward"), None)
        if jump is not None and jump.tokens:
            in_auto = (f"; in auto {auto.forced_tokens / auto.tokens:.0%} of its output (auto {_f(auto.speedup, '.2f')}x)"
                       if auto is not None and auto.tokens else "")
            lines.append(
                f"jump-forward: {jump.forced_tokens / jump.tokens:.0%} of the output came as the grammar's forced tokens "
                f"(speedup {_f(jump.speedup, '.2f')}x alone){in_auto}"
            )
        if plain is not None and len(plain.by_round) > 1:
            lines.append(_by_round(rows, plain))
        peers = [r for r in rows if r.arm.startswith("ls ") and r.tok_s]
        if peers:
            best = max(peers, key=lambda r: r.tok_s)
            ours = f"; homespec auto / it = {auto.tok_s / best.tok_s:.3f}x" if auto is not None and auto.tok_s else ""
            lines.append(f"best llama-server setting: {best.arm} {best.tok_s:.2f} tok/s{ours}")
        if plain and ref and ref.e2e_tok_s:
            lines.append(
                f"our loop with speculation off vs llama-cpp-python create_completion (end to end): "
                f"{plain.e2e_tok_s:.2f} / {ref.e2e_tok_s:.2f} = {plain.e2e_tok_s / ref.e2e_tok_s:.3f}x"
            )
    for arm, why in report.failed.items():
        lines += ["", f"{arm} stopped: {why.splitlines()[0]}"]
    lines += [
        "",
        "tok/s: output tokens after the first per second of decoding (llama.cpp arm: end to end); "
        "speedup: tok/s ÷ the off arm's (k = 0, plain decoding) tok/s in this run; exp.: gain the cost model predicts from the "
        "acceptance the arm saw (auto: what the controller expected when choosing); "
        "=off: runs whose text equals the off arm's (greedy; near-ties may differ). "
        "ls …: llama-server from the same llama.cpp on the same prompt tokens, tok/s from its own timings "
        "(the same definition), acc.rate from its draft counts; not run on grammar-constrained prompts.",
    ]
    return "\n".join(lines)
