"""Which llama.cpp kernels a process uses (llama/kernels.py) and what exact mode changes."""

from __future__ import annotations

import pytest

from homespec.config import Config
from homespec.llama import kernels
from homespec.llama.kernels import EXACT_MAX_ROWS, TILED_ENV, TILED_MIN_ROWS
from homespec.models.loader import runtime_options


@pytest.fixture
def fresh_process(monkeypatch):
    """As if llama.cpp had not run a matrix product yet."""
    monkeypatch.setattr(kernels, "_fixed", None)
    monkeypatch.delenv(TILED_ENV, raising=False)


def test_the_first_setting_is_the_one_in_effect_for_the_whole_process(fresh_process):
    import os

    assert kernels.fix_tiled_matmul(False) is False
    assert os.environ[TILED_ENV] == "0"  # what ggml's getenv reads
    assert kernels.fix_tiled_matmul(True) is False  # ggml read it once: a later wish cannot change it
    assert kernels.fix_tiled_matmul(None) is False


def test_leaving_the_choice_to_llama_cpp_keeps_its_default_on(fresh_process):
    import os

    assert kernels.fix_tiled_matmul(None) is True
    assert TILED_ENV not in os.environ


@pytest.mark.parametrize("value, on", [("0", False), ("1", True), ("  2", True), ("-1", True), ("off", False), ("07x", True), ("", False)])
def test_a_setting_the_user_exported_wins_read_as_c_atoi_reads_it(fresh_process, monkeypatch, value, on):
    monkeypatch.setenv(TILED_ENV, value)
    assert kernels.fix_tiled_matmul(not on) is on


def test_exact_mode_keeps_every_pass_below_the_tiled_threshold_all_requests_together():
    cfg = Config()
    assert (cfg.k_limit, cfg.max_pass_rows) == (cfg.speculation.k_max, None)
    cfg.runtime.exact = True
    assert cfg.k_limit + 1 == EXACT_MAX_ROWS < TILED_MIN_ROWS  # the verify pass: last token + k
    assert cfg.max_pass_rows == EXACT_MAX_ROWS  # several requests' steps in one pass
    cfg.speculation.k_max = 3
    assert cfg.k_limit == 3


def test_exact_mode_loads_the_target_unpacked_with_flash_attention_a_q8_kv_cache_and_a_stream_per_sequence():
    cfg = Config()
    default = runtime_options(cfg, 0)
    assert (default.repack, default.kv_type, default.flash_attn, default.kv_unified) == (True, "f16", False, False)
    cfg.runtime.exact = True
    exact = runtime_options(cfg, 0)
    assert (exact.repack, exact.kv_type, exact.flash_attn, exact.kv_unified) == (False, "q8_0", True, False)
    # A proposal is verified exactly whatever computed it: the draft model keeps the fast kernels.
    draft = runtime_options(cfg, 0, draft=True)
    assert (draft.repack, draft.kv_type, draft.flash_attn, draft.kv_unified) == (True, "f16", False, False)
    cfg.runtime.exact = False
    cfg.runtime.kv_unified = True  # one shared buffer, when asked for
    assert runtime_options(cfg, 0).kv_unified and runtime_options(cfg, 0, draft=True).kv_unified
