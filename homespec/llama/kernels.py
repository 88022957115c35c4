"""Which llama.cpp CPU kernels a pass uses, and the settings under which a row's logits do not
depend on the batch it is computed in.

Greedy speculation matches plain decoding only if the target's logits for a position are the
same whether the position is verified inside a batch of k + 1 or decoded alone. In llama.cpp's
CPU backend (ggml 0.25.3, llama-cpp-python 0.3.36) they are not, by default. Traced op by op
(ggml's eval callback, the first token of a 5-token batch against the same token alone, the same
KV prefix; scripts/batch_invariance.py measures the end result) on an AVX2-only EPYC, four paths
change with the number of rows, each by a different order of float additions:

- repacked weights (`use_extra_bufts`, on by default): Q4_K is repacked to q4_K_8x8; rows of a
  pass are taken 4 at a time by a gemm kernel and the rest by a gemv kernel that rounds at other
  points. The first op to differ is the layer-0 Q projection (1.9e-6), 0.37 in the logits.
- ggml's tiled K-quant matmul: any pass of >= 8 rows (TILED_MIN_ROWS) over weights that are not
  repacked (the Q6_K output layer always, Q4_K with repacking off).
- flash attention off: the KQ and KQV products go through llamafile's sgemm for 2+ rows and
  ggml_vec_dot_f16 for one (0.0039 in kq-0 already).
- flash attention on, an f16 or f32 KV cache: a one-token pass over >= 512 cells (a context past
  256 tokens: n_kv is padded to 256) splits the cells across threads and merges partial
  softmaxes; a pass of several rows walks them in one order.

With repacking off, flash attention on, a q8_0 KV cache and passes below TILED_MIN_ROWS, rows
are bitwise equal for every batch size measured (2..9 rows, 3 prompts of ~300 tokens, 12
positions each: max |Δlogit| 0.0 against 0.34-0.67 by default). That is `runtime.exact`.

Decode passes of any length: ggml has a "reference implementation" switch (`use_ref`: no tiled
matmul, no split or tiled flash attention, no fused ops), but per CPU backend, and llama.cpp keeps
its context's backend to itself. `make install` builds llama.cpp with a process-wide switch beside
it (cpu_build's cpu-use-ref-switch), and exact mode's target runs its decode passes (a part asks
for every row's logits) on the reference kernels and its prompt passes on the usual ones
(`pass_kernels`, RuntimeOptions.reference_decode): prompts keep the tiled matmul's speed, and a
decode row no longer depends on how many rows its pass holds. Measured on the 2-core Xeon with
AMX (2026-12-05; 4 prompts, one past 256 tokens, 65 positions each, a process per load): max
|Δlogit| 0 at 2, 17, 33, 40, 48 and 65 rows, AMX's buffer kept or every weight unpacked, against
0.50-0.69 at 8+ rows on the usual kernels. The 7-row limit (EXACT_MAX_ROWS) remains for a build
without the switch (a wheel from elsewhere).

Several sequences in one pass keep this, on one more condition: flash attention walks a
sequence's KV cells in cell order, skipping other sequences' (masked) cells, so the cells must
lie in position order. In llama.cpp's unified cache they need not: a sequence that grows into
cells another one freed puts its newest tokens before its oldest, and its rows then differed by
0.44-0.66 from the same rows with the cells in order. With a KV stream per sequence (kv_unified
off) the rows of a sequence were bitwise equal alone and beside 1-3 other sequences' rows, in
the three fill orders and the fragmented case a script tried (tests/integration/test_exact_mode.py
keeps the fragmented case). Prompt chunks go in passes of their own, cut as a
lone request's are (n_batch tokens): a chunk beside decode rows would make 8+ rows.

The tiled matmul is also a speed question. Turned off, on the AVX2 EPYC (2 threads, repacked
weights, interleaved processes, medians of 3 rounds), target passes of 8 to 12 rows took 9-20 %
less time (9 rows: 310 against 372 ms; 13 to 17 rows: 0-10 %), but prefill took 1-10 % more
(256 tokens: 57.3 against 62.2 tokens/s), four parallel clients got 18.8-22.3 against 25.0-25.5
tokens/s, and code edits sped up 1.42x/1.60x against 1.32x/1.57x with it (noise). So it stays
on, llama.cpp's default, with a switch (`runtime.tiled_matmul`) for other CPUs. Exact mode needs
it most: with weights not repacked, prefill ran at 30-33 tokens/s without it and 61 with it.
ggml reads GGML_CPU_TILED_MM once per process, at the first matrix product, so the first model
loaded decides it for all (`fix_tiled_matmul`).

On a CPU with AMX (and a build with its kernels, cpu_build.py) exact mode keeps the weights that
AMX takes. A Q4_K product there runs one row through AMX's VNNI kernel and 2+ rows through its
tiles, both summing int8 products in int32 (exact), and a row came out the same in every pass
measured. The Q6_K weights stay in the plain buffer (cpu_build's
amx-q6k-outside), where x86 has no repacked layout: a dot product per row. Measured on the
2-core Xeon with AMX (flash attention, q8_0 cache, a stream per sequence; 4 prompts, one past
256 tokens, 17 positions each): max |Δlogit| 0 at 2, 3, 5 and 7 rows, 0.50-0.69 at 8+ rows with
the tiled matmul (the Q6_K weights), 0 at 8-17 rows without it. Without it prompts read ~20 %
slower: hence the switch per pass above. What AMX's buffer changes is the price: a process each,
taking turns, 3 rounds, medians at 300 tokens of context: one-token passes 75 ms against 84
unpacked, 5 rows 156 against 228, 7 rows 182 against 281 (the default mode: 71, 143, 170). Longer
passes on the reference kernels cost about as much per row as a 7-row one (17 rows 348-395 ms, 33
rows 710-753: the Q6_K weights' dot product per row), against 271-404 and 486-523 in the default
mode (docs/measurements.md). This holds only where
every matrix of the file is Q4_K or Q6_K (the types measured; a Q4_K_M file) and llama.cpp put
none of them in its CPU_REPACK buffer, whose gemm and gemv kernels round differently
(`exact_keeps_amx`, `batch_invariant_buffers`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final

from homespec.llama.cpu_build import Q6K_TILED_SWITCH_SYMBOL, REFERENCE_SWITCH_SYMBOL

TILED_ENV = "GGML_CPU_TILED_MM"  # ggml-cpu/tiled/tiled.cpp: "0" turns the tiled matmul off
TILED_MIN_ROWS = 8  # tiled.cpp ggml_tiled_min_batch: passes of this many rows or more take it
# Without the reference switch, exact mode verifies at most this many rows a pass (k <=
# EXACT_MAX_ROWS - 1), so the tiled matmul, whether on or off, never computes a decode row.
EXACT_MAX_ROWS = TILED_MIN_ROWS - 1
EXACT_KV_TYPE: Final = "q8_0"  # no split-KV softmax for one-token passes (f16/f32 caches only)
# The matrix types whose rows were measured batch-invariant with AMX's buffer in use (docstring).
AMX_EXACT_TYPES: Final = frozenset({"Q4_K", "Q6_K"})
AMX_BUFFER: Final = "AMX"  # llama.cpp's name of the buffer type (its "AMX model buffer size" line)
REPACK_BUFFER: Final = "CPU_REPACK"  # the repacked layouts (gemm for rows 4 at a time, gemv for the rest)

_lock = threading.Lock()
_fixed: bool | None = None  # what this process set, once


def fix_tiled_matmul(on: bool | None) -> bool:
    """Set GGML_CPU_TILED_MM for this process before llama.cpp's first matrix product (None:
    leave llama.cpp's default); a value the user exported wins, and so does the first call.
    Returns the setting in effect."""
    global _fixed
    with _lock:
        if _fixed is None:
            if on is not None and TILED_ENV not in os.environ:
                os.environ[TILED_ENV] = "1" if on else "0"
            _fixed = tiled_matmul_in_effect()
        return _fixed


def tiled_matmul_in_effect() -> bool:
    """Whether ggml takes (or will take) its tiled matmul for passes of TILED_MIN_ROWS or more."""
    value = os.environ.get(TILED_ENV)
    return value is None or _atoi(value) != 0  # tiled.cpp: unset, or atoi() non-zero = on


def _atoi(text: str) -> int:
    """C's atoi: optional space and sign, then the leading digits; 0 when there are none."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def exact_keeps_amx(matrix_types: Iterable[str], amx: bool) -> bool:
    """Whether exact mode may load a target whose matrices have these ggml types with llama.cpp's
    extra buffers on: where AMX's buffer is in use (`amx`: `amx_buffer_available`) and every
    type is one measured batch-invariant there (docstring)."""
    types = frozenset(matrix_types)
    return amx and bool(types) and types <= AMX_EXACT_TYPES


def batch_invariant_buffers(weight_buffers: Mapping[str, float]) -> bool:
    """Whether the weights llama.cpp loaded (MiB by buffer type, Runtime.weight_buffers) lie only
    where a row does not depend on its pass: none in the repacked CPU layouts."""
    return REPACK_BUFFER not in weight_buffers


_reference_lock = threading.Lock()  # one pass at a time chooses the process's kernels
_reference_switch: Callable[[bool], None] | None = None
_q6k_tiled_switch: Callable[[bool], None] | None = None  # None: a build without cpu-q6k-columns
_reference_looked = False


def reference_kernels_available() -> bool:
    """Whether this process's llama.cpp can run a pass on its reference CPU kernels (built by
    `make install`, with cpu_build's switch; a wheel from elsewhere has none)."""
    global _reference_switch, _q6k_tiled_switch, _reference_looked
    if not _reference_looked:
        _reference_switch = _find_switch(REFERENCE_SWITCH_SYMBOL)
        _q6k_tiled_switch = _find_switch(Q6K_TILED_SWITCH_SYMBOL)
        _reference_looked = True
    return _reference_switch is not None


@contextlib.contextmanager
def pass_kernels(reference: bool) -> Iterator[None]:
    """Run the pass inside on llama.cpp's reference CPU kernels (`reference`) or on its usual ones,
    whatever another thread's pass asks for meanwhile (they take turns). Exact mode's target runs
    every pass inside, its decode passes on the reference kernels (docstring). Its other passes
    (prompts) leave Q6_K products of 8+ rows to ggml's tiled matmul, which gives a row the same
    result in any such pass, where the wheel's cpu-q6k-columns would take those of up to 65 rows:
    so a prefix read in a pass of 20 rows equals one read in a pass of 60. (Every thread of a
    matrix product reads that switch, so no other graph may compute while it changes: homespec
    runs all passes on one thread, the daemon's worker.)"""
    if not reference_kernels_available():
        raise RuntimeError("this llama.cpp build has no switch for its reference kernels (`make install` builds one)")
    assert _reference_switch is not None
    with _reference_lock:
        _reference_switch(reference)
        if _q6k_tiled_switch is not None:
            _q6k_tiled_switch(not reference)
        try:
            yield
        finally:
            _reference_switch(False)
            if _q6k_tiled_switch is not None:
                _q6k_tiled_switch(False)


def _llama_library() -> ctypes.CDLL:
    """libllama as llama-cpp-python loaded it. Its handle finds ggml's symbols in the copies
    libllama itself uses (dlsym searches a library's dependencies): the wheel holds each library
    twice, as libggml-cpu.so and libggml-cpu.so.0 (no symlinks in a wheel), and loading one by
    path would start a second ggml beside the one that runs the passes."""
    from llama_cpp.llama_cpp import _lib

    return _lib


def _find_switch(symbol: str) -> Callable[[bool], None] | None:
    """A process-wide switch of the wheel's llama.cpp (cpu_build's fixes: ggml's use_ref for every
    CPU backend, or the Q6_K kernel's reach), from the next pass on; None where the build lacks it."""
    try:
        fn = getattr(_llama_library(), symbol)
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [ctypes.c_bool], None
    return fn


_amx: bool | None = None


def amx_buffer_available() -> bool:
    """Whether this process's llama.cpp puts weights in AMX's buffer: built with AMX kernels, and
    the kernel granted the tile state (ggml_amx_init; without it ggml leaves the buffer type out
    of the CPU device's extra buffer types). ggml's backend registry loads on this first call."""
    global _amx
    if _amx is None:
        _amx = AMX_BUFFER in _cpu_extra_buffer_types()
    return _amx


def _cpu_extra_buffer_types() -> list[str]:
    # The CPU device's own list, reached as llama.cpp reaches it (ggml_backend_reg_get_proc_address):
    # llama-cpp-python binds none of these functions.
    libggml = _llama_library()

    libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    libggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    libggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    libggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = libggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return []
    address = libggml.ggml_backend_reg_get_proc_address(libggml.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(dev)  # NULL-terminated
    names, i = [], 0
    while bufts and bufts[i]:
        names.append(libggml.ggml_backend_buft_name(bufts[i]).decode())
        i += 1
    return names
