"""Which llama.cpp kernels a process uses (llama/kernels.py) and what exact mode changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from homespec.config import Config
from homespec.llama import kernels
from homespec.llama.kernels import EXACT_MAX_ROWS, TILED_ENV, TILED_MIN_ROWS, batch_invariant_buffers, exact_keeps_amx
from homespec.llama.runtime import COMPACT_AFTER, STREAM_PAD_RATIO, Runtime, stream_gaps, stream_graphs, stream_layout
from homespec.models import loader
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


def test_exact_mode_without_reference_kernels_keeps_every_pass_below_the_tiled_threshold_all_requests_together():
    cfg = Config()
    assert (cfg.k_limit(False), cfg.max_pass_rows(False)) == (cfg.speculation.k_max, None)
    cfg.runtime.exact = True
    assert cfg.k_limit(False) + 1 == EXACT_MAX_ROWS < TILED_MIN_ROWS  # the verify pass: last token + k
    assert cfg.max_pass_rows(False) == EXACT_MAX_ROWS  # several requests' steps in one pass
    cfg.speculation.k_max = 3
    assert cfg.k_limit(False) == 3


def test_exact_mode_with_reference_kernels_for_decode_passes_drafts_as_far_as_the_default_mode():
    cfg = Config()
    cfg.runtime.exact = True
    # Narrow passes still (prompts in passes of their own), as long as one request's longest step.
    assert (cfg.k_limit(True), cfg.max_pass_rows(True)) == (cfg.speculation.k_max, cfg.speculation.k_max + 1)
    assert cfg.k_limit(True) + 1 > TILED_MIN_ROWS  # passes the tiled matmul would take, on reference kernels


def test_exact_mode_loads_the_target_unpacked_with_flash_attention_a_q8_kv_cache_and_a_stream_per_sequence(monkeypatch):
    monkeypatch.setattr(loader, "has_grouped_attention", lambda: False)  # a build without the grouped kernel
    cfg = Config()
    default = runtime_options(cfg, 0)
    assert (default.repack, default.kv_type, default.flash_attn, default.kv_unified) == (True, "f16", False, False)
    monkeypatch.setattr(loader, "has_grouped_attention", lambda: True)
    assert runtime_options(cfg, 0).flash_attn and runtime_options(cfg, 0, draft=True).flash_attn
    monkeypatch.setattr(loader, "has_grouped_attention", lambda: False)
    cfg.runtime.exact = True
    exact = runtime_options(cfg, 0)
    assert (exact.repack, exact.kv_type, exact.flash_attn, exact.kv_unified) == (False, "q8_0", True, False)
    # A proposal is verified exactly whatever computed it: the draft model keeps the fast kernels.
    draft = runtime_options(cfg, 0, draft=True)
    assert (draft.repack, draft.kv_type, draft.flash_attn, draft.kv_unified) == (True, "f16", False, False)
    cfg.runtime.exact = False
    cfg.runtime.kv_unified = True  # one shared buffer, when asked for
    assert runtime_options(cfg, 0).kv_unified and runtime_options(cfg, 0, draft=True).kv_unified


def test_exact_mode_keeps_amx_only_where_it_is_in_use_and_for_the_matrix_types_measured_there():
    assert exact_keeps_amx({"Q4_K", "Q6_K"}, amx=True)  # a Q4_K_M file: the case measured
    assert exact_keeps_amx({"Q4_K"}, amx=True)
    assert not exact_keeps_amx({"Q4_K", "Q6_K"}, amx=False)  # no AMX: Q4_K would go to the repacked gemm/gemv
    assert not exact_keeps_amx({"Q4_K", "Q6_K", "Q8_0"}, amx=True)  # the draft's file: Q8_0 not measured
    assert not exact_keeps_amx({"Q4_1", "Q8_0"}, amx=True)
    assert not exact_keeps_amx((), amx=True)


def test_weights_in_llama_cpps_repacked_layouts_are_not_batch_invariant():
    assert batch_invariant_buffers({"AMX": 613.1, "CPU_Mapped": 1059.9})
    assert batch_invariant_buffers({"CPU_Mapped": 1059.9})
    assert not batch_invariant_buffers({"AMX": 500.0, "CPU_REPACK": 113.1, "CPU_Mapped": 1059.9})


def test_only_the_exact_targets_decode_passes_take_the_reference_kernels():
    cfg = Config()
    assert runtime_options(cfg, 0, reference_decode=True).reference_decode is False  # the default mode: fast kernels
    cfg.runtime.exact = True
    assert runtime_options(cfg, 0, reference_decode=True).reference_decode is True
    assert runtime_options(cfg, 0).reference_decode is False
    assert runtime_options(cfg, 0, draft=True, reference_decode=True).reference_decode is False  # proposals need not be


def test_exact_mode_with_amx_keeps_the_extra_buffers_and_changes_nothing_else():
    cfg = Config()
    cfg.runtime.exact = True
    amx = runtime_options(cfg, 0, keep_amx=True)
    assert (amx.repack, amx.kv_type, amx.flash_attn, amx.kv_unified) == (True, "q8_0", True, False)
    assert runtime_options(cfg, 0, keep_amx=False).repack is False


class _Loaded:
    """Stands in for Runtime: records the options, reports the buffers it is told to."""

    def __init__(self, buffers: dict[str, float], opened: list):
        self.buffers, self.opened = buffers, opened

    def __call__(self, path, opts):
        rt = SimpleNamespace(opts=opts, closed=False,
                             weight_buffers=dict(self.buffers) if opts.repack else {"CPU_Mapped": 1060.0})
        rt.close = lambda: setattr(rt, "closed", True)
        self.opened.append(rt)
        return rt


@pytest.mark.parametrize(
    "exact, amx, types, buffers, loads",
    [
        (True, True, {"Q4_K", "Q6_K"}, {"AMX": 613.1, "CPU_Mapped": 1060.0}, [True]),  # AMX kept
        (True, True, {"Q4_K", "Q6_K"}, {"AMX": 500.0, "CPU_REPACK": 113.0}, [True, False]),  # some repacked: again unpacked
        (True, False, {"Q4_K", "Q6_K"}, {}, [False]),  # no AMX here
        (True, True, {"Q4_1", "Q8_0"}, {}, [False]),  # types not measured
        (False, True, {"Q4_K", "Q6_K"}, {"AMX": 613.1}, [True]),  # the default mode repacks anyway
    ],
)
def test_the_target_opens_with_amx_in_exact_mode_only_where_every_row_stays_batch_invariant(
        monkeypatch, tmp_path, exact, amx, types, buffers, loads):
    opened: list = []
    monkeypatch.setattr(loader, "Runtime", _Loaded(buffers, opened))
    monkeypatch.setattr(kernels, "amx_buffer_available", lambda: amx)
    monkeypatch.setattr(kernels, "reference_kernels_available", lambda: True)
    monkeypatch.setattr(loader, "read_gguf_info", lambda path: SimpleNamespace(matrix_types=frozenset(types)))
    cfg = Config()
    cfg.runtime.exact = exact
    target = loader.open_target(cfg, tmp_path / "target.gguf")
    assert [rt.opts.repack for rt in opened] == loads
    assert target is opened[-1] and not target.closed and all(rt.closed for rt in opened[:-1])
    assert all(rt.opts.reference_decode is exact for rt in opened)  # the fallback load keeps them too


@pytest.mark.parametrize("switch, asked, reference", [(True, True, True), (False, True, False), (True, False, False)])
def test_exact_decode_passes_take_reference_kernels_only_where_the_build_can_switch(monkeypatch, tmp_path, switch, asked, reference):
    opened: list = []
    monkeypatch.setattr(loader, "Runtime", _Loaded({}, opened))
    monkeypatch.setattr(kernels, "amx_buffer_available", lambda: False)
    monkeypatch.setattr(kernels, "reference_kernels_available", lambda: switch)
    monkeypatch.setattr(loader, "read_gguf_info", lambda path: SimpleNamespace(matrix_types=frozenset({"Q4_K"})))
    cfg = Config()
    cfg.runtime.exact = True
    assert loader.open_target(cfg, tmp_path / "target.gguf", reference=asked).opts.reference_decode is reference


def test_a_pass_on_reference_kernels_switches_them_off_again_even_when_it_fails(monkeypatch):
    calls: list[bool] = []
    monkeypatch.setattr(kernels, "_reference_looked", True)
    monkeypatch.setattr(kernels, "_reference_switch", calls.append)
    monkeypatch.setattr(kernels, "_q6k_tiled_switch", None)  # a build without cpu-q6k-columns
    with kernels.pass_kernels(reference=True):
        assert calls == [True]
    with pytest.raises(RuntimeError, match="decode failed"):
        with kernels.pass_kernels(reference=True):
            raise RuntimeError("decode failed")
    with kernels.pass_kernels(reference=False):
        pass
    assert calls == [True, False, True, False, False, False]


def test_exact_modes_prompt_passes_leave_q6k_products_of_8_rows_or_more_to_the_tiled_matmul(monkeypatch):
    """A prompt pass (not on the reference kernels) keeps ggml's tiled matmul from 8 rows, whose
    rows are the same in any pass of 8+: a prefix read in a 20-row pass equals one read in a 60-row
    pass. A decode pass lets the Q6_K kernel take up to 32 rows (its results are the reference's)."""
    reference: list[bool] = []
    tiled_from_8: list[bool] = []
    monkeypatch.setattr(kernels, "_reference_looked", True)
    monkeypatch.setattr(kernels, "_reference_switch", reference.append)
    monkeypatch.setattr(kernels, "_q6k_tiled_switch", tiled_from_8.append)
    with kernels.pass_kernels(reference=False):
        assert (reference, tiled_from_8) == ([False], [True])
    with pytest.raises(RuntimeError, match="prefill failed"):
        with kernels.pass_kernels(reference=False):
            raise RuntimeError("prefill failed")
    with kernels.pass_kernels(reference=True):
        assert tiled_from_8[-1] is False
    assert tiled_from_8 == [True, False, True, False, False, False]  # off again after every pass


def test_a_build_without_the_switch_cannot_run_a_pass_on_reference_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "_reference_looked", True)
    monkeypatch.setattr(kernels, "_reference_switch", None)
    assert not kernels.reference_kernels_available()
    with pytest.raises(RuntimeError, match="make install"):
        with kernels.pass_kernels(reference=True):
            pass


def test_a_pass_bridges_the_streams_missing_between_its_slots_and_no_others():
    assert stream_gaps([0, 2, 3]) == [1]
    assert stream_gaps([3, 1]) == [2]
    assert stream_gaps([1, 2, 3]) == []  # a run of neighbours is one graph already
    assert stream_gaps([2]) == stream_gaps([]) == []


def _streams(n: int) -> tuple[Runtime, list[tuple[int, int]]]:
    """A Runtime's compaction bookkeeping over n slots without a model: each move is recorded,
    and only the sequence ids change hands (what _swap_streams does besides copying cells)."""
    rt = Runtime.__new__(Runtime)
    rt._slots = [SimpleNamespace(seq=i, tokens=[]) for i in range(n)]
    rt._by_seq, rt._gap_passes, rt._gaps = list(rt._slots), 0, []
    moves: list[tuple[int, int]] = []

    def swap(a: int, b: int) -> None:
        moves.append((a, b))
        x, y = rt._by_seq[a], rt._by_seq[b]
        x.seq, y.seq = b, a
        rt._by_seq[a], rt._by_seq[b] = y, x

    rt._swap_streams = swap  # type: ignore[method-assign]
    return rt, moves


def test_an_idle_slot_between_running_ones_is_compacted_away_once_the_gap_has_lasted_compact_after_passes():
    rt, moves = _streams(4)
    for _ in range(COMPACT_AFTER - 1):
        rt._compact([0, 2, 3])
    assert moves == []  # a request that sits out a pass or two is not worth the copy
    rt._compact([0, 2, 3])
    assert moves == [(1, 3)]  # the highest moves into the gap
    assert [s.seq for s in rt._slots] == [0, 3, 2, 1] and rt._by_seq[1] is rt._slots[3]
    for _ in range(COMPACT_AFTER):
        rt._compact([0, 1, 2])  # neighbours now: nothing more to move
    assert moves == [(1, 3)]


def test_a_gap_that_changes_or_closes_starts_the_count_again_and_slot_0_never_moves():
    rt, moves = _streams(4)
    for seqs in ([0, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 3], [0, 1, 2, 3], [0, 1, 3], [0, 1, 3], [0, 1, 3]):
        rt._compact(seqs)
    assert moves == []  # never the same gap COMPACT_AFTER passes in a row
    rt._compact([0, 1, 3])
    assert moves == [(2, 3)]
    rt, moves = _streams(4)
    for _ in range(COMPACT_AFTER):
        rt._compact([0, 3])  # two idle slots between: one move closes both gaps
    assert moves == [(1, 3)]
    rt, moves = _streams(4)
    for _ in range(COMPACT_AFTER):
        rt._compact([1, 3])  # slot 0 idle below the lowest: no gap there, and 0 keeps its stream
    assert moves == [(2, 3)]


def test_a_pass_in_streams_runs_as_one_graph_per_run_of_neighbours_taking_as_many_rows_from_each():
    """llama_batch_allocr::split_equal as the pass costs measured it (scripts/pass_cost.py
    --layouts): 9, 1, 1, 1 rows are a graph of one row each and one of the first slot's 8 more."""
    assert stream_graphs({0: 3, 1: 3, 2: 3, 3: 3}, fill_gaps=False) == [(4, 12)]
    assert stream_graphs({0: 9, 1: 1, 2: 1, 3: 1}, fill_gaps=False) == [(4, 4), (1, 8)]
    assert stream_graphs({0: 9, 1: 1, 2: 9, 3: 1}, fill_gaps=False) == [(4, 4), (1, 8), (1, 8)]  # 0 and 2 are no run
    assert stream_graphs({0: 1, 2: 1, 3: 1}, fill_gaps=False) == [(1, 1), (2, 2)]
    assert stream_graphs({1: 2, 2: 0}) == [(1, 2)] and stream_graphs({}) == []


def test_throwaway_rows_make_a_pass_in_streams_one_graph_where_that_is_cheap():
    """A slot missing between others gets a row; steps shorter than the longest get rows up to
    it while that at most STREAM_PAD_RATIO-folds the pass (3, 1, 1, 1 rows: 209 ms as two graphs,
    160-181 as 3, 3, 3, 3 on the 2-core Xeon), not beyond (9, 1, 1, 1: 257 ms, padded 375)."""
    assert stream_layout({0: 1, 2: 1, 3: 1}) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert stream_layout({0: 3, 1: 1, 2: 1, 3: 1}) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert stream_layout({0: 3, 2: 1, 3: 3}) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert stream_layout({0: 9, 1: 1, 2: 1, 3: 1}) == {0: 9, 1: 1, 2: 1, 3: 1}
    assert stream_graphs({0: 3, 2: 1, 3: 3}) == [(4, 12)]
    assert stream_graphs({0: 17, 1: 1, 2: 1, 3: 1}) == [(4, 4), (1, 16)]
    assert len(stream_layout({0: 17, 1: 1, 2: 1, 3: 1})) * 17 > STREAM_PAD_RATIO * 20


def test_exact_mode_adds_no_throwaway_rows_since_its_narrow_passes_count_their_rows():
    cfg = Config()
    assert runtime_options(cfg, 0).fill_stream_gaps
    cfg.runtime.exact = True
    assert not runtime_options(cfg, 0).fill_stream_gaps
    assert runtime_options(cfg, 0, draft=True).fill_stream_gaps  # the draft's passes are not verified rows
