"""homespec command line: serve | run | bench | models | dashboard | service | train-mtp | doctor.

Each subcommand lives in homespec/cli/<name>.py and is imported only when used, so that
`homespec models list` does not pay for loading llama.cpp or torch. Errors that a user can fix
(bad config, missing model, bad argument) print one line and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from homespec.errors import UserError

# subcommand -> (module under homespec.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "run the daemon (OpenAI-compatible API on localhost)"),
    "run": ("run", "generate one answer in the terminal, with speculative stats"),
    "bench": ("bench", "measure speedup of each proposer/k against plain decoding"),
    "models": ("models", "pull | list | verify the GGUF models"),
    "dashboard": ("dashboard", "live terminal dashboard of a running daemon"),
    "service": ("service", "install the systemd unit for this checkout"),
    "train-mtp": ("train_mtp", "collect target hidden states and train an MTP draft head"),
    "doctor": ("doctor", "which CPU kernels llama.cpp runs with here, and whether the build fits this CPU"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="homespec", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Argument declarations are small and import-free, so every `--help` works without
        # importing the heavy parts.
        importlib.import_module(f"homespec.cli.{module}").add_arguments(p)
    return parser


# Commands that load models: they run with huge pages asked for (llama/hugepages.py).
LOADS_MODELS = frozenset({"serve", "run", "bench", "train-mtp"})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and args.command in LOADS_MODELS:  # (a command line, not a caller in-process)
        from homespec.llama.hugepages import maybe_reexec

        maybe_reexec(sys.argv[1:])
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    module = importlib.import_module(f"homespec.cli.{args._module}")
    try:
        return int(module.main(args) or 0)
    except UserError as e:
        print(f"homespec {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
