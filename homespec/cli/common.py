"""Argument helpers shared by the subcommands (import-light: argparse and pathlib only)."""

from __future__ import annotations

import argparse
from pathlib import Path

MODES = ("auto", "draft", "ngram", "mtp", "off")


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config file (default: ./config.yaml if present, else built-in defaults)",
    )


def config_path(arg: Path | None) -> Path | None:
    if arg is not None:
        return arg
    here = Path("config.yaml")
    return here if here.exists() else None


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults from config.yaml)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=None)


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation (defaults from config.yaml)")
    g.add_argument("--mode", choices=MODES, default=None, help="proposer choice; auto measures and picks")
    g.add_argument("-k", type=int, default=None, help="draft length for the fixed modes")


def positive_int(text: str) -> int:
    """argparse type for counts: 0 or less is refused with a one-line usage error."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n
