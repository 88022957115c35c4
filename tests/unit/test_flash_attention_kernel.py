"""Flash attention in the installed llama.cpp build, op by op: tests/unit/flash_attn_check.c,
compiled against the wheel's headers and libraries, runs ggml_flash_attn_ext over random
inputs and reports each case's worst error against a float64 reference. No weights.

The property of cpu_build's FA_GROUPED_FIX: a pass of up to 65 query rows (a verify pass of a
64-token draft; ggml's own kernel takes its tile of 64 and more), with a unit of work for every thread, keeps its softmax and V sum in f32 (errors ~1e-4 here)
where ggml 0.25.3's row-at-a-time kernel sums V in f16 (1-3e-3); every path stays correct."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.unit import ggml_programs

SOURCE = Path(__file__).with_name("flash_attn_check.c")
N_HEAD_KV = 2  # as flash_attn_check.c's N_HEAD_KV
GROUPED_ROWS = 65  # the most rows the fix's kernel takes: from 66 on ggml's own tiled kernel runs
ANY_PATH_MAX_ERR = 1e-2  # f16 inputs, outputs in [-1, 1]: ggml's own kernels reach 4.5e-3, a wrong one far more
GROUPED_MAX_ERR = 1e-3


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, int, int, int, float]]:
    exe = ggml_programs.build(SOURCE, tmp_path_factory.mktemp("flash_attn"))
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=600).stdout
    rows = [line.split() for line in out.splitlines()]
    return [(int(r), int(kv), int(th), int(st), float(err)) for r, kv, th, st, err in rows]


def test_flash_attention_matches_a_float64_reference_on_every_path(cases: list[tuple[int, int, int, int, float]]) -> None:
    assert len(cases) > 100
    bad = [c for c in cases if not c[4] <= ANY_PATH_MAX_ERR]  # NaN is bad too
    assert not bad, f"(rows, history, threads, streams, error) beyond {ANY_PATH_MAX_ERR}: {bad}"


def test_passes_of_few_rows_sum_in_f32_with_each_kv_heads_query_heads_together(cases: list[tuple[int, int, int, int, float]]) -> None:
    grouped = [c for c in cases if c[0] <= GROUPED_ROWS and c[3] * N_HEAD_KV >= c[2]]  # a unit for every thread
    assert grouped
    bad = [c for c in grouped if not c[4] <= GROUPED_MAX_ERR]
    assert not bad, f"(rows, history, threads, streams, error) beyond {GROUPED_MAX_ERR}: {bad}"
