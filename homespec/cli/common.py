"""Argument helpers shared by the subcommands. Import-light: argparse and the config models
(pydantic), so every `--help` works without loading llama.cpp or torch."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from homespec.config import Config, SamplingDefaults, SpeculationConfig

if TYPE_CHECKING:
    from homespec.serving.host import GenerationRequest



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


def add_config_flags(
    g: argparse._ActionsContainer, model: type[BaseModel], names: Sequence[str], short: Mapping[str, str] = {}
) -> None:
    """One flag per config field (`--top-p` for `top_p`), derived from the pydantic model: its
    type, choices and description come from config.py, and its default is None ("keep the
    config's value"), so a default is never restated here."""
    for name in names:
        field = model.model_fields[name]
        typ = _plain_type(field.annotation)
        choices = [m.value for m in typ] if isinstance(typ, type) and issubclass(typ, Enum) else None
        default = field.default.value if isinstance(field.default, Enum) else field.default
        default = "null" if default is None else default  # as config.yaml writes it
        flags = [f"--{name.replace('_', '-')}", *([short[name]] if name in short else [])]
        g.add_argument(
            *flags,
            dest=name,
            type=str if choices else typ,
            choices=choices,
            default=None,
            help=f"{field.description or name.replace('_', ' ')} (config default: {default})",
        )


def _plain_type(annotation: Any) -> Any:
    """int | None -> int; a plain type as it is."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults from config.yaml)")
    add_config_flags(g, SamplingDefaults, SAMPLING_FLAGS)


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation (defaults from config.yaml)")
    add_config_flags(g, SpeculationConfig, ("mode", "k"), short={"k": "-k"})


def request_from_args(cfg: Config, args: argparse.Namespace) -> GenerationRequest:
    """The flags a user set over config.yaml's defaults (one builder: serving.host.build_request)."""
    from homespec.serving.host import build_request

    sampling = {f: getattr(args, f, None) for f in SAMPLING_FLAGS if f != "max_tokens"}
    return build_request(
        cfg, mode=getattr(args, "mode", None), k=getattr(args, "k", None), max_tokens=getattr(args, "max_tokens", None), **sampling
    )


def positive_int(text: str) -> int:
    """argparse type for counts: 0 or less is refused with a one-line usage error."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n
