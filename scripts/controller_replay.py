#!/usr/bin/env python3
"""Judge the speculation controller on recorded greedy outputs, without timing anything.

    .venv/bin/python scripts/controller_replay.py record OUT.json [--config C] [--messages M.json] [--max-tokens 200]
    .venv/bin/python scripts/controller_replay.py replay REC.json [REC.json ...] [--costs BENCH.json ...] [--by-evidence] [--vocab GGUF]

record: greedy outputs of the bench's prompts (or of M.json: {workload: [[chat messages]]}), with
the target model. replay: auto against fixed ngram arms and a hindsight oracle (the accepted tokens
known in advance) on those outputs (homespec.speculation.replay), each step priced with the
target's pass costs from a bench run's calibration or a {n: seconds} file, one table per --costs
(default: the curve the unit tests use, measured on the 2-core development machine;
tests/data/epyc_pass_costs.json is a 2-core AMD EPYC's from scripts/pass_cost.py --history 200
--rounds 6, 2026-12-04). --vocab: the recordings' model, whose tokens' text prompt lookup reads
as the daemon's does (NgramProposer.piece); without it, by token id only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COSTS = ROOT / "tests" / "data" / "cpu_pass_costs.json"


def record(args: argparse.Namespace) -> None:
    from homespec.config import load_config
    from homespec.serving.bench import load_workloads
    from homespec.serving.host import Host
    from homespec.speculation.engine import FixedPolicy, GenerationStats
    from homespec.speculation.sampling import SamplingParams

    if args.messages:
        workloads = json.loads(Path(args.messages).read_text())
    else:
        workloads = {w.name: w.prompts for w in load_workloads()}
    out: dict[str, list[dict]] = {}
    with Host.open(load_config(args.config), calibrate=False, with_draft=False) as s:
        m = s.models
        for name, prompts in workloads.items():
            for messages in prompts:
                prompt = m.encode_chat(messages)
                events = s.engine.generate(prompt, SamplingParams(temperature=0.0), args.max_tokens, (), FixedPolicy(), GenerationStats())
                output = [t for ev in events for t in ev.tokens]
                out.setdefault(name, []).append({"prompt": prompt, "output": output})
                print(f"{name}: {len(prompt)} prompt tokens, {len(output)} output", file=sys.stderr)
    Path(args.out).write_text(json.dumps(out))


def replay(args: argparse.Namespace) -> None:
    from homespec.config import ControllerConfig
    from homespec.speculation.controller import Controller
    from homespec.speculation.replay import compare, load_recordings, pass_cost

    workloads: dict = {}
    for f in args.recordings:
        for name, recs in load_recordings(Path(f)).items():
            workloads.setdefault(name, []).extend(recs)
    names = list(workloads)
    piece = None
    if args.vocab:
        from homespec.llama.runtime import Vocabulary

        piece = Vocabulary(args.vocab).piece

    for path in args.costs or [DEFAULT_COSTS]:
        costs = json.loads(Path(path).read_text())
        costs = costs.get("calibration", {}).get("target", costs)  # a bench report, or {n: seconds}
        samples = {int(n): float(s) for n, s in costs.items()}  # tokens in a pass -> seconds

        def controller(ngram, samples=samples):
            c = Controller([ngram], ControllerConfig(), k_max=max(samples) - 1)
            c.cost.set_verify(samples)
            return c

        table = compare(workloads, controller, pass_cost(samples), oracle_k=max(samples) - 1, piece=piece)
        shown = sorted(samples)[:: max(1, len(samples) // 4)]  # a few sizes: the curve's shape
        print(f"== {path} (" + ", ".join(f"{n} row{'s' * (n > 1)} {samples[n] * 1000:.0f} ms" for n in shown) + ")")
        print(f"{'arm':<10} " + " ".join(f"{w:>8}" for w in names) + "   (speedup over plain, modelled)")
        for arm, row in table.items():
            print(f"{arm:<10} " + " ".join(f"{row[w]:8.3f}" for w in names))
        if args.by_evidence:
            evidence_tables(workloads, controller, pass_cost(samples), max(samples) - 1, piece)
    print(f"auto: its worst over workload orders (each workload first once); {sum(len(r) for r in workloads.values())} recordings")


def evidence_tables(workloads: dict, controller, pass_s, k_max: int, piece=None) -> None:
    """Per workload and evidence: how often ngram k=4's proposals keep their first token, and what
    the oracle's and auto's drafts saved (auto sees the workloads in the order given)."""
    from homespec.speculation.engine import FixedPolicy
    from homespec.speculation.proposers.ngram import MATCH_CAP, NgramProposer
    from homespec.speculation.replay import by_evidence, oracle, replay

    def label(e) -> str:
        source = "prompt" if e.from_prompt else "memory" if e.from_memory else "answer"
        span = {8: "8-15", 16: f"16-{MATCH_CAP - 1}", MATCH_CAP: f"{MATCH_CAP}+"}.get(e.match, str(e.match))
        return f"{source}, match {span}" + (", resumes" if e.resumes else "")

    auto = controller(auto_ngram := NgramProposer(2, 12, piece=piece))
    for name, recs in workloads.items():
        fixed, best, mine = [], [], []
        replay(recs, FixedPolicy(ngram := NgramProposer(2, 12, piece=piece), 4), ngram, pass_s, fixed)
        oracle(recs, NgramProposer(2, 12, piece=piece), pass_s, k_max, best)
        plain_s = replay(recs, auto, auto_ngram, pass_s, mine).emitted * pass_s(1)
        rows = [by_evidence(x, pass_s) for x in (fixed, best, mine)]
        print(f"-- {name}: drafting steps by evidence; saved: modelled seconds against plain decoding ({plain_s:.1f} s)")
        print(f"{'evidence':<29} {'k=4 proposals':>13} {'1st kept':>8} {'oracle steps':>12} {'saved s':>8} {'auto steps':>10} {'saved s':>8}")
        for e in sorted(set().union(*rows), key=lambda e: (e.from_prompt, e.from_memory, e.match)):
            f, o, a = (r.get(e) for r in rows)
            print(f"{label(e):<29} {f.steps if f else 0:>13} {f'{f.first_kept / f.steps:.0%}' if f else '-':>8}"
                  f" {o.steps if o else 0:>12} {o.saved_s if o else 0:>+8.2f} {a.steps if a else 0:>10} {a.saved_s if a else 0:>+8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--config", default=None)
    r.add_argument("--messages", default=None)
    r.add_argument("--max-tokens", type=int, default=200)
    q = sub.add_parser("replay")
    q.add_argument("recordings", nargs="+")
    q.add_argument("--costs", action="append",
                   help="a bench report or {n: seconds}; once per curve (default: the unit tests' curve)")
    q.add_argument("--by-evidence", action="store_true",
                   help="also, per workload: each kind of match's first-token keep rate, and what the oracle's and auto's drafts saved")
    q.add_argument("--vocab", default=None,
                   help="the recordings' model (a GGUF): prompt lookup reads its tokens' text, as the daemon's does")
    args = p.parse_args()
    record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    main()
