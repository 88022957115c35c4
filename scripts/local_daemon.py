"""Start `homespec serve` as a subprocess on a free loopback port, for the measurement scripts.
HOMESPEC_DAEMON_LOG=FILE: run it with debug logging into FILE (the controller's every decision).

The config is copied with some settings overridden and every relative model path made absolute
(the copy lives in a temporary folder).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(config: Path, overrides: dict[str, dict[str, Any]], out: Path) -> Path:
    """config.yaml with `overrides` ({section: {key: value}}, nested sections merged) applied,
    its paths absolute."""
    cfg = yaml.safe_load(config.read_text()) if config.exists() else {}
    cfg = cfg or {}
    _merge(cfg, overrides)
    models = cfg.setdefault("models", {})
    for ref in ("target", "draft"):
        m = models.get(ref)
        if isinstance(m, dict) and m.get("path"):
            m["path"] = str((config.parent / m["path"]).resolve())
    if models.get("mtp"):
        models["mtp"] = str((config.parent / models["mtp"]).resolve())
    models["dir"] = str((config.parent / models.get("dir", "models")).resolve())
    models["registry"] = str((config.parent / models.get("registry", "models/registry.yaml")).resolve())
    out.write_text(yaml.safe_dump(cfg))
    return out


def _merge(into: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def start(config: Path, timeout_s: float = 300, state_dir: Path | None = None) -> tuple[subprocess.Popen, str, float]:
    """(process, base URL, seconds from process start to /ready: load + warm-up).

    state_dir: the daemon's state folder (HOMESPEC_STATE_DIR); None: a new empty one, so that no
    prompt cache or remembered answer kept by an earlier daemon (memory.prefix_cache_persist)
    makes a measurement's first requests look like repeats."""
    port = free_port()
    t0 = time.perf_counter()
    log = os.environ.get("HOMESPEC_DAEMON_LOG")  # a file for the daemon's debug log (every decision)
    state = state_dir or Path(tempfile.mkdtemp(prefix="homespec-state-"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "homespec", *(["-v"] if log else []), "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=open(log, "w") if log else subprocess.DEVNULL,  # (the child holds it)
        env={**os.environ, "HOMESPEC_STATE_DIR": str(state)},
    )
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the daemon did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
