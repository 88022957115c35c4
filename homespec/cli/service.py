"""`homespec service install [--user [--sandbox]]`: write a systemd unit for this install's real paths.

Only argparse (and the import-light cli.common) is imported at module level; the config and the
renderer are imported inside `main`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from homespec.cli.common import add_config_argument, config_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    inst = sub.add_parser(
        "install",
        help="write homespec.service for this checkout and print the systemctl commands",
        description="Render a systemd unit that runs `homespec serve --config PATH` from this "
        "install's venv, and write it to /etc/systemd/system (root) or, with --user, to "
        "~/.config/systemd/user.",
    )
    inst.add_argument("--user", action="store_true", help="a unit for `systemctl --user`: runs as you, no root")
    inst.add_argument("--sandbox", action="store_true",
                      help="with --user: sandbox the file system and kernel in a user namespace as the system unit "
                      "does (needs unprivileged user namespaces)")
    add_config_argument(inst)
    inst.add_argument("--dest", type=Path, default=None, help="write the unit to this file instead")
    inst.add_argument("--print", dest="print_only", action="store_true", help="write the unit to stdout only")


def homespec_executable() -> Path:
    """This install's `homespec` script: next to the running interpreter (the venv's bin/)."""
    from homespec.errors import UserError

    # Not resolved: the venv's python is a symlink to the system one, and resolving it would
    # leave the venv.
    here = Path(os.path.abspath(sys.executable)).parent / "homespec"
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("homespec")
    if found:
        return Path(os.path.abspath(found))
    raise UserError(f"no `homespec` script next to {sys.executable}; reinstall with `pip install -e .`")


def _unreadable_ancestor(path: Path, uid: int | None) -> Path | None:
    """The first folder on the way to `path` that the service user (uid, or any other user when
    None) cannot enter, or the file itself when it cannot read it; None when it can."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent  # not created yet (models not pulled): check the part that exists

    def allowed(p: Path, bit: int) -> bool:
        st = p.stat()
        return st.st_uid == uid or bool(st.st_mode & bit)  # group membership is not checked

    for folder in reversed(path.parents):
        if not allowed(folder, 0o001):
            return folder
    return None if allowed(path, 0o001 if path.is_dir() else 0o004) else path


def _service_uid() -> int | None:
    import pwd

    from homespec.serving.systemd import SERVICE_USER

    try:
        return pwd.getpwnam(SERVICE_USER).pw_uid
    except KeyError:
        return None


def main(args: argparse.Namespace) -> int:
    from homespec.config import load_config
    from homespec.errors import UserError
    from homespec.serving.systemd import (
        SERVICE_USER,
        SYSTEM_STATE_DIR,
        default_unit_path,
        install_unit,
        render_unit,
        user_namespaces_refused,
    )

    if args.service_command != "install":  # argparse allows only `install`; kept for new actions
        raise UserError(f"unknown action {args.service_command}")
    if args.sandbox and not args.user:
        raise UserError("--sandbox is for --user units; the system unit is always sandboxed")
    if args.sandbox and (why := user_namespaces_refused()):
        raise UserError(f"--sandbox needs unprivileged user namespaces, and {why} here: leave out --sandbox "
                        "or turn them on (sysctl)")
    cfg_file = config_path(args.config)
    if cfg_file is None:
        raise UserError("the service needs a config file: pass --config PATH (e.g. /etc/homespec/config.yaml)")
    cfg_file = Path(os.path.abspath(cfg_file))
    cfg = load_config(cfg_file)
    exec_path = homespec_executable()
    models_dir = cfg.resolve(cfg.models.dir)
    gpu = any(ref is not None and ref.n_gpu_layers != 0 for ref in (cfg.models.target, cfg.models.draft))
    text = render_unit(
        exec_path=exec_path,
        config=cfg_file,
        working_dir=cfg_file.parent,
        user=args.user,
        mlock=cfg.runtime.use_mlock,
        models_dir=models_dir,
        drain_timeout_s=cfg.server.drain_timeout_s,
        gpu=gpu,
        user_sandbox=args.sandbox,
    )

    notes: list[str] = []
    if args.user and cfg.runtime.use_mlock:
        notes.append(
            "runtime.use_mlock: a user unit cannot raise LimitMEMLOCK; raise it for your user manager "
            "(`sudo systemctl edit user@$(id -u).service`, add [Service] LimitMEMLOCK=infinity) or "
            "llama.cpp runs with the weights unlocked"
        )
    uid = None if args.user else _service_uid()
    if not args.user:
        for p in (exec_path, cfg_file, models_dir):
            blocked = _unreadable_ancestor(p, uid)
            if blocked is not None:
                notes.append(
                    f"{blocked} is closed to other users, so the `{SERVICE_USER}` user cannot reach {p}: "
                    "move the checkout (e.g. to /opt/homespec), open that folder, or use --user"
                )
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    if args.print_only:
        sys.stdout.write(text)
        return 0

    dest = install_unit(text, user=args.user, dest=args.dest)
    ctl = "systemctl --user" if args.user else "systemctl"
    journal = "journalctl --user" if args.user else "journalctl"
    # A unit outside systemd's search path is enabled by its full path (systemctl links it).
    target = "homespec" if args.dest is None or dest == default_unit_path(args.user) else str(dest)
    print(f"wrote {dest}")
    print("next:")
    if not args.user and uid is None:
        print(
            f"  useradd --system --create-home --home-dir {SYSTEM_STATE_DIR} "
            f"--shell /usr/sbin/nologin {SERVICE_USER}"
        )
    print(f"  {ctl} daemon-reload && {ctl} enable --now {target}")
    print(f"  {journal} -u homespec -f")
    if args.user:
        print("  loginctl enable-linger $USER   # keep it running while you are logged out")
    return 0
