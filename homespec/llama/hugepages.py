"""Transparent huge pages for llama.cpp's weights and KV cache.

llama.cpp repacks the target's weights into memory it allocates with malloc, and every decode
step streams all of it (~1 GB for the 1.5B target). Where the kernel gives huge pages only to
memory that asks for them (THP "madvise", Debian's and Ubuntu's default), that memory sits in
4 KiB pages and the step pays a TLB miss every 4 KiB. glibc (2.35+) asks for them on every
mapping it makes when its tunable `glibc.malloc.hugetlb=1` is set, which it reads only at process
start, so the commands that load models run again with it (`maybe_reexec`). On a 2-core Xeon VM
(THP madvise, glibc 2.36) a one-token step of the 1.5B target took 59.7-60.0 ms with it and 66.4
without (two runs each, 120 steps a run), and llama-bench's tg64 went from 15.48 to 16.95 tok/s.
HOMESPEC_HUGEPAGES=0 turns it off.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP setting: "always", "madvise" or "never"; None where unknown."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def tunables_with_huge_pages(environ: Mapping[str, str], thp: str | None, libc: tuple[str, str]) -> str | None:
    """The GLIBC_TUNABLES value that asks glibc for huge pages, or None where it would change
    nothing: THP is on for all memory anyway ("always") or off, the C library is not glibc 2.35+,
    the tunable is set already (whatever its value: the user's choice), or HOMESPEC_HUGEPAGES=0."""
    if environ.get("HOMESPEC_HUGEPAGES") == "0" or thp != "madvise":
        return None
    name, version = libc
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == TUNABLE for t in current.split(":") if t):
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def environ_with_huge_pages() -> dict[str, str] | None:
    """This process's environment with huge pages asked for; None where that changes nothing.
    llama-server, when the bench or a script runs it beside homespec, gets the same."""
    tunables = tunables_with_huge_pages(os.environ, thp_mode(), platform.libc_ver())
    return None if tunables is None else {**os.environ, "GLIBC_TUNABLES": tunables}


def maybe_reexec(argv: Sequence[str]) -> None:
    """Run `python -m homespec argv` again with huge pages asked for, where that changes
    something (tunables_with_huge_pages); returns only where it does not."""
    env = environ_with_huge_pages()
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "homespec", *argv], env)
