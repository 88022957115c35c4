"""Choosing llama.cpp's kernels from the CPU's flags, and refusing a build on a CPU that lacks
what it was built for (homespec/llama/cpu_build.py). Flags are scripted: no compiler, no CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from homespec.llama import cpu_build as cb

# /proc/cpuinfo flags of the two machines this project has seen (abridged to what matters).
EPYC_AVX2 = set("sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2".split())
XEON_AMX = EPYC_AVX2 | set("avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni "
                          "amx_tile amx_int8 amx_bf16".split())


def test_an_avx2_cpu_gets_the_avx2_kernels_and_nothing_wider() -> None:
    on = {k for k, v in cb.choose(EPYC_AVX2).items() if v}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX2"}


def test_an_avx512_cpu_gets_the_avx512_kernels_and_amx_only_when_the_check_passed() -> None:
    without = cb.choose(XEON_AMX, amx=False)
    assert all(without[k] for k in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI"))
    assert not any(without[k] for k in cb.AMX_OPTIONS)
    assert all(cb.choose(XEON_AMX, amx=True)[k] for k in cb.AMX_OPTIONS)


def test_amx_is_left_out_unless_asked_for_because_its_kernels_crash_this_llama_cpp() -> None:
    assert not cb.amx_wanted({}) and not cb.amx_wanted({"HOMESPEC_AMX": "auto"})
    assert cb.amx_wanted({"HOMESPEC_AMX": "on"}) and cb.amx_wanted({"HOMESPEC_AMX": "ON"})


def test_this_cpu_gets_no_amx_kernels_by_default_even_where_the_tile_check_passes(monkeypatch) -> None:
    monkeypatch.setattr(cb.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: XEON_AMX)
    monkeypatch.setattr(cb, "amx_works", lambda cc=None: True)
    monkeypatch.delenv("HOMESPEC_AMX", raising=False)
    assert not any(cb.this_cpu_options()[k] for k in cb.AMX_OPTIONS)
    assert cb.this_cpu_options()["GGML_AVX512_VNNI"]
    monkeypatch.setenv("HOMESPEC_AMX", "on")
    assert all(cb.this_cpu_options()[k] for k in cb.AMX_OPTIONS)


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


def test_the_runtime_refuses_a_build_with_amx_kernels_unless_amx_was_asked_for(monkeypatch, tmp_path: Path) -> None:
    import pytest

    from homespec.errors import ModelError

    cb.write_stamp(tmp_path, cb.choose(XEON_AMX, amx=True))  # an install from before AMX became opt-in
    monkeypatch.setattr(cb, "installed_package_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "cpu_flags", lambda cpuinfo=None: XEON_AMX)
    monkeypatch.delenv("HOMESPEC_AMX", raising=False)
    with pytest.raises(ModelError, match="AMX kernels.*make install"):
        cb.require_matching_build()
    monkeypatch.setenv("HOMESPEC_AMX", "on")
    cb.require_matching_build()
