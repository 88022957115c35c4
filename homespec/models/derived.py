"""The draft as served: requantized once to a type with fast kernels on every CPU.

The default 0.5B draft ships as Q4_K_M, which for its 896-wide rows means Q5_0 and Q8_0 (K-quants
need rows in multiples of 256), and ggml has no repacked kernels for either: on the 2-core Xeon a
draft token cost 27 ms. Requantized to Q4_0 (repacked for AVX2, AVX-512, AMX and NEON) it cost
14 ms, and drafts were still accepted 0.77-0.83 of the time against 0.81-0.85 on code. Only the
proposals change: the target verifies every one, so what the daemon says does not.

The file is made once from the verified source (2-4 s for the 0.5B draft), written beside the
models (or in the state folder where the models folder is read-only) as `<source>.<type>.gguf`,
and reused while its stamp, `.<file>.derived`, matches it, its source and the llama.cpp that made
it. `models.draft.requantize: null` serves the published file as it is.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from homespec.errors import ModelError
from homespec.llama.gguf_info import read_gguf_info
from homespec.llama.runtime import physical_cores
from homespec.models.fetch import check_disk, file_key, resolve_model_path, save_json, state_dir

if TYPE_CHECKING:
    from homespec.config import Config, DraftRef

log = logging.getLogger("homespec.models.derived")


def derived_path(cfg: Config, source: Path, qtype: str) -> Path:
    """Where the draft requantized to `qtype` lives: the models folder (made if missing) when it
    is writable, else the state folder."""
    folder = cfg.resolve(cfg.models.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        folder = state_dir() / "models"
    return folder / f"{source.stem}.{qtype}.gguf"


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.derived")


def _identity(source: Path, qtype: str) -> dict[str, object]:
    """What a derived file was made from: the source as it was, the type and the quantizer."""
    from homespec.llama.quantize import quantizer_version

    return {"source": str(source.resolve()), "source_key": file_key(source.stat()), "type": qtype,
            "llama_cpp": quantizer_version()}


def is_current(path: Path, source: Path, qtype: str) -> bool:
    """True when `path` is the file this stamp describes, made from `source` as it is now."""
    try:
        record = json.loads(_stamp_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and record.get("key") == file_key(st)
            and record.get("made_from") == _identity(source, qtype))


def make_derived(source: Path, dest: Path, qtype: str, threads: int) -> float:
    """Requantize `source` into `dest` (through a temporary name, so `dest` is always whole) and
    stamp it; returns the seconds it took. ModelError when it cannot."""
    from homespec.llama.quantize import requantize

    dest.parent.mkdir(parents=True, exist_ok=True)
    check_disk(dest.parent, source.stat().st_size, f"the {qtype} draft")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    t0 = time.perf_counter()
    try:
        requantize(source, tmp, qtype, threads)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    save_json(_stamp_path(dest), {"key": file_key(dest.stat()), "made_from": _identity(source, qtype)})
    return time.perf_counter() - t0


def served_draft(cfg: Config, ref: DraftRef) -> Path:
    """The GGUF file the draft is served from: the verified source, or its requantized copy
    (made now when missing or stale). A copy that cannot be made is logged and the source
    served: drafting slower beats not drafting."""
    source = resolve_model_path(cfg, ref)
    qtype = ref.requantize
    if qtype is None or read_gguf_info(source).matrix_types <= {qtype.upper()}:
        return source
    dest = derived_path(cfg, source, qtype)
    if is_current(dest, source, qtype):
        return dest
    try:
        seconds = make_derived(source, dest, qtype, threads=cfg.runtime.n_threads or physical_cores())
    except (ModelError, OSError) as e:
        log.warning("draft %s served as published: cannot requantize it to %s in %s (%s)", source.name, qtype,
                    dest.parent, e)
        return source
    log.info("draft %s requantized to %s in %.1f s: %s (%.0f MiB)", source.name, qtype, seconds, dest,
             dest.stat().st_size / 2**20)
    return dest
