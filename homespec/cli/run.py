"""`homespec run "prompt"`: one chat answer in the terminal, streamed, with speculative stats."""

from __future__ import annotations

import argparse
import sys

from homespec.cli.common import (
    add_config_argument,
    add_sampling_arguments,
    add_speculation_arguments,
    config_path,
    request_from_args,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message ('-' reads it from stdin)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    add_config_argument(p)
    add_sampling_arguments(p)
    add_speculation_arguments(p)


def main(args: argparse.Namespace) -> int:
    from homespec.config import load_config
    from homespec.serving.host import Host

    cfg = load_config(config_path(args.config))
    # One answer: no earlier turn to reuse, so no prefix cache to set up (its 512 MiB arena is
    # written at warm-up: ~1.1 s on 2 cores).
    cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"prefix_reuse": False})})
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    req = request_from_args(cfg, args)  # a bad flag is refused before any model loads
    with Host.open(cfg, calibrate=req.mode == "auto") as session:
        if args.raw:
            tokens = session.models.encode_text(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            tokens = session.models.encode_chat(messages)
        gen = session.generate(tokens, req)
        for ev in gen:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(summary_line(gen.stats), file=sys.stderr)
    return 0


def summary_line(st) -> str:  # st: GenerationStats
    parts = [f"{st.completion_tokens} tokens", f"TTFT {st.ttft_s:.2f} s"]
    if st.decode_tps:
        parts.append(f"{st.decode_tps:.1f} tok/s")
    if st.proposed:
        parts.append(f"acceptance {st.accepted}/{st.proposed} = {st.acceptance_rate:.2f}")
    if st.acceptance_length:
        parts.append(f"acceptance length {st.acceptance_length:.2f}")
    if st.by_choice:
        top = sorted(st.by_choice.items(), key=lambda kv: -kv[1])[:3]
        parts.append("steps " + ", ".join(f"{k}×{v}" for k, v in top))
    parts.append(f"finish {st.finish_reason}")
    return " · ".join(parts)
