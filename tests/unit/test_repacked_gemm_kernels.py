"""Repacked products in the installed llama.cpp build: tests/unit/repacked_gemm_check.c, compiled
against the wheel's headers and libraries, calls ggml's exported gemm (activation rows in fours)
and gemv (1-3 rows, several in one call where the fix takes them) of two layouts, each with its
fix switched on and off, and ggml's scalar versions of both; past four rows, the rows after the
fours in the gemm's own call where the fix takes them there (q4_K). No weights.
- q4_K_8x8, which every Q4_K weight of the target takes where weights are repacked: cpu_build's
  Q4K_VNNI_FIX;
- q4_0_8x8, the requantized Q4_0 draft's: Q4_0_VNNI_FIX.

Each fix's properties, where the build has its kernels (q4_K: AVX-512 VNNI, or else AVX2 with FMA
and F16C; q4_0: AVX-512 VNNI):
- every row's result is bitwise the same row's computed alone, in a one-row gemv call: a pass of
  any number of rows gives a row what a one-token pass gives it (batch invariance: greedy
  speculation then says what plain decoding says);
- within the accuracy of ggml's scalar code;
- where ggml's own code is batch-invariant too, bitwise what it gives (the Q4_0 gemm and gemv, the
  Q4_K gemv): nothing a model says changes. ggml's Q4_K gemm is not: it rounds every 64 values,
  its gemv every 256, and the fix's gemm rounds as the gemv does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from homespec.llama import cpu_build
from tests.unit import ggml_programs

SOURCE = Path(__file__).with_name("repacked_gemm_check.c")
MAX_REL_ERR = 1e-5  # of the case's largest |result|: exact integer sums, float steps per 32-64 values (5e-7 here)
SWITCHES = {"q4_K": cpu_build.Q4K_VNNI_SWITCH_SYMBOL, "q4_0": cpu_build.Q4_0_VNNI_SWITCH_SYMBOL}
# what each fix's kernels are compiled under (any one set of them)
KERNEL_OPTIONS = {"q4_K": (("GGML_AVX512", "GGML_AVX512_VNNI"), ("GGML_AVX2", "GGML_FMA", "GGML_F16C")),
                  "q4_0": (("GGML_AVX512", "GGML_AVX512_VNNI"),)}

# rows (1-3: the gemv), inputs, outputs, results that differ between the switch on and off, results
# that differ from the row alone, error with the switch on and off
Case = tuple[int, int, int, int, int, float, float]


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggml_programs.build(SOURCE, tmp_path_factory.mktemp("repacked_gemm"))


@pytest.fixture(scope="module", params=sorted(SWITCHES))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def run(exe: Path, layout: str) -> tuple[str, list[Case]]:
    lines = subprocess.run([str(exe), layout], check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()
    assert lines[0].startswith("switch ")
    cases = [(int(m), int(n_in), int(n_out), int(differ), int(alone), float(on), float(off))
             for m, n_in, n_out, differ, alone, on, off in (line.split() for line in lines[1:])]
    return lines[0], cases


def _kernels_build(layout: str) -> bool | None:
    options = cpu_build.installed_options()
    return None if options is None else any(all(options.get(o) for o in needs) for needs in KERNEL_OPTIONS[layout])


def test_the_wheel_has_each_fixs_kernels_exactly_where_it_was_built_for_them(run: tuple[str, list[Case]], layout: str) -> None:
    switch, _ = run
    kernels = _kernels_build(layout)
    if kernels is None:
        pytest.skip("llama_cpp was not installed by `make install` (no stamp)")
    assert switch == f"switch 1 {int(kernels)}", f"{SWITCHES[layout]}: {switch!r} in a build with the options for them {kernels}"


def test_the_check_names_an_unknown_layout_and_stops(exe: Path) -> None:
    r = subprocess.run([str(exe), "q8_0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr


def test_repacked_products_match_ggmls_scalar_code_at_every_row_count(run: tuple[str, list[Case]]) -> None:
    _, cases = run
    assert {c[0] for c in cases} == {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 19, 20, 32, 36} and len(cases) == 28
    bad = [c for c in cases if not (c[5] <= MAX_REL_ERR and c[6] <= MAX_REL_ERR)]  # NaN is bad too
    assert not bad, f"(rows, inputs, outputs, differing, differing alone, error on, error off) beyond {MAX_REL_ERR}: {bad}"


def test_the_fixs_kernels_give_every_row_bitwise_what_it_gets_alone(run: tuple[str, list[Case]]) -> None:
    switch, cases = run
    if switch != "switch 1 1":
        pytest.skip("a build without the fix's kernels runs ggml's code, switch or not")
    bad = [c for c in cases if c[4]]
    assert not bad, f"(rows, inputs, outputs, differing, differing alone, error on, error off) where a row differs from alone: {bad}"


def test_the_fixs_kernels_give_bitwise_ggmls_results_where_ggml_is_batch_invariant(run: tuple[str, list[Case]], layout: str) -> None:
    switch, cases = run
    if switch != "switch 1 1":
        pytest.skip("a build without the fix's kernels runs ggml's code, switch or not")
    bad = [c for c in cases if c[3] and (layout == "q4_0" or c[0] < 4)]  # ggml's Q4_K gemm rounds otherwise
    assert not bad, f"(rows, inputs, outputs, differing, differing alone, error on, error off) where the switch changes results: {bad}"
