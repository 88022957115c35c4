"""C programs that call the installed llama.cpp build's ggml directly (op-level kernel checks),
compiled against the wheel's headers and libraries."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest


def build(source: Path, out_dir: Path) -> Path:
    """Compile `source` into out_dir, linked against the installed wheel's ggml; the executable.
    Skips the test where there is no C compiler or the wheel has no headers."""
    spec = importlib.util.find_spec("llama_cpp")
    assert spec and spec.origin, "llama_cpp is not installed"
    pkg = Path(spec.origin).parent
    lib, include = pkg / "lib", pkg.parent / "include"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (include / "ggml-cpu.h").exists():
        pytest.skip("needs a C compiler and the wheel's ggml headers")
    exe = out_dir / source.stem
    subprocess.run([cc, "-O2", "-o", str(exe), str(source), f"-I{include}", f"-L{lib}", "-lggml", "-lggml-base", "-lggml-cpu",
                    "-lm", f"-Wl,-rpath,{lib}"], check=True, capture_output=True, timeout=120)
    return exe
