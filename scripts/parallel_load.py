#!/usr/bin/env python3
"""Several home apps at once (issue #16's bar), measured against a real daemon with the `openai`
client, streaming, greedy, client-side timing:

1. aggregate output tokens/s of N clients at once (mixed code / edit / chat prompts from the
   bench) against the same requests one at a time, in the same daemon (a request alone runs
   exactly as in a daemon with server.parallel 1), rounds interleaved;
2. TTFT of a short request with X-Homespec-Priority: 5 while N - 1 long ones run, against its
   TTFT on the idle daemon;
3. whether each request's text is the same at once as alone;
4. with --peer: the same N clients at once against llama-server (same llama.cpp, `-np N`, one
   process per speculative setting, all on the same prompts), interleaved with homespec's rounds;
5. with --bare: the same prompts at once through the engine alone (`Batch` in this process, no
   HTTP), to tell what the daemon costs from what the engine does.

The servers (and the bare engine) take turns within a round, in an order that turns each round.

    .venv/bin/python scripts/parallel_load.py [--config config.yaml] [--clients 4] [--max-tokens 128] [--rounds 2]
        [--context-words 0] [--mix code,edit,chat] [--peer] [--peer-bin PATH] [--peer-settings plain,ngram-simple,ngram-mod,draft]
        [--memory] [--bare]

The daemon runs without its memory of earlier answers (speculation.ngram.memory_tokens 0) unless
--memory is given: every round asks the same prompts one at a time and then at once, and with the
memory the later requests would draft the earlier ones' answers, which measures the memory, not
several apps at once. (llama-server's ngram-mod keeps its pool across requests all the same.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_ttft import BODY
from local_daemon import start, stop, write_config

from homespec.serving.bench import load_workloads


def mixed_prompts(n: int, context_words: int = 0, mix: tuple[str, ...] = ("code", "edit", "chat")) -> list[tuple[str, list[dict]]]:
    """n chat prompts of the bench's workloads in `mix`, taken in turn (each workload's prompts
    in order, again from its first when they run out); with context_words, each opens with that
    many words of a household manual of its own (as an assistant's retrieved documents or a long
    system prompt would), so that every request decodes beside long histories."""
    loads = {w.name: [p for p in w.prompts if p.messages] for w in load_workloads(mix)}
    out = []
    for i in range(n):
        name = mix[i % len(mix)]
        messages = [dict(m) for m in loads[name][(i // len(mix)) % len(loads[name])].messages]
        if context_words:
            words = (BODY * (context_words // 40 + 60)).split()[37 * i :][:context_words]
            messages[-1]["content"] = f"Household manual, part {i + 1}:\n{' '.join(words)}\n\n{messages[-1]['content']}"
        out.append((name, messages))
    return out


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int, priority: int = 0) -> dict:
    t0 = time.perf_counter()
    ttft, text, n, chosen = None, "", 0, {}
    stream = client.chat.completions.create(
        model="homespec", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Homespec-Priority": str(priority)},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage:
            n = chunk.usage.completion_tokens
            chosen = (chunk.model_extra or {}).get("homespec", {}).get("proposers", {})  # proposer:k -> steps
    return {"text": text, "tokens": n, "ttft": ttft, "seconds": time.perf_counter() - t0, "chosen": chosen}


def _steps(chosen: dict) -> str:
    """A request's steps by proposer:k, most first (its `homespec.proposers`)."""
    return ", ".join(f"{c}x{n}" for c, n in sorted(chosen.items(), key=lambda kv: -kv[1])) or "-"


def together(client: openai.OpenAI, jobs: list[tuple[list[dict], int, int]]) -> tuple[list[dict], float]:
    out: list[dict | None] = [None] * len(jobs)

    def run(i: int) -> None:
        messages, max_tokens, priority = jobs[i]
        out[i] = ask(client, messages, max_tokens, priority)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("config.yaml"))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="0: only the priority TTFT (part 2)")
    ap.add_argument("--context-words", type=int, default=0, help="open each prompt with this many words of its own context")
    ap.add_argument("--mix", default="code,edit,chat", help="the bench workloads the clients' prompts come from, in turn (edit: edits side by side)")
    ap.add_argument("--peer", action="store_true", help="also run the load against llama-server -np N")
    ap.add_argument("--peer-bin", type=Path, default=None, help="this llama-server (default: build or find the cached one)")
    ap.add_argument("--peer-settings", default="plain,ngram-simple,ngram-mod,draft")
    ap.add_argument("--memory", action="store_true", help="keep the daemon's memory of earlier answers on")
    ap.add_argument("--bare", action="store_true",
                    help="also run the load through the engine's Batch in this process (no HTTP): where a gap lies")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="homespec-parallel-"))
    overrides: dict = {"server": {"parallel": args.clients}}
    if not args.memory:
        overrides["speculation"] = {"ngram": {"memory_tokens": 0}}
    config = write_config(args.config, overrides, tmp / "config.yaml")
    peers = ExitStack()
    peer_clients = start_peers(peers, args, config) if args.peer else {}
    proc, url, ready_s = start(config)
    bare = BareEngine(config, args.clients) if args.bare else None
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    try:
        prompts = mixed_prompts(args.clients, args.context_words, tuple(args.mix.split(",")))
        if bare is not None:
            bare.prompts([m for _, m in prompts])
        # Every server reads every prompt once first: then no round, and no server, is the one
        # that pays the cold prompts (homespec's prefix cache and llama-server's slots keep them).
        for c in (client, *peer_clients.values()):
            for _, m in prompts:
                ask(c, m, 8)
        seq_rates, par_rates, same, total = [], [], 0, 0
        peer_rates: dict[str, list[float]] = {name: [] for name in peer_clients}
        bare_rates: list[float] = []

        def homespec_round(r: int) -> None:
            nonlocal same, total
            t0 = time.perf_counter()
            alone = [ask(client, m, args.max_tokens) for _, m in prompts]
            seq_s = time.perf_counter() - t0
            at_once, par_s = together(client, [(m, args.max_tokens, 0) for _, m in prompts])
            seq_tps = sum(a["tokens"] for a in alone) / seq_s
            par_tps = sum(a["tokens"] for a in at_once) / par_s
            seq_rates.append(seq_tps)
            par_rates.append(par_tps)
            same += sum(a["text"] == b["text"] for a, b in zip(alone, at_once))
            total += len(prompts)
            print(f"round {r + 1}: one at a time {seq_tps:.2f} tok/s ({seq_s:.1f} s), {args.clients} at once "
                  f"{par_tps:.2f} tok/s ({par_s:.1f} s): {par_tps / seq_tps:.2f}x", flush=True)
            for (kind, _), a, b in zip(prompts, alone, at_once):
                print(f"    {kind:5s} alone {a['tokens']:4d} tok ttft {a['ttft']:.2f} s | at once {b['tokens']:4d} tok "
                      f"ttft {b['ttft']:.2f} s | {'same text' if a['text'] == b['text'] else 'text differs'} | "
                      f"steps alone {_steps(a['chosen'])}, at once {_steps(b['chosen'])}")

        def peer_round(r: int, name: str) -> None:
            at_once, par_s = together(peer_clients[name], [(m, args.max_tokens, 0) for _, m in prompts])
            peer_rates[name].append(sum(a["tokens"] for a in at_once) / par_s)
            print(f"round {r + 1}: {name} -np {args.clients}, {args.clients} at once {peer_rates[name][-1]:.2f} tok/s "
                  f"({par_s:.1f} s)", flush=True)

        def bare_round(r: int) -> None:
            assert bare is not None
            bare_rates.append(bare.at_once(args.max_tokens))
            print(f"round {r + 1}: bare engine, {args.clients} at once {bare_rates[-1]:.2f} tok/s", flush=True)

        arms = [*(lambda r, n=n: peer_round(r, n) for n in peer_clients), homespec_round, *([bare_round] if bare else [])]
        for r in range(args.rounds):
            # The order turns each round: the machine's pace drifts by more than the gaps measured.
            for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
                arm(r)
        if args.rounds:
            print(f"aggregate tokens/s, {args.clients} at once / one at a time: "
                  f"{statistics.mean(par_rates) / statistics.mean(seq_rates):.2f}x (mean of {args.rounds} rounds); "
                  f"{same}/{total} texts identical")
            for name, rates in peer_rates.items():
                print(f"homespec / {name} -np {args.clients}, {args.clients} at once: "
                      f"{statistics.mean(par_rates):.2f} / {statistics.mean(rates):.2f} tok/s = "
                      f"{statistics.mean(par_rates) / statistics.mean(rates):.2f}x")
            if bare_rates:
                print(f"homespec daemon / bare engine, {args.clients} at once: {statistics.mean(par_rates):.2f} / "
                      f"{statistics.mean(bare_rates):.2f} tok/s = {statistics.mean(par_rates) / statistics.mean(bare_rates):.3f}x")
                for name, rates in peer_rates.items():
                    print(f"bare engine / {name} -np {args.clients}: "
                          f"{statistics.mean(bare_rates) / statistics.mean(rates):.3f}x")

        rooms = iter(["kitchen", "hallway", "bedroom", "garage", "office", "porch", "attic", "cellar"])

        def short() -> list[dict]:  # a new command each time: its words are not in any cache
            return [{"role": "user", "content": f"Turn on the {next(rooms)} lights. Reply with one short sentence."}]

        idle = [ask(client, short(), 16, priority=5)["ttft"] for _ in range(3)]
        long_jobs = [(m, 160, 0) for _, m in prompts[: args.clients - 1]]
        ttfts = []
        for _ in range(2):
            runner = threading.Thread(target=together, args=(client, long_jobs))
            runner.start()
            time.sleep(8.0)  # the long ones are past their prompts and decoding
            ttfts.append(ask(client, short(), 16, priority=5)["ttft"])
            runner.join()
        print(f"short request, priority 5: TTFT idle {statistics.median(idle):.2f} s, beside {args.clients - 1} long "
              f"{statistics.median(ttfts):.2f} s ({statistics.median(ttfts) / statistics.median(idle):.2f}x)")
    finally:
        stop(proc)
        peers.close()
        if bare is not None:
            bare.close()


class BareEngine:
    """The daemon's engine without the daemon: the same config's models in this process, the
    prompts run together through `Batch` (speculation/batch.py) with no HTTP, no event loop and
    no client threads in the way. Against the daemon it shows what serving costs; against
    llama-server, what the engine does."""

    def __init__(self, config: Path, slots: int) -> None:
        from homespec.config import load_config
        from homespec.serving.host import Host

        self.cfg = load_config(config)
        self.host = Host.open(self.cfg, slots=slots)
        self.tokens: list[list[int]] = []

    def prompts(self, messages: list[list[dict]]) -> None:
        self.tokens = [self.host.models.encode_chat(m) for m in messages]
        self.at_once(8)  # read every prompt once first, as every server does

    def at_once(self, max_tokens: int) -> float:
        """Output tokens/s of every prompt at once, from the first admission to the last token."""
        from homespec.serving.host import build_request
        from homespec.speculation.engine import GenerationStats

        batch = self.host.batch(self.cfg.server.prefill_chunk)
        req = build_request(self.cfg, max_tokens=max_tokens)
        stats = [GenerationStats() for _ in self.tokens]
        t0 = time.perf_counter()
        for i, toks in enumerate(self.tokens):
            batch.add(i, self.host.steps(toks, req, i, stats[i]))
        while len(batch):
            batch.step(lambda key, event: None)
        return sum(s.completion_tokens for s in stats) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.host.close()


def start_peers(stack: ExitStack, args: argparse.Namespace, config: Path) -> dict[str, openai.OpenAI]:
    """One llama-server -np N per setting, on the model files homespec's config names."""
    from homespec.config import load_config
    from homespec.llama.runtime import physical_cores
    from homespec.models.derived import served_draft
    from homespec.models.fetch import resolve_model_path
    from homespec.serving import peer_build
    from homespec.serving.peer import LlamaServer, peer_settings, select_settings

    cfg = load_config(config)
    binary = args.peer_bin or peer_build.build()
    draft = served_draft(cfg, cfg.models.draft) if cfg.models.draft else None  # the file homespec drafts with
    clients = {}
    for setting in select_settings(args.peer_settings, peer_settings(draft)):
        server = stack.enter_context(LlamaServer(binary, resolve_model_path(cfg, cfg.models.target), setting,
                                                 cfg.runtime.n_ctx, cfg.runtime.n_threads or physical_cores(), parallel=args.clients))
        clients[f"llama-server {setting.name.removeprefix('ls ')}"] = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=900)
    return clients


if __name__ == "__main__":
    main()
