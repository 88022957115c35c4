"""Requantize a GGUF model with llama.cpp's own quantizer (`llama_model_quantize`).

Only drafts are requantized (models/derived.py): a proposal need not be the published model's
own to be verified exactly, so a draft may trade a little acceptance for a faster format. The
target's weights are what homespec promises and are never touched.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from homespec.errors import ModelError

# Types a draft may be requantized to, with llama.cpp's file type for each. Q4_0 is the type
# ggml repacks for every CPU it has fast kernels for (AVX2 and AVX-512's 8x8 layout, AMX's tiles,
# NEON's 4x4 and 4x8), so a Q4_0 draft drafts fast wherever it runs.
FILE_TYPES: dict[str, int] = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}


def quantizer_version() -> str:
    """What the bits of a requantized file depend on: the llama.cpp it was made with."""
    return str(llama_cpp.__version__)


def requantize(src: Path, dst: Path, qtype: str, threads: int) -> None:
    """Write `src` requantized to `qtype` into `dst`: every matrix, the output layer and the token
    embeddings included (`pure`), since the output layer is a third of a 0.5B draft's reads per
    token. ModelError when llama.cpp refuses (it logs why)."""
    if qtype not in FILE_TYPES:
        raise ModelError(f"cannot requantize to {qtype!r}: known types are {', '.join(FILE_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = FILE_TYPES[qtype]
    params.allow_requantize = True  # the source is already quantized
    params.pure = True  # one type for every matrix: llama.cpp's mixes would keep Q6_K/Q8_0 parts
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"llama.cpp could not requantize {src.name} to {qtype} (error {rc}; its log says why)")
