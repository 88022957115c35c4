"""The prefix cache on disk: saved conversation caches kept across a restart of the daemon.

A home server restarts (an update, a reboot, systemd after a crash) and its first requests are
then read cold: Home Assistant's first voice command reads its whole system prompt and tool list
again, ~1,400 tokens and 16 s on 2 cores, where the next ones take 2 s. So the daemon writes its
saved histories (and the live ones of its KV sequences) here when it stops or unloads the
models, and reads them back into the prefix cache's memory when it has warmed up.

A state is llama.cpp's serialisation of one sequence's KV cells (llama_state_seq_get_data). It is
only meaningful to the same model with the same build and the same kernels: llama.cpp checks the
layout when it loads one (layers, types, V transposed or not), but not the weights, and another
build's or another kernel choice's values differ in their last bits, which exact mode rules out.
So every file carries a fingerprint of all that (`fingerprint`), and a file whose fingerprint is
not this daemon's is never loaded. Each fingerprint has its own folder, so two configurations
sharing a state folder do not overwrite each other.

One file per history: a magic, a JSON header (fingerprint, token count, state size), the tokens
(int32), then the state bytes. Written to a temporary name and renamed, so a daemon killed while
writing leaves no torn file; a file that is cut short or garbled anyway is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("homespec.llama.prefix_store")

# Another fingerprint's files untouched this long are removed at a save: two configurations used
# in turn keep theirs, an old model's go.
STALE_S = 14 * 24 * 3600  # seconds

MAGIC = b"HSKV0001"
SUFFIX = ".kv"
_HEADER_LEN = struct.Struct("<I")


def fingerprint(identity: Mapping[str, Any]) -> str:
    """A short digest of what a saved state depends on (model file, build, kernel settings)."""
    text = json.dumps(dict(identity), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Saved:
    """A history found on disk; `fill(buf)` reads its state into buf (>= size bytes)."""

    tokens: list[int]
    size: int  # bytes of state
    fill: Callable[[Any], None]


def _folder(root: Path, key: str) -> Path:
    """This fingerprint's folder, made if need be. What it holds are recent conversations (the
    tokens are the prompts' text): the daemon's user's alone, the folder above it too."""
    folder = root / key
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for d in (root, folder):  # (made by an older version, by hand, or as a parent above)
        os.chmod(d, 0o700)
    return folder


def save(root: Path, key: str, histories: Sequence[tuple[Sequence[int], memoryview]], budget_s: float | None = None) -> int:
    """Write `histories` (tokens, state bytes; least recently used first) as this fingerprint's
    files, replacing what was there; returns how many were written. The most recent go first,
    and after the first none is begun once budget_s seconds have passed: a service manager
    kills a stop that takes too long (systemd's TimeoutStopSec), and a slow SD card writes ~20
    MB a second."""
    t0 = time.monotonic()
    folder = _folder(root, key)
    for tmp in folder.glob(".*.tmp"):  # a stop killed while writing
        tmp.unlink(missing_ok=True)
    keep: set[str] = set()
    now = time.time()
    for rank, (tokens, state) in enumerate(reversed(histories)):
        if rank and budget_s is not None and time.monotonic() - t0 > budget_s:
            log.warning("prompt cache: %d older conversation(s) not saved: past %.0f s", len(histories) - rank, budget_s)
            break
        toks = np.asarray(tokens, dtype="<i4")
        name = hashlib.sha256(toks.tobytes()).hexdigest()[:24] + SUFFIX
        header = json.dumps({"fingerprint": key, "tokens": len(toks), "state_bytes": len(state)}).encode()
        stamp = now - rank * 1e-3  # (see below)
        path = folder / name
        whole = len(MAGIC) + _HEADER_LEN.size + len(header) + toks.nbytes + len(state)  # bytes
        if path.is_file() and path.stat().st_size == whole:
            # Saved before, whole: the same tokens through the same model and kernels (up to
            # llama.cpp's batch noise, DESIGN.md's near-tie rule), so a save while idle writes
            # only what is new.
            os.utime(path, (stamp, stamp))
            keep.add(name)
            continue
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(MAGIC)
            f.write(_HEADER_LEN.pack(len(header)))
            f.write(header)
            f.write(toks.tobytes())
            f.write(state)
        # Their times are their order of use, the most recent latest, so that reading them back
        # in that order leaves the most recent the most recently used again (spelled out a
        # millisecond apart: a coarse file system's own times could tie).
        os.utime(tmp, (stamp, stamp))
        os.replace(tmp, path)
        keep.add(name)
    for old in folder.glob("*" + SUFFIX):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    _forget_stale(root, key)
    return len(keep)


def _forget_stale(root: Path, key: str) -> None:
    """Remove other fingerprints' folders left untouched for STALE_S: a replaced model file or
    llama.cpp build never reads them again, and each may hold the cache's whole budget."""
    cutoff = time.time() - STALE_S
    for folder in root.iterdir():
        if folder.name == key or not folder.is_dir():
            continue
        try:  # best effort: what cannot be removed now is tried at the next stop
            if folder.stat().st_mtime < cutoff and all(f.stat().st_mtime < cutoff for f in folder.iterdir()):
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
        except OSError as e:
            log.debug("old prompt cache folder %s left: %s", folder, e)


def save_arrays(root: Path, key: str, name: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Keep `arrays` beside this fingerprint's histories as `name`.npz (prompt lookup's memory
    of answers: drafts only its model's own answers are good for)."""
    folder = _folder(root, key)
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, folder / f"{name}.npz")


def read_arrays(root: Path, key: str, name: str) -> dict[str, np.ndarray] | None:
    """What save_arrays kept, or None (none kept, or not readable: a warning)."""
    path = root / key / f"{name}.npz"
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, KeyError) as e:
        log.warning("skipping %s: %s", path, e)
        return None


def read(root: Path, key: str) -> Iterator[Saved]:
    """This fingerprint's histories, least recently used first. Files that are not whole, or
    say another fingerprint, are skipped (with a warning: they are not ours to delete)."""
    folder = root / key
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns):
        try:
            saved = _open(path, key)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            log.warning("skipping a saved prompt cache: %s: %s", path, e)
            continue
        yield saved


def _open(path: Path, key: str) -> Saved:
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a homespec prompt cache file")
        (n,) = _HEADER_LEN.unpack(f.read(_HEADER_LEN.size))
        header = json.loads(f.read(n))
        if header.get("fingerprint") != key:
            raise ValueError("made by another model, build or kernel setting")
        n_tokens, size = int(header["tokens"]), int(header["state_bytes"])
        raw = f.read(4 * n_tokens)
        offset = f.tell()
    if len(raw) != 4 * n_tokens or path.stat().st_size != offset + size:
        raise ValueError("cut short")
    tokens = np.frombuffer(raw, dtype="<i4").tolist()

    def fill(buf: Any) -> None:
        with open(path, "rb") as f:
            f.seek(offset)
            view = memoryview(buf)[:size]
            if f.readinto(view) != size:
                raise ValueError(f"{path}: cut short")

    return Saved(tokens, size, fill)
