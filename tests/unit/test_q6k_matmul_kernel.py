"""Q6_K matrix products in the installed llama.cpp build, op by op: tests/unit/q6k_matmul_check.c,
compiled against the wheel's headers and libraries, runs ggml_mul_mat of a Q6_K weight over
passes of 1-67 rows and reports, per case, how many results differ from each row computed alone
and the worst error against a float64 reference. No weights.

The property of cpu_build's Q6K_COLUMNS_FIX: a pass of 2-65 rows (verify steps, requests decoding
together) takes a kernel that unpacks each weight block once for all rows and gives every row
bitwise the result of a pass of that row alone, where ggml 0.25.3 took its tiled matmul from 8 rows
on (results that differ in the last bits). With the tiled matmul off (GGML_CPU_TILED_MM=0), every
pass is bitwise the row alone, fix or not. Exact mode's switch (kernels.pass_kernels, for its
prompt passes) gives passes of 8+ rows back to the tiled matmul. At 2 and 3 threads the 200-row
weight is shared out in cpu_build's WEIGHT_CHUNKS_FIX chunks (26 and 18 rows), so the same cases
check that plan leaves no row out and changes no result."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from homespec.llama import cpu_build
from tests.unit import ggml_programs

SOURCE = Path(__file__).with_name("q6k_matmul_check.c")
FIX_ROWS = 65  # the most rows a pass may have for the fix's kernel (HOMESPEC_Q6K_COLS_MAX_ROWS)
MAX_REL_ERR = 1e-5  # of the sum of |products|: integer sums, then a float per 256 values (2e-8 here)

# rows, threads, inputs, outputs, results that differ from the row alone, error, results that differ
# from the same row in the pass of all 67 rows (ggml's tiled matmul)
Case = tuple[int, int, int, int, int, float, int]


def _run(exe: Path, *args: str, **env: str) -> list[Case]:
    env = {**os.environ, **env}
    env.pop("GGML_CPU_TILED_MM_FORCE", None)
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True, timeout=600, env=env).stdout
    rows = [line.split() for line in out.splitlines()]
    return [(int(m), int(th), int(n_in), int(n_out), int(differ), float(err), int(widest))
            for m, th, n_in, n_out, differ, err, widest in rows]


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggml_programs.build(SOURCE, tmp_path_factory.mktemp("q6k_matmul"))


@pytest.fixture(scope="module")
def cases(exe: Path) -> list[Case]:
    return _run(exe, GGML_CPU_TILED_MM="1")  # ggml's default, whatever this process was given


def test_q6k_products_match_a_float64_reference_at_every_pass_size(cases: list[Case]) -> None:
    assert len(cases) >= 200
    bad = [c for c in cases if not c[5] <= MAX_REL_ERR]  # NaN is bad too
    assert not bad, f"(rows, threads, inputs, outputs, differing, error, differing from 67 rows) beyond {MAX_REL_ERR}: {bad}"


def test_q6k_passes_of_up_to_65_rows_give_each_row_bitwise_its_result_alone(cases: list[Case]) -> None:
    options = cpu_build.installed_options()
    if options is not None and not options.get("GGML_AVX2"):
        pytest.skip("the fix's kernel is AVX2's; a build without AVX2 keeps ggml's paths")
    few = [c for c in cases if c[0] <= FIX_ROWS]
    assert any(c[0] == FIX_ROWS for c in few)
    bad = [c for c in few if c[4]]
    assert not bad, f"(rows, threads, inputs, outputs, differing, error, differing from 67 rows) where a row's result is not its result alone: {bad}"


def test_without_the_tiled_matmul_every_q6k_pass_gives_each_row_its_result_alone(exe: Path) -> None:
    cases = _run(exe, GGML_CPU_TILED_MM="0")
    assert any(c[0] > FIX_ROWS for c in cases)
    bad = [c for c in cases if c[4] or not c[5] <= MAX_REL_ERR]
    assert not bad, f"(rows, threads, inputs, outputs, differing, error, differing from 67 rows): {bad}"


def test_with_exact_modes_switch_q6k_rows_of_passes_of_8_or_more_come_out_as_in_any_such_pass(exe: Path) -> None:
    """Exact mode's prompt passes (kernels.pass_kernels) set the fix's switch: passes of 8+ rows then
    take ggml's tiled matmul, which gives a row the same result in any of them (a prefix read in a
    pass of 20 rows equals one read in a pass of 60), and 2-7 rows still the kernel's."""
    cases = _run(exe, "tiled-from-8", GGML_CPU_TILED_MM="1")
    assert any(c[0] == 8 for c in cases)
    bad = [c for c in cases if (c[0] >= 8 and c[6]) or (c[0] < 8 and c[4]) or not c[5] <= MAX_REL_ERR]
    assert not bad, f"(rows, threads, inputs, outputs, differing, error, differing from 67 rows): {bad}"
