"""Choosing llama.cpp's kernels from the CPU's flags, and refusing a build on a CPU that lacks
what it was built for (homespec/llama/cpu_build.py). Flags are scripted: no compiler, no CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from homespec.llama import cpu_build as cb

# /proc/cpuinfo flags of the two machines this project has seen (abridged to what matters).
EPYC_AVX2 = set("sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2".split())
XEON_AMX = EPYC_AVX2 | set("avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni "
                          "amx_tile amx_int8 amx_bf16".split())
# An older CPU without AVX2 or FMA (Sandy Bridge): ggml's SSE/AVX code, no homespec kernels.
SANDY_BRIDGE_AVX = set("sse sse2 ssse3 sse4_1 sse4_2 avx".split())


def test_an_avx2_cpu_gets_the_avx2_kernels_and_nothing_wider() -> None:
    on = {k for k, v in cb.choose(EPYC_AVX2).items() if v}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX2"}


def test_an_avx512_cpu_gets_the_avx512_kernels_and_amx_only_when_the_check_passed() -> None:
    without = cb.choose(XEON_AMX, amx=False)
    assert all(without[k] for k in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI"))
    assert not any(without[k] for k in cb.AMX_OPTIONS)
    assert all(cb.choose(XEON_AMX, amx=True)[k] for k in cb.AMX_OPTIONS)


def test_amx_is_left_out_by_default_and_built_only_when_asked_for() -> None:
    assert cb.amx_wanted({"HOMESPEC_AMX": "on"}) and cb.amx_wanted({"HOMESPEC_AMX": "ON"})
    assert not cb.amx_wanted({}) and not cb.amx_wanted({"HOMESPEC_AMX": "off"}) and not cb.amx_wanted({"HOMESPEC_AMX": "auto"})


def test_amx_comes_only_when_asked_for_and_where_the_tile_check_passes(monkeypatch) -> None:
    monkeypatch.setattr(cb.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: XEON_AMX)
    monkeypatch.setattr(cb, "amx_works", lambda cc=None: True)
    monkeypatch.delenv("HOMESPEC_AMX", raising=False)
    assert not any(cb.this_cpu_options()[k] for k in cb.AMX_OPTIONS)
    monkeypatch.setenv("HOMESPEC_AMX", "on")
    assert all(cb.this_cpu_options()[k] for k in cb.AMX_OPTIONS)
    monkeypatch.setattr(cb, "amx_works", lambda cc=None: False)  # advertised, but the kernel refuses the tiles
    options = cb.this_cpu_options()
    assert not any(options[k] for k in cb.AMX_OPTIONS) and options["GGML_AVX512_VNNI"]


def test_avx512_needs_all_five_of_its_subsets() -> None:
    assert not cb.choose(EPYC_AVX2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq"})["GGML_AVX512"]


def test_every_option_is_named_on_or_off_because_ggml_turns_some_on_by_default() -> None:
    args = cb.cmake_args(cb.choose(set()))
    assert args.startswith("-DGGML_NATIVE=OFF") and "-DGGML_AVX2=OFF" in args and "-DGGML_SSE42=OFF" in args
    assert args.count("-D") == len(cb.OPTIONS) + 1


def test_the_cache_key_differs_between_cpus_that_need_different_builds() -> None:
    assert cb.key(cb.choose(EPYC_AVX2)) != cb.key(cb.choose(XEON_AMX))
    assert cb.key(cb.choose(EPYC_AVX2)) == cb.key(cb.choose(EPYC_AVX2 | {"sse4a", "misalignsse"}))  # flags no kernel uses


def test_a_build_for_the_xeon_is_refused_on_the_epyc_naming_the_missing_instructions(tmp_path: Path) -> None:
    cb.write_stamp(tmp_path, cb.choose(XEON_AMX))
    recorded = cb.read_stamp(tmp_path)
    assert recorded is not None
    assert "avx512f" in cb.missing_flags(recorded, EPYC_AVX2) and "amx_tile" not in cb.missing_flags(recorded, EPYC_AVX2)
    assert cb.missing_flags(cb.choose(EPYC_AVX2), XEON_AMX) == []  # the narrower build runs on the wider CPU


def test_no_record_or_no_cpu_flags_means_nothing_to_check(tmp_path: Path) -> None:
    assert cb.read_stamp(tmp_path) is None
    assert cb.missing_flags(cb.choose(XEON_AMX), set()) == []


def test_flags_come_from_the_first_flags_line() -> None:
    info = "processor : 0\nflags\t\t: fpu avx2 fma\nbugs : x\nprocessor : 1\nflags : fpu\n"
    assert cb.cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cb.cpu_flags("no flags here") == set()


def test_the_script_runs_with_only_the_standard_library() -> None:
    """The Makefile runs it before homespec (or anything) is installed."""
    script = Path(cb.__file__)
    out = subprocess.run([sys.executable, "-I", "-S", str(script), "cmake-args"], capture_output=True, text=True, check=True)
    flags = cb.cpu_flags()
    if flags:
        assert "-DGGML_NATIVE=OFF" in out.stdout
        assert ("-DGGML_AVX2=ON" in out.stdout) == ("avx2" in flags)


def test_options_of_a_hand_configured_build_are_read_from_its_cmake_args() -> None:
    cuda = cb.options_from_args("-DGGML_CUDA=on -DGGML_NATIVE=OFF -DGGML_AVX512=ON", EPYC_AVX2)
    assert cuda["GGML_AVX512"] and cuda["GGML_AVX2"] and not cuda["GGML_AVX512_VNNI"]  # ggml's defaults fill the rest
    assert cb.options_from_args("-DGGML_CUDA=on", XEON_AMX) == cb.choose(XEON_AMX)  # native: what this CPU has
    assert cb.options_from_args(cb.cmake_args(cb.choose(EPYC_AVX2)), XEON_AMX) == cb.choose(EPYC_AVX2)


def test_doctor_refuses_to_load_a_build_this_cpu_cannot_run(monkeypatch, tmp_path: Path, capsys) -> None:
    import argparse

    from homespec.cli import doctor

    cb.write_stamp(tmp_path, cb.choose(XEON_AMX))
    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: EPYC_AVX2)
    assert doctor.main(argparse.Namespace(no_amx_check=True)) == 1
    out = capsys.readouterr().out
    assert "mismatch" in out and "avx512f" in out and "make install" in out


def test_doctor_suggests_amx_only_when_asked_for_and_the_tiles_work(monkeypatch, tmp_path: Path, capsys) -> None:
    import argparse

    from homespec.cli import doctor

    cb.write_stamp(tmp_path, cb.choose(XEON_AMX))  # the default build: no AMX
    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: XEON_AMX)
    for asked in (False, True):
        if asked:
            monkeypatch.setenv("HOMESPEC_AMX", "on")
        else:
            monkeypatch.delenv("HOMESPEC_AMX", raising=False)
        for works in (True, False):
            monkeypatch.setattr(cb, "amx_works", lambda cc=None, works=works: works)
            assert doctor.main(argparse.Namespace(no_amx_check=False)) == 0
            match = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("match:"))
            assert ("GGML_AMX_INT8" in match and "make install" in match) == (asked and works), match


def test_doctor_says_an_amx_build_not_asked_for_is_rebuilt_without_it(monkeypatch, tmp_path: Path, capsys) -> None:
    import argparse

    from homespec.cli import doctor

    cb.write_stamp(tmp_path, cb.choose(XEON_AMX, amx=True), cb.fix_names())  # built while AMX was the default
    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: XEON_AMX)
    monkeypatch.setattr(cb, "amx_works", lambda cc=None: True)
    monkeypatch.delenv("HOMESPEC_AMX", raising=False)
    assert doctor.main(argparse.Namespace(no_amx_check=False)) == 0
    match = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("match:"))
    assert "AMX" in match and "make install" in match, match


def test_only_the_wheels_q4k_kernels_without_amx_make_a_build_rows_batch_invariant() -> None:
    fixes = cb.fix_names()
    assert cb.rows_batch_invariant(cb.choose(XEON_AMX), fixes)  # AVX-512 VNNI kernels
    assert cb.rows_batch_invariant(cb.choose(EPYC_AVX2), fixes)  # AVX2 kernels
    assert not cb.rows_batch_invariant(cb.choose(SANDY_BRIDGE_AVX), fixes)  # ggml's own code
    assert not cb.rows_batch_invariant(cb.choose(XEON_AMX, amx=True), fixes)  # AMX's buffer takes Q4_K
    assert not cb.rows_batch_invariant(cb.choose(XEON_AMX), [f for f in fixes if f != cb.Q4K_VNNI_FIX])
    assert not cb.rows_batch_invariant({}, fixes)  # not x86, or installed by hand


def test_doctor_says_greedy_speculation_equals_plain_decoding_only_where_the_build_makes_it_so(monkeypatch, tmp_path: Path, capsys) -> None:
    import argparse

    from homespec.cli import doctor

    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    for flags, same in ((XEON_AMX, True), (EPYC_AVX2, True), (SANDY_BRIDGE_AVX, False)):
        cb.write_stamp(tmp_path, cb.choose(flags))
        monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None, flags=flags: flags)
        assert doctor.main(argparse.Namespace(no_amx_check=True)) == 0
        greedy = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("greedy:"))
        assert ("as plain decoding does" in greedy) == same and ("runtime.exact" in greedy) == (not same), greedy


def test_the_runtime_refuses_a_build_for_another_cpu_before_loading_it(monkeypatch, tmp_path: Path) -> None:
    import pytest

    from homespec.errors import ModelError

    cb.write_stamp(tmp_path, cb.choose(XEON_AMX))
    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: EPYC_AVX2)
    with pytest.raises(ModelError, match="avx512f.*make install"):
        cb.require_matching_build()
    cb.write_stamp(tmp_path, cb.choose(EPYC_AVX2))
    cb.require_matching_build()  # the right build passes


def test_the_runtime_refuses_a_build_with_amx_kernels_but_without_the_tile_config_fix(monkeypatch, tmp_path: Path) -> None:
    import pytest

    from homespec.errors import ModelError

    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: XEON_AMX)
    cb.write_stamp(tmp_path, cb.choose(XEON_AMX, amx=True), fixes=[])  # built as llama.cpp ships it: SIGILL
    with pytest.raises(ModelError, match="AMX kernels but without.*make install"):
        cb.require_matching_build()
    (tmp_path / cb.STAMP_NAME).write_text(json.dumps({"options": cb.choose(XEON_AMX, amx=True)}))  # stamp of an older install
    with pytest.raises(ModelError, match="AMX kernels but without"):
        cb.require_matching_build()
    cb.write_stamp(tmp_path, cb.choose(XEON_AMX, amx=True))
    assert cb.read_fixes(tmp_path) == cb.fix_names() and cb.AMX_FIX in cb.fix_names()
    cb.require_matching_build()
    cb.write_stamp(tmp_path, cb.choose(XEON_AMX, amx=False), fixes=[])  # no AMX kernels: nothing to fix
    cb.require_matching_build()


MMQ_INIT = """inline void ggml_tile_config_init(void) {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    _tile_loadconfig(&tc);
    done = true;
}
"""


# The lines of ggml-cpu/amx/amx.cpp's supports_op that say which weight types AMX takes.
AMX_TYPES = """            case GGML_TYPE_Q4_K:
            case GGML_TYPE_Q5_K:
            case GGML_TYPE_Q6_K:
            case GGML_TYPE_IQ4_XS:
                alignment = 256; // QK_K
                break;
"""


def _llama_tree(root: Path, mmq: str = MMQ_INIT, amx: str = AMX_TYPES) -> Path:
    for name, text in (("mmq.cpp", mmq), ("amx.cpp", amx)):
        path = root / "ggml/src/ggml-cpu/amx" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_fixes_apply_once_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    tree = _llama_tree(tmp_path)
    assert cb.fix_source(tree) == ["amx-tile-config", "amx-q6k-outside"]
    mmq, amx = (tree / "ggml/src/ggml-cpu/amx/mmq.cpp").read_text(), (tree / "ggml/src/ggml-cpu/amx/amx.cpp").read_text()
    assert "_tile_loadconfig(&tc)" not in mmq and '"ldtilecfg %0" :: "m" (tc)' in mmq
    cases = [line.split("//")[0].strip() for line in amx.splitlines() if line.strip().startswith("case ")]
    assert cases == ["case GGML_TYPE_Q4_K:", "case GGML_TYPE_Q5_K:", "case GGML_TYPE_IQ4_XS:"]  # Q6_K no longer AMX's
    assert cb.fix_source(tree) == ["amx-tile-config", "amx-q6k-outside"]
    assert (tree / "ggml/src/ggml-cpu/amx/mmq.cpp").read_text() == mmq
    assert (tree / "ggml/src/ggml-cpu/amx/amx.cpp").read_text() == amx


# The two lines of ggml-cpu/ggml-cpu.cpp the reference switch is written at.
CPU_BACKEND = """static const char * ggml_backend_cpu_get_name(ggml_backend_t backend) {
    return "CPU";
}
    cplan.use_ref             = cpu_ctx->use_ref;
"""


# The two lines of ggml-cpu/ops.cpp the grouped flash-attention kernel and its dispatch go before.
OPS = """static void ggml_compute_forward_flash_attn_ext_f16(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
    if (use_split_kv_path) {
    }
}
"""


# The lines of ggml-cpu/ggml-cpu.c the Q6_K kernel, its dispatch, the tiled matmul's condition and
# the chunk plan are written at (mul_mat_id's plan, which stays, has the same line).
MUL_MAT = """static void ggml_compute_forward_mul_mat_one_chunk(
    const size_t src1_col_stride = src1_cont || src1->type != vec_dot_type ? row_size : nb11;

    // attempt to reduce false-sharing (does not seem to make a difference)
    float tmp[32];
}
void ggml_compute_forward_mul_mat(
    if (ggml_compute_forward_mul_mat_tiled(params, dst)) {
        return;
    }
    // CEIL(nr0/chunk_size)
    int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;
    int64_t nchunk1 = (nr1 + chunk_size - 1) / chunk_size;
}
static void ggml_compute_forward_mul_mat_id(
        int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;
"""

# The four function heads of ggml-cpu/arch/x86/repack.cpp the Q4_0 and Q4_K kernels and their
# dispatches are written at.
_Q4K_ARGS = "(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int nr, int nc) {"
REPACK = f"""void ggml_gemv_q4_0_8x8_q8_0{_Q4K_ARGS}
    const int qk = QK8_0;
}}
void ggml_gemm_q4_0_8x8_q8_0{_Q4K_ARGS}
    const int qk = QK8_0;
}}
void ggml_gemv_q4_K_8x8_q8_K{_Q4K_ARGS}
    const int qk = QK_K;
}}
void ggml_gemm_q4_K_8x8_q8_K{_Q4K_ARGS}
    const int qk = QK_K;
}}
"""

# The two lines of ggml-cpu/repack.cpp the row loop's declaration and its call are written at.
GENERIC_REPACK = """#include <cstring>
        // If there are more than three rows in src1, use gemm; otherwise, use gemv.
        if (nrows > 3) {
        }
        for (int iter = nrows - (nrows % 4); iter < nrows; iter++) {
        }
"""

WHEEL_FIX_NAMES = ["amx-tile-config", "amx-q6k-outside", cb.USE_REF_FIX, cb.FA_GROUPED_FIX, cb.Q6K_COLUMNS_FIX, cb.Q4K_VNNI_FIX,
                   cb.Q4_0_VNNI_FIX, cb.WEIGHT_CHUNKS_FIX]


def test_the_wheel_alone_gets_the_reference_switch_grouped_attention_the_q6k_q4k_and_q4_0_kernels_and_the_chunk_plan_and_its_key_names_them(tmp_path: Path) -> None:
    tree = _llama_tree(tmp_path)
    cpu, ops = tree / "ggml/src/ggml-cpu/ggml-cpu.cpp", tree / "ggml/src/ggml-cpu/ops.cpp"
    mul_mat, repack = tree / "ggml/src/ggml-cpu/ggml-cpu.c", tree / "ggml/src/ggml-cpu/arch/x86/repack.cpp"
    generic = tree / "ggml/src/ggml-cpu/repack.cpp"
    cpu.write_text(CPU_BACKEND)
    ops.write_text(OPS)
    mul_mat.write_text(MUL_MAT)
    repack.parent.mkdir(parents=True)
    repack.write_text(REPACK)
    generic.write_text(GENERIC_REPACK)
    assert cb.fix_source(tree) == ["amx-tile-config", "amx-q6k-outside"]  # the peer's: its ggml has no use_ref
    assert cpu.read_text() == CPU_BACKEND and ops.read_text() == OPS and mul_mat.read_text() == MUL_MAT  # as published
    assert repack.read_text() == REPACK and generic.read_text() == GENERIC_REPACK
    assert cb.fix_source(tree, cb.WHEEL_FIXES) == WHEEL_FIX_NAMES
    fixed = cpu.read_text()
    assert "cpu_ctx->use_ref || homespec_use_ref.load()" in fixed and f"void {cb.REFERENCE_SWITCH_SYMBOL}(bool" in fixed
    assert fixed.index("homespec_use_ref{false}") < fixed.index("homespec_use_ref.load()")  # declared before use
    attention = ops.read_text()
    # the kernel is defined before the function that calls it, and the call comes before the split path
    kernel = attention.index("static void ggml_compute_forward_flash_attn_ext_grouped(")
    caller = attention.index("static void ggml_compute_forward_flash_attn_ext_f16(")
    call = attention.index("ggml_compute_forward_flash_attn_ext_grouped(params, dst,")
    assert kernel < caller < call < attention.index("    if (use_split_kv_path) {")
    # the Q6_K kernel and the test that picks it are defined before the chunk loop that calls the
    # kernel (ahead of ggml's own loop) and before the tiled matmul, which they keep off its passes
    products = mul_mat.read_text()
    kernel = products.index("static void homespec_vec_dot_q6_K_q8_K_cols(")
    take = products.index("static bool homespec_q6k_columns_take(")
    chunk = products.index("static void ggml_compute_forward_mul_mat_one_chunk(")
    call = products.index("homespec_vec_dot_q6_K_q8_K_cols((int) ne00,")
    assert max(kernel, take) < chunk < call < products.index("    // attempt to reduce false-sharing")
    assert "    if (!homespec_q6k_columns_take(dst) && ggml_compute_forward_mul_mat_tiled(params, dst)) {" in products
    # the chunk plan's helper is defined before mul_mat, which counts its chunks of weight rows with
    # it; mul_mat_id keeps ggml's
    helper = products.index("static int64_t homespec_weight_chunk_rows(")
    plan = products.index("homespec_weight_chunk_rows(src0, nr0, chunk_size, nth);")
    assert helper < products.index("void ggml_compute_forward_mul_mat(\n") < plan < products.index("ggml_compute_forward_mul_mat_id(")
    assert "    int64_t nchunk0 = (nr0 + chunk_rows0 - 1) / chunk_rows0;\n    int64_t nchunk1 = (nr1 + chunk_size - 1) / chunk_size;" in products
    assert products.count("int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;") == 1
    assert f"void {cb.WEIGHT_CHUNKS_SWITCH_SYMBOL}(bool on) {{" in products
    # the Q4_K kernels are defined before ggml's gemv, whose first statement hands one row to the
    # gemv kernel, and ggml's gemm hands its rows to the gemm kernel first
    q4k = repack.read_text()
    gemv, gemm = q4k.index("void ggml_gemv_q4_K_8x8_q8_K("), q4k.index("void ggml_gemm_q4_K_8x8_q8_K(")
    kernels = [q4k.index("static void homespec_gemv_q4_K_8x8_q8_K_vnni("), q4k.index("static void homespec_gemm_q4_K_8x8_q8_K_vnni(")]
    gemv_call = q4k.index("homespec_gemv_q4_K_8x8_q8_K_vnni<1>(n, s, bs, vx, vy, nc);")
    gemm_call = q4k.index("homespec_gemm_q4_K_8x8_q8_K_vnni<1>(n, s, bs, vx, vy, nr, nc);")
    assert "homespec_gemm_q4_K_8x8_q8_K_vnni<4>(n, s, bs, vx, vy, nr, nc);" in q4k
    assert max(kernels) < gemv < gemv_call < q4k.index("    const int qk = QK_K;") < gemm < gemm_call < q4k.rindex("    const int qk = QK_K;")
    # ... and so do the AVX2 ones, for builds without VNNI (2-3 rows to the gemv kernel)
    avx2 = [q4k.index("static void homespec_gemv_q4_K_8x8_q8_K_avx2("), q4k.index("static void homespec_gemm_q4_K_8x8_q8_K_avx2(")]
    avx2_gemv_call = q4k.index("homespec_gemv_q4_K_8x8_q8_K_avx2(n, s, bs, vx, vy, nr, nc);")
    avx2_gemm_call = q4k.index("homespec_gemm_q4_K_8x8_q8_K_avx2(n, s, bs, vx, vy, nr, nc);")
    assert max(avx2) < gemv < avx2_gemv_call < q4k.index("    const int qk = QK_K;") < gemm < avx2_gemm_call < q4k.rindex("    const int qk = QK_K;")
    assert f"bool {cb.Q4K_VNNI_SWITCH_SYMBOL}(bool on) {{" in q4k
    # the row loop after ggml's gemm hands the 2-3 rows it leaves to one gemv call first, asking the
    # x86 file (declared weak, after the includes) whether it takes them
    rows = generic.read_text()
    declared = rows.index('extern "C" __attribute__((weak)) bool homespec_q4k_gemv_takes_rows(void);')
    asked = rows.index("homespec_q4k_gemv_takes_rows()")
    assert rows.index("#include <cstring>") < declared < asked < rows.index("        for (int iter = nrows - (nrows % 4); iter < nrows; iter++) {")
    assert "bool homespec_q4k_gemv_takes_rows(void) {" in q4k and "homespec_gemv_q4_K_8x8_q8_K_vnni<3>(n, s, bs, vx, vy, nc);" in q4k
    # ... and before ggml's gemm call, past four rows, hands the Q4_K gemm all of a chunk's rows, the
    # 1-3 after the fours included, on the same question
    rest = rows.index("if (nrows > 4 && nrows % 4 != 0 && homespec_q4k_gemv_takes_rows && homespec_q4k_gemv_takes_rows()) {")
    assert declared < rest < rows.index("        if (nrows > 3) {")
    assert "src0_ptr + src0_start * nb01, src1_ptr, (int) nrows, ncols);" in rows[rest:rows.index("        if (nrows > 3) {")]
    # the same for Q4_0 (the draft's): kernels before ggml's gemv, one dispatch first in each of its
    # gemv and gemm, and the row loop asks the x86 file about them too (both questions before it)
    q4_0_gemv, q4_0_gemm = q4k.index("void ggml_gemv_q4_0_8x8_q8_0("), q4k.index("void ggml_gemm_q4_0_8x8_q8_0(")
    kernels = [q4k.index("static void homespec_gemv_q4_0_8x8_q8_0_vnni("), q4k.index("static void homespec_gemm_q4_0_8x8_q8_0_vnni(")]
    gemv_call = q4k.index("homespec_gemv_q4_0_8x8_q8_0_vnni<1>(n, s, bs, vx, vy, nc);")
    gemm_call = q4k.index("homespec_gemm_q4_0_8x8_q8_0_vnni(n, s, bs, vx, vy, nr, nc);")
    assert max(kernels) < q4_0_gemv < gemv_call < q4k.index("    const int qk = QK8_0;") < q4_0_gemm < gemm_call < q4k.rindex("    const int qk = QK8_0;")
    assert f"bool {cb.Q4_0_VNNI_SWITCH_SYMBOL}(bool on) {{" in q4k and "bool homespec_q4_0_gemv_takes_rows(int n) {" in q4k
    declared = rows.index('extern "C" __attribute__((weak)) bool homespec_q4_0_gemv_takes_rows(int n);')
    asked = rows.index("homespec_q4_0_gemv_takes_rows((int) ne00)")
    assert rows.index("#include <cstring>") < declared < asked < rows.index("        for (int iter = nrows - (nrows % 4); iter < nrows; iter++) {")
    assert rows.count("std::is_same_v<BLOC_TYPE, block_q4_0>") == 1 and rows.count("std::is_same_v<BLOC_TYPE, block_q4_K>") == 2
    assert cb.fix_source(tree, cb.WHEEL_FIXES) and cpu.read_text() == fixed and ops.read_text() == attention  # once only
    assert mul_mat.read_text() == products and repack.read_text() == q4k and generic.read_text() == rows
    assert cb.fix_names() == WHEEL_FIX_NAMES  # the wheel's key and stamp


def test_the_cache_key_changes_when_a_fix_changes_under_the_same_name() -> None:
    key = cb.fixes_key()
    assert key.split()[:-1] == cb.fix_names()
    edited = tuple((n, f, t, r + "// edited\n" if n == cb.FA_GROUPED_FIX else r) for n, f, t, r in cb.WHEEL_FIXES)
    assert cb.fix_names(edited) == cb.fix_names() and cb.fixes_key(edited) != key


def test_a_source_without_the_lines_to_fix_is_refused_not_built_unfixed(tmp_path: Path) -> None:
    import pytest

    tree = _llama_tree(tmp_path / "a", mmq=MMQ_INIT.replace("_tile_loadconfig(&tc);", "load_config(&tc);"))
    with pytest.raises(RuntimeError, match="amx-tile-config"):
        cb.fix_source(tree)
    tree = _llama_tree(tmp_path / "b", amx=AMX_TYPES.replace("Q6_K", "Q3_K"))
    with pytest.raises(RuntimeError, match="amx-q6k-outside"):
        cb.fix_source(tree)
    tree = _llama_tree(tmp_path / "c")
    (tree / "ggml/src/ggml-cpu/ggml-cpu.cpp").write_text(CPU_BACKEND.replace("cpu_ctx->use_ref;", "false;"))
    with pytest.raises(RuntimeError, match=cb.USE_REF_FIX):
        cb.fix_source(tree, cb.WHEEL_FIXES)


# The kernel's first steps, ggml_tile_config_init then a tilezero, with the load as llama.cpp has it
# or as the fix writes it; `tiles` 4 and 5 are the C tiles the kernel zeroes first.
_TILE_PROGRAM = r"""
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config_t { uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
                       uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
__attribute__((noinline)) void config(void) {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.rows[4] = 16; tc.colsb[4] = 64;
    tc.rows[5] = 16; tc.colsb[5] = 64;
LOAD}
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    config();
    _tile_zero(4);
    return 0;
}
"""


def _run_tile_program(tmp_path: Path, load: str, name: str) -> int:
    src, exe = tmp_path / f"{name}.cpp", tmp_path / name
    src.write_text(_TILE_PROGRAM.replace("LOAD", load))
    subprocess.run(["g++", "-O2", "-mamx-tile", "-mamx-int8", "-o", str(exe), str(src)], check=True, capture_output=True)
    return subprocess.run([str(exe)], capture_output=True).returncode


def test_the_fixed_tile_config_load_keeps_the_tiles_configured_where_gcc_drops_them(tmp_path: Path) -> None:
    """Compiled as ggml compiles it (-O2), on a CPU whose tiles work: the fixed load runs; with
    GCC 12's _tile_loadconfig the program dies (SIGILL at tilezero, as llama.cpp did; some runs
    SIGSEGV)."""
    import shutil
    import signal

    import pytest

    if shutil.which("g++") is None or "amx_tile" not in cb.cpu_flags() or not cb.amx_works():
        pytest.skip("needs g++ and a CPU whose AMX tiles work")
    _, _, original, fixed = cb.SOURCE_FIXES[0]
    assert _run_tile_program(tmp_path, fixed, "fixed") == 0
    gcc = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    if gcc.split(".")[0] == "12":
        assert _run_tile_program(tmp_path, original, "original") in (-signal.SIGILL, -signal.SIGSEGV)  # both seen
