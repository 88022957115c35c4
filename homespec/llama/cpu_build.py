"""llama.cpp built for the CPU it runs on, and never run on a CPU that lacks what it was built for.

llama-cpp-python compiles llama.cpp from source; which x86 kernels the build contains is decided
by CMake options (GGML_AVX2, GGML_AVX512, ...). A build for the oldest common CPU leaves the
AVX-512 kernels out, and the batched verify pass that speculation lives on is up to ~1.8x cheaper
with them (issue 15: llama-bench pp17, 323 ms AVX-512 against 583 ms AVX2 on the same Xeon). A
native build (-march=native) is fast where it was built and dies with SIGILL elsewhere, and pip's
wheel cache is keyed by version, not by CPU. So the install reads the CPU's flags, turns on
exactly the kernels they allow, builds the wheel into a cache folder named after that set
(`key`), and records the set next to the installed package (`write_stamp`); the daemon compares
the record with /proc/cpuinfo before llama.cpp is loaded (`require_matching_build`).

AMX: HOMESPEC_AMX=on builds llama.cpp's AMX kernels in where the CPU advertises them and a check
proves the tiles work here (a few lines of C that ask the kernel for the tile state, load a tile
configuration and zero a tile); by default they are left out. Built as llama.cpp ships them
with Debian's GCC 12, they died with SIGILL at `tilezero` on the first eval (gdb, 2026-12-01):
GCC 12's `_tile_loadconfig` (amxtileintrin.h) tells the compiler that it reads 8 bytes of the
configuration, so GCC drops the stores of the tiles' rows and columns as dead, and `ldtilecfg`
loads a configuration with no tiles (read in the compiled code, 2026-12-05). `fix_source`
rewrites that one call before every build, the wheel's and the bench's peer's, and the stamp
records it: a build with AMX kernels and without the fix is refused. A second fix keeps Q6_K
weights out of the AMX buffer, where a one-row product decodes slower than the plain kernel.
AMX was on by default from 2026-12-05 (prompts 1.4x faster than ggml's AVX-512 code) until the
wheel's own VNNI kernels below made it dearer: on a 2-core Xeon with AMX (2026-12-07), one
process per build taking turns, with AMX a verify pass of 2-17 rows cost 1.2-1.7x what it costs
without, a 33-row one 1.3x, four requests' one-token pass 1.6x, a one-token pass 1.1x, and
prompts read no faster (README, "The llama.cpp build").

Six more changes are the wheel's alone (`WHEEL_FIXES`); the bench's peer, a later ggml, is built
as published:
- ggml switches its reference kernels (no tiled matmul, no split flash attention, no fused ops)
  per CPU backend, which llama.cpp does not hand out; a process-wide switch beside it lets exact
  mode run its verify passes on them, pass by pass (llama/kernels.py).
- flash attention for passes of up to 65 query rows takes the query heads that share a KV
  head in one tile (source_fixes/flash_attn_grouped.cpp), so verify passes cost no more with it.
- Q6_K products over 2-65 rows unpack each weight block once for all rows, each row's result
  bitwise its one-row result (source_fixes/q6k_columns.c), with a switch for exact mode's prompt
  passes (llama/kernels.py).
- repacked Q4_K products take AVX-512 VNNI where the build has it, ~2.5x cheaper over rows in
  fours and ~1.3x over one row (op timings), each block of weights decoded once for up to 16 rows
  and the 1-3 rows after the fours, each row's result bitwise ggml's one-row gemv's for it: a pass
  of any size gives a row what a one-token pass gives it (source_fixes/q4k_vnni.cpp). Builds
  without VNNI take AVX2 kernels with the same property over 2 rows and more
  (source_fixes/q4k_avx2.cpp).
- so do the repacked Q4_0 products (a requantized draft's), 1-3 rows in one call, each result
  bitwise ggml's (source_fixes/q4_0_vnni.cpp).
- the threads take a product over a quantized weight outside those paths (Q6_K: the output layer)
  in chunks of up to ~256 KiB of it, not 16 rows; each chunk cost ~0.7 us more with two threads
  (source_fixes/weight_chunks.c). No result changes.

This file runs before homespec is installed (`python homespec/llama/cpu_build.py cmake-args`), so
it imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# CMake option -> the /proc/cpuinfo flags its compiler flags need (ggml/src/ggml-cpu/CMakeLists.txt:
# GGML_AVX512 adds -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw). In dependency order.
OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_F16C": ("f16c",),
    "GGML_FMA": ("fma",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX2": ("avx2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
    "GGML_AMX_TILE": ("amx_tile",),
    "GGML_AMX_INT8": ("amx_tile", "amx_int8"),
    "GGML_AMX_BF16": ("amx_tile", "amx_bf16"),
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

# Where the record of the build's options lives: beside the installed llama_cpp package.
STAMP_NAME = "homespec-cpu-build.json"

# Changes made to llama.cpp's source before it is built: (name, file in the llama.cpp tree, text,
# replacement). The names go into the build's cache key and its stamp.
AMX_FIX = "amx-tile-config"
AMX_Q6K_FIX = "amx-q6k-outside"
SOURCE_FIXES: tuple[tuple[str, str, str, str], ...] = (
    # The whole 64-byte configuration as the operand, so its stores stay (module docstring).
    (AMX_FIX, "ggml/src/ggml-cpu/amx/mmq.cpp",
     "    _tile_loadconfig(&tc);\n",
     "    __asm__ volatile (\"ldtilecfg %0\" :: \"m\" (tc));  // homespec: GCC 12 drops the stores for _tile_loadconfig\n"),
    # Q6_K weights (the output layer, half of ffn_down and attn_v in a Q4_K_M file) stay out of
    # the AMX buffer: there a one-row product runs a VNNI kernel over the tile layout that
    # decodes slower than the plain Q6_K kernel, and the output layer reads one row in a prefill
    # anyway (module docstring).
    (AMX_Q6K_FIX, "ggml/src/ggml-cpu/amx/amx.cpp",
     "            case GGML_TYPE_Q6_K:\n            case GGML_TYPE_IQ4_XS:\n",
     "            case GGML_TYPE_IQ4_XS:  // homespec: no GGML_TYPE_Q6_K, it decodes faster outside AMX\n"),
)

def _fix_text(name: str) -> str:
    """A longer fix's code, kept as C++ in source_fixes/ beside this file."""
    return (Path(__file__).resolve().parent / "source_fixes" / name).read_text()


FA_GROUPED_FIX = "cpu-fa-grouped-heads"
_OPS = "ggml/src/ggml-cpu/ops.cpp"
_FA_F16 = "static void ggml_compute_forward_flash_attn_ext_f16(\n"  # the kernel goes before it
_FA_SPLIT = "    if (use_split_kv_path) {\n"  # the dispatch goes before it
Q6K_COLUMNS_FIX = "cpu-q6k-columns"
# void (bool), exported by libggml-cpu: while set, Q6_K passes of 8+ rows keep ggml's tiled matmul
# (exact mode's prompt passes, llama/kernels.py).
Q6K_TILED_SWITCH_SYMBOL = "homespec_cpu_set_q6k_tiled_from_8"
_CPU_C = "ggml/src/ggml-cpu/ggml-cpu.c"
_MUL_MAT_CHUNK = "static void ggml_compute_forward_mul_mat_one_chunk(\n"  # the kernel goes before it
_TILED_MM = "    if (ggml_compute_forward_mul_mat_tiled(params, dst)) {\n"  # ggml's tiled matmul, which passes of 8+ rows take
_MUL_MAT_TILES = "    // attempt to reduce false-sharing (does not seem to make a difference)\n"  # the dispatch before it
WEIGHT_CHUNKS_FIX = "cpu-weight-chunks"
# void (bool), exported by libggml-cpu: ggml's own chunks while off (default on), for paired timing,
# never changed by the daemon.
WEIGHT_CHUNKS_SWITCH_SYMBOL = "homespec_cpu_set_weight_chunks"
_MUL_MAT = "void ggml_compute_forward_mul_mat(\n"  # the chunk plan's helper goes before it
_NCHUNK0 = "    // CEIL(nr0/chunk_size)\n    int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;\n"  # mul_mat's chunks of weight rows
Q4K_VNNI_FIX = "cpu-q4k-vnni"
# bool (bool), exported by libggml-cpu: ggml's own Q4_K gemm and gemv while off (default on), for
# the op-level check and paired timing, never changed by the daemon; returns whether the build has
# the kernels (AVX-512 with VNNI, or AVX2 with FMA and F16C).
Q4K_VNNI_SWITCH_SYMBOL = "homespec_cpu_set_q4k_vnni"
_X86_REPACK = "ggml/src/ggml-cpu/arch/x86/repack.cpp"
_Q4K_ARGS = "(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int nr, int nc) {\n"
_Q4K_GEMV = "void ggml_gemv_q4_K_8x8_q8_K" + _Q4K_ARGS  # the kernels go before it, a dispatch first in it
_Q4K_GEMM = "void ggml_gemm_q4_K_8x8_q8_K" + _Q4K_ARGS  # a dispatch first in it
Q4_0_VNNI_FIX = "cpu-q4_0-vnni"
# bool (bool), exported by libggml-cpu: ggml's own Q4_0 gemv and gemm while off (default on), for the
# op-level check and paired timing, never changed by the daemon; returns whether the build has the
# kernels (AVX-512 with VNNI).
Q4_0_VNNI_SWITCH_SYMBOL = "homespec_cpu_set_q4_0_vnni"
_Q4_0_GEMV = "void ggml_gemv_q4_0_8x8_q8_0" + _Q4K_ARGS  # the kernels go before it, a dispatch first in it
_Q4_0_GEMM = "void ggml_gemm_q4_0_8x8_q8_0" + _Q4K_ARGS  # a dispatch first in it
_REPACK = "ggml/src/ggml-cpu/repack.cpp"
_REPACK_INCLUDES = "#include <cstring>\n"  # the row loop's declaration after it
_REPACK_ROW_LOOP = "        for (int iter = nrows - (nrows % 4); iter < nrows; iter++) {\n"  # the rows the gemm leaves, one at a time
_REPACK_GEMM = "        // If there are more than three rows in src1, use gemm; otherwise, use gemv.\n"  # ggml's gemm call after it

# Changes to llama-cpp-python's llama.cpp only (the bench's peer, a later ggml, has no use_ref). A
# fix may take several entries of one name.
USE_REF_FIX = "cpu-use-ref-switch"
REFERENCE_SWITCH_SYMBOL = "homespec_cpu_set_use_ref"  # void (bool), exported by libggml-cpu (llama/kernels.py)
WHEEL_FIXES: tuple[tuple[str, str, str, str], ...] = SOURCE_FIXES + (
    # ggml's "reference implementation" switch (no tiled matmul, no split or tiled flash attention,
    # no fused ops) is per CPU backend, and llama.cpp keeps its context's backend to itself. This
    # process-wide switch lets exact mode take those paths for decode passes only, pass by pass
    # (llama/kernels.py), and keep the tiled matmul for prompts.
    (USE_REF_FIX, "ggml/src/ggml-cpu/ggml-cpu.cpp",
     "static const char * ggml_backend_cpu_get_name(ggml_backend_t backend) {\n",
     "#include <atomic>  // homespec: the process-wide reference switch\n"
     "static std::atomic<bool> homespec_use_ref{false};\n"
     f"extern \"C\" {{ GGML_BACKEND_API void {REFERENCE_SWITCH_SYMBOL}(bool use_ref) {{ homespec_use_ref.store(use_ref); }} }}\n"
     "\n"
     "static const char * ggml_backend_cpu_get_name(ggml_backend_t backend) {\n"),
    (USE_REF_FIX, "ggml/src/ggml-cpu/ggml-cpu.cpp",
     "    cplan.use_ref             = cpu_ctx->use_ref;\n",
     "    cplan.use_ref             = cpu_ctx->use_ref || homespec_use_ref.load();  // homespec\n"),
    # Flash attention for passes of a few query rows with each KV head's query heads in one tile
    # (source_fixes/flash_attn_grouped.cpp says how); the reference switch still takes ggml's own.
    (FA_GROUPED_FIX, _OPS, _FA_F16, _fix_text("flash_attn_grouped.cpp") + _FA_F16),
    (FA_GROUPED_FIX, _OPS, _FA_SPLIT, _fix_text("flash_attn_grouped_dispatch.cpp") + _FA_SPLIT),
    # Q6_K weights against the 2-65 rows of a verify pass or of requests decoding together: each
    # block unpacked once for all rows, every result bitwise ggml's one-row result, and ggml's
    # tiled matmul left to passes of 66+ rows (source_fixes/q6k_columns.c).
    (Q6K_COLUMNS_FIX, _CPU_C, _MUL_MAT_CHUNK, _fix_text("q6k_columns.c") + _MUL_MAT_CHUNK),
    (Q6K_COLUMNS_FIX, _CPU_C, _MUL_MAT_TILES, _fix_text("q6k_columns_dispatch.c") + _MUL_MAT_TILES),
    (Q6K_COLUMNS_FIX, _CPU_C, _TILED_MM, _TILED_MM.replace("if (", "if (!homespec_q6k_columns_take(dst) && ")),
    # Repacked Q4_K weights against rows in fours and against one row with AVX-512 VNNI, every
    # row's result bitwise ggml's gemv's for it alone (source_fixes/q4k_vnni.cpp); builds without
    # VNNI take AVX2 kernels for 2 rows and more (q4k_avx2.cpp); both share one switch
    # (q4k_switch.cpp).
    (Q4K_VNNI_FIX, _X86_REPACK, _Q4K_GEMV, _fix_text("q4k_vnni.cpp") + _fix_text("q4k_avx2.cpp") + _fix_text("q4k_switch.cpp")
     + _Q4K_GEMV + _fix_text("q4k_vnni_gemv_dispatch.cpp")),
    (Q4K_VNNI_FIX, _X86_REPACK, _Q4K_GEMM, _Q4K_GEMM + _fix_text("q4k_vnni_dispatch.cpp")),
    # ... and the 2-3 rows the gemm leaves over in one call (a pass of 3 rows cost more than one of 4):
    # one hook in ggml's row loop for both VNNI layouts, Q4_K and Q4_0 (Q4_0_VNNI_FIX declares its query)
    (Q4K_VNNI_FIX, _REPACK, _REPACK_INCLUDES, _REPACK_INCLUDES + _fix_text("q4k_vnni_rows_decl.cpp")),
    (Q4K_VNNI_FIX, _REPACK, _REPACK_ROW_LOOP, _fix_text("q4k_vnni_rows.cpp") + _REPACK_ROW_LOOP),
    # ... or, past four rows, in the gemm's own call: each block of weights read and unpacked once for all rows
    (Q4K_VNNI_FIX, _REPACK, _REPACK_GEMM, _fix_text("q4k_vnni_rest.cpp") + _REPACK_GEMM),
    # Repacked Q4_0 weights (the draft's) against 1-3 rows in one call and rows in fours, with AVX-512
    # VNNI, every result bitwise ggml's (source_fixes/q4_0_vnni.cpp): a draft step's pass over 2
    # tokens cost 1.5x one over 1.
    (Q4_0_VNNI_FIX, _X86_REPACK, _Q4_0_GEMV, _fix_text("q4_0_vnni.cpp") + _Q4_0_GEMV + _fix_text("q4_0_vnni_gemv_dispatch.cpp")),
    (Q4_0_VNNI_FIX, _X86_REPACK, _Q4_0_GEMM, _Q4_0_GEMM + _fix_text("q4_0_vnni_dispatch.cpp")),
    (Q4_0_VNNI_FIX, _REPACK, _REPACK_INCLUDES, _REPACK_INCLUDES + _fix_text("q4_0_vnni_rows_decl.cpp")),
    # A product over a quantized weight (outside the repacked and tiled paths: Q6_K) in chunks of
    # up to ~256 KiB of weight rows rather than 16 rows, which cost ~0.7 us each with two threads
    # (source_fixes/weight_chunks.c).
    (WEIGHT_CHUNKS_FIX, _CPU_C, _MUL_MAT, _fix_text("weight_chunks.c") + _MUL_MAT),
    (WEIGHT_CHUNKS_FIX, _CPU_C, _NCHUNK0, "    // CEIL(nr0/chunk_size)\n" + _fix_text("weight_chunks_plan.c")),
)

# Asks for the AMX tile state (Linux >= 5.16 gives it on request only), then loads a tile
# configuration and zeroes a tile: the instructions ggml's AMX kernels start with.
_AMX_CHECK_C = r"""
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 2;
    uint8_t cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;                      /* palette 1 */
    cfg[16] = 64; cfg[48] = 16;      /* tile 0: 16 rows of 64 bytes */
    __asm__ volatile("ldtilecfg %0" :: "m"(cfg));
    __asm__ volatile("tilezero %%tmm0" ::);
    __asm__ volatile("tilerelease" ::);
    return 0;
}
"""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags of this CPU (the first `flags` line of /proc/cpuinfo); empty
    when there is none (not Linux, not x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def amx_works(cc: str | None = None) -> bool:
    """Compile and run the AMX check; False when there is no compiler or anything fails."""
    cc = cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "amx.c"), Path(tmp, "amx")
        src.write_text(_AMX_CHECK_C)
        try:
            subprocess.run([cc, "-O0", "-mamx-tile", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=60)
            return subprocess.run([str(exe)], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def fix_source(llama_cpp: Path, fixes: tuple[tuple[str, str, str, str], ...] = SOURCE_FIXES) -> list[str]:
    """Apply `fixes` (default: those both builds take) to the llama.cpp tree at `llama_cpp`; the
    names of the fixes now in it. A fix whose text is found neither before nor after is an error:
    the source is not the one it was written for, and building it unfixed would crash where the
    fix is needed, or lack what homespec calls."""
    for name, rel, text, replacement in fixes:
        path = Path(llama_cpp) / rel
        source = path.read_text()
        # What the fix adds, on either side of its line where it keeps the line: another fix at the
        # same line may have gone between them since
        added = [part for part in replacement.split(text, 1) if part] if text in replacement else [replacement]
        if not all(part in source for part in added):
            if source.count(text) != 1:
                raise RuntimeError(f"{path}: the line fix {name!r} replaces is not there once; not building this source")
            path.write_text(source.replace(text, replacement))
    return fix_names(fixes)


def fix_names(fixes: tuple[tuple[str, str, str, str], ...] = WHEEL_FIXES) -> list[str]:
    """The names of `fixes` (default: the wheel's), once each, in order."""
    return list(dict.fromkeys(name for name, *_ in fixes))


def fixes_key(fixes: tuple[tuple[str, str, str, str], ...] = WHEEL_FIXES) -> str:
    """The fixes as the wheel's cache key takes them: their names and a digest of what they
    change, so that a fix edited under the same name builds a new wheel."""
    digest = hashlib.sha256(repr(fixes).encode()).hexdigest()[:12]
    return " ".join([*fix_names(fixes), digest])


def choose(flags: set[str], amx: bool = False) -> dict[str, bool]:
    """Each option on exactly when the CPU has every flag it needs (AMX only when `amx`, the
    check's result). Every option is named, ON or OFF: ggml turns several on by default."""
    out = {}
    for option, needs in OPTIONS.items():
        on = all(f in flags for f in needs)
        out[option] = on and (amx or option not in AMX_OPTIONS)
    return out


def cmake_args(options: dict[str, bool]) -> str:
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-D{k}={'ON' if v else 'OFF'}" for k, v in options.items()])


def this_cpu_options(want_amx: bool | None = None) -> dict[str, bool]:
    """The kernels for this CPU's flags (AMX: `_amx_here`, wanted as HOMESPEC_AMX says unless
    `want_amx` says otherwise); none on a CPU that is not x86."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return {}
    flags = cpu_flags()
    return choose(flags, amx=_amx_here(flags, amx_wanted() if want_amx is None else want_amx))


def amx_wanted(environ: dict[str, str] | None = None) -> bool:
    """llama.cpp's AMX kernels are built where the tiles work only when HOMESPEC_AMX=on asks for
    them (module docstring: with the wheel's VNNI kernels every pass costs more with them)."""
    return (os.environ if environ is None else environ).get("HOMESPEC_AMX", "off").lower() == "on"


def _amx_here(flags: set[str], wanted: bool) -> bool:
    """AMX only when wanted, advertised, and the tile check runs here."""
    return "amx_tile" in flags and wanted and amx_works()


def key(options: dict[str, bool]) -> str:
    """A short name for the set of kernels, for the wheel cache folder ("avx2-bmi2-f16c-fma...")."""
    on = [k.removeprefix("GGML_").lower() for k, v in options.items() if v]
    return "-".join(on) or "generic"


def required_flags(options: dict[str, bool]) -> set[str]:
    """The CPU flags a build with these options needs to run."""
    return {f for option, on in options.items() if on for f in OPTIONS.get(option, ())}


# With GGML_NATIVE=OFF, ggml turns these on unless told otherwise (INS_ENB in its CMakeLists).
_DEFAULT_ON = ("GGML_SSE42", "GGML_AVX", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX2")


def options_from_args(args: str, flags: set[str], amx: bool = False) -> dict[str, bool]:
    """The kernels a build with these CMAKE_ARGS contains (for a build configured by hand, e.g.
    with CUDA): GGML_NATIVE on (ggml's default) means everything this CPU has."""
    named = {}
    for word in args.split():
        if word.startswith("-DGGML_") and "=" in word:
            name, value = word[2:].split("=", 1)
            named[name] = value.upper() in ("ON", "1", "TRUE", "YES")
    if named.get("GGML_NATIVE", True):
        return choose(flags, amx=amx)
    return {k: named.get(k, k in _DEFAULT_ON) for k in OPTIONS}


def write_stamp(package_dir: Path, options: dict[str, bool], fixes: list[str] | None = None) -> Path:
    """Record the build's kernels and the source fixes it was built with (default: all of them,
    as `build_wheel` applies them)."""
    path = Path(package_dir) / STAMP_NAME
    record = {"options": options, "fixes": fix_names() if fixes is None else fixes, "machine": platform.machine()}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def read_stamp(package_dir: Path) -> dict[str, bool] | None:
    """The options the installed llama.cpp was built with; None when it was not built by the
    install (a wheel from elsewhere, a GPU build by hand)."""
    try:
        raw = json.loads((Path(package_dir) / STAMP_NAME).read_text())
        return {str(k): bool(v) for k, v in raw["options"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_fixes(package_dir: Path) -> list[str]:
    """The source fixes the installed llama.cpp was built with (none for a stamp from before they
    were recorded)."""
    try:
        return [str(f) for f in json.loads((Path(package_dir) / STAMP_NAME).read_text()).get("fixes", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def has_grouped_attention() -> bool:
    """The installed llama.cpp has FA_GROUPED_FIX, with which verify passes cost about what they
    cost without flash attention (README, "The llama.cpp build")."""
    folder = installed_package_dir()
    return folder is not None and FA_GROUPED_FIX in read_fixes(folder)


def rows_batch_invariant(options: dict[str, bool], fixes: list[str]) -> bool:
    """A build whose default passes of up to 65 rows give each row of a Q4_K_M model bitwise what
    a one-token pass gives it, so greedy speculation says what plain decoding says without exact
    mode: the wheel's Q4_K gemm (AVX-512 VNNI kernels, or AVX2 ones where the build has no VNNI;
    both need AVX2, FMA and F16C), Q6_K columns and grouped flash attention, and no AMX, whose
    buffer would take the Q4_K weights (README, Exact mode)."""
    kernels = all(options.get(k, False) for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C"))
    amx = any(options.get(k, False) for k in AMX_OPTIONS)
    return kernels and not amx and {Q4K_VNNI_FIX, Q6K_COLUMNS_FIX, FA_GROUPED_FIX} <= set(fixes)


def missing_flags(options: dict[str, bool], flags: set[str]) -> list[str]:
    """Flags the build needs and this CPU lacks (empty: safe to load). No flags known (not x86
    Linux): nothing can be checked, nothing is reported."""
    if not flags:
        return []
    return sorted(required_flags(options) - flags)


def installed_package_dir() -> Path | None:
    """The folder of the installed llama_cpp package, found without importing (loading) it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def installed_options() -> dict[str, bool] | None:
    """The kernel options the installed llama_cpp was built with (its stamp); None for a build
    without one (installed by hand) or no llama_cpp at all."""
    folder = installed_package_dir()
    return read_stamp(folder) if folder is not None else None


def require_matching_build() -> None:
    """Refuse to load a llama.cpp built for instructions this CPU lacks: it would die with SIGILL
    somewhere inside a matrix multiply. Called before llama_cpp is imported; a build without a
    record (installed by hand) is trusted."""
    from homespec.errors import ModelError  # here: the Makefile runs this file without homespec

    folder = installed_package_dir()
    options = read_stamp(folder) if folder is not None else None
    missing = missing_flags(options, cpu_flags()) if options is not None else []
    if missing:
        raise ModelError(f"llama.cpp in {folder} was built for a CPU with {', '.join(missing)}, which this CPU lacks "
                         f"(it would crash): rebuild it for this machine with `make install`")
    if options is not None and any(options.get(k) for k in AMX_OPTIONS) and AMX_FIX not in read_fixes(folder):
        raise ModelError(f"llama.cpp in {folder} was built with its AMX kernels but without homespec's fix for them "
                         f"(they crash with SIGILL): rebuild it with `make install`")


def build_wheel(version: str, dest: Path) -> None:
    """llama-cpp-python's source from PyPI, SOURCE_FIXES applied, built into a wheel in `dest`
    (CMAKE_ARGS from the environment: the Makefile's). pip's `--no-binary` build of the release
    would compile the source as published."""
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory(prefix="homespec-llama-") as tmp:
        subprocess.run([*pip, "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        f"llama-cpp-python=={version}"], check=True)
        with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{version}"
        print(f"llama.cpp source fixes: {', '.join(fix_source(src / 'vendor' / 'llama.cpp', WHEEL_FIXES)) or 'none'}")
        subprocess.run([*pip, "wheel", "--no-deps", "--no-cache-dir", "-w", str(dest), str(src)], check=True)


def _main(argv: list[str]) -> int:
    """`cmake-args`: the CMAKE_ARGS for this CPU; `fixes`: the source fixes' names (for the cache
    key); `wheel VERSION DEST`: build the fixed wheel; `stamp DIR ARGS`: record in DIR (the
    installed llama_cpp package) the kernels a build with CMAKE_ARGS contains."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    if argv[:1] == ["cmake-args"]:
        print(cmake_args(this_cpu_options()) if x86 else "")
    elif argv[:1] == ["fixes"]:
        print(fixes_key())
    elif argv[:1] == ["wheel"] and len(argv) == 3:
        try:
            build_wheel(argv[1], Path(argv[2]))
        except (OSError, RuntimeError, StopIteration, subprocess.CalledProcessError) as e:
            print(f"cpu_build.py wheel: {e or 'no llama-cpp-python source came down'}", file=sys.stderr)
            return 1
    elif argv[:1] == ["stamp"] and len(argv) == 3:
        flags = cpu_flags() if x86 else set()
        options = options_from_args(argv[2], flags, amx=_amx_here(flags, amx_wanted())) if x86 else {}
        print(f"{write_stamp(Path(argv[1]), options)}: {key(options)}")
    else:
        print("usage: cpu_build.py cmake-args | fixes | wheel VERSION DEST | stamp PACKAGE_DIR CMAKE_ARGS", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
