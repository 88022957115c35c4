"""Memory headroom: estimates against llama.cpp's logged buffer sizes, load policies, NVML
handling and the draft watcher, all with injected numbers (no real memory pressure, no GPU)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from homespec.config import MemoryConfig
from homespec.errors import UserError
from homespec.llama.gguf_info import kv_bytes_per_token
from homespec.models.memory import (
    MIN_SHRINK_CTX,
    MODEL_OVERHEAD,
    VERIFY_OUTPUTS,
    Footprint,
    Headroom,
    InsufficientMemory,
    NvmlVram,
    compute_buffer,
    estimate,
    fmt_bytes,
    kv_cells,
    pair_footprints,
    plan_load,
    prefix_cache_budget,
    read_headroom,
)
from homespec.models.memory_watch import RELOAD_MARGIN, HeadroomWatcher, decide

MiB = 1024**2
GiB = 1024**3
MODELS = Path(__file__).resolve().parents[2] / "models"


@dataclass(frozen=True)
class FakeInfo:
    """The GGUFInfo fields memory.py reads; defaults are Qwen2.5-Coder-1.5B Q4_K_M's real values."""

    n_vocab: int = 151936
    n_embd: int = 1536
    n_layer: int = 28
    n_head: int = 12
    n_head_kv: int = 2
    head_dim_k: int = 128
    head_dim_v: int = 128
    tensor_bytes: int = 1111370240  # bytes; llama.cpp: "CPU_Mapped model buffer size = 1059.89 MiB"
    token_embd_bytes: int = 131272704  # bytes (q4_K)
    output_bytes: int = 191439360  # bytes (q6_K)

    def kv_bytes_per_token(self, kv_type: str = "f16") -> int:
        return kv_bytes_per_token(self.n_layer, self.n_head_kv * self.head_dim_k, self.n_head_kv * self.head_dim_v, kv_type)


QWEN_1_5B = FakeInfo()
QWEN_0_5B = FakeInfo(
    n_embd=896, n_layer=24, n_head=14, head_dim_k=64, head_dim_v=64,
    tensor_bytes=485452288, token_embd_bytes=93592576, output_bytes=144643072,
)  # fmt: skip


def mib(n: int) -> float:
    return round(n / MiB, 2)


# -- estimate ------------------------------------------------------------------------------------

# (model, n_ctx, n_ubatch, flash_attn, "CPU compute buffer size" llama.cpp printed, MiB)
LOGGED_COMPUTE = [
    (QWEN_1_5B, 4096, 512, True, 302.75),
    (QWEN_1_5B, 4096, 2048, True, 1211.01),
    (QWEN_1_5B, 32768, 64, True, 37.84),
    (QWEN_1_5B, 4096, 512, False, 305.75),
    (QWEN_1_5B, 16384, 512, False, 432.01),
    (QWEN_1_5B, 32768, 512, False, 848.01),
    (QWEN_1_5B, 32768, 64, False, 106.00),
    (QWEN_0_5B, 4096, 512, True, 300.25),
    (QWEN_0_5B, 4096, 64, True, 37.53),
    (QWEN_0_5B, 32768, 512, False, 969.26),
]


@pytest.mark.parametrize("info,n_ctx,n_ubatch,fa,logged", LOGGED_COMPUTE)
def test_compute_buffer_matches_llama_cpp_within_two_percent_never_below(info, n_ctx, n_ubatch, fa, logged):
    got = compute_buffer(info, n_ctx, n_ubatch, flash_attn=fa) / MiB
    assert logged - 0.01 <= got <= logged * 1.02


def test_cpu_only_estimate_is_llama_cpp_buffers_plus_logits_rows_and_overhead():
    fp = estimate(QWEN_1_5B, 4096, 512, 0)
    assert mib(fp.weights_ram) == 1059.89  # "CPU_Mapped model buffer size"
    assert mib(fp.kv_ram) == 112.00  # "CPU KV buffer size"
    assert fp.compute_ram == compute_buffer(QWEN_1_5B, 4096, 512) + VERIFY_OUTPUTS * 151936 * 4 + MODEL_OVERHEAD
    assert fp.vram == 0 and fp.ram == fp.weights_ram + fp.kv + fp.compute


def test_what_rides_with_the_target_counts_in_its_ram_only():
    alone = pair_footprints(QWEN_1_5B, QWEN_0_5B, n_batch=512)(4096)
    with_head = pair_footprints(QWEN_1_5B, QWEN_0_5B, n_batch=512, target_extra_ram=700 * MiB)(4096)
    assert with_head[0].ram == alone[0].ram + 700 * MiB
    assert with_head[0].vram == alone[0].vram and with_head[1] == alone[1]


def test_kv_cache_rounds_context_up_to_256_cells():
    # llama.cpp printed "CPU KV buffer size = 12.00 MiB" for the 0.5B model at n_ctx 1000.
    assert mib(estimate(QWEN_0_5B, 1000, 512, 0).kv) == 12.00


def test_exact_modes_q8_0_cache_is_planned_at_its_own_size_and_the_draft_stays_f16():
    # llama.cpp, the 1.5B target at n_ctx 4096: "size = 59.50 MiB (4096 cells, 28 layers, 1/1 seqs),
    # K (q8_0): 29.75 MiB, V (q8_0): 29.75 MiB"; f16 is 112 MiB.
    assert mib(estimate(QWEN_1_5B, 4096, 512, 0, kv_type="q8_0").kv) == 59.50
    exact = pair_footprints(QWEN_1_5B, QWEN_0_5B, n_batch=512, target_kv_type="q8_0")(4096)
    default = pair_footprints(QWEN_1_5B, QWEN_0_5B, n_batch=512)(4096)
    assert default[0].kv - exact[0].kv == (112 - 59.5) * MiB and exact[1] == default[1]


def test_n_ubatch_follows_n_batch_so_a_larger_batch_grows_the_compute_buffer():
    small, large = estimate(QWEN_1_5B, 4096, 512, 0), estimate(QWEN_1_5B, 4096, 2048, 0)
    assert large.compute - small.compute == compute_buffer(QWEN_1_5B, 4096, 2048) - compute_buffer(QWEN_1_5B, 4096, 512)
    assert estimate(QWEN_1_5B, 4096, 2048, 0, n_ubatch=512) == small


def test_partial_offload_moves_the_last_layers_weights_and_kv_to_vram():
    fp = estimate(QWEN_1_5B, 4096, 512, 14)
    layers = QWEN_1_5B.tensor_bytes - QWEN_1_5B.token_embd_bytes - QWEN_1_5B.output_bytes
    assert fp.weights_vram == layers // 2
    assert fp.weights_ram + fp.weights_vram == QWEN_1_5B.tensor_bytes
    assert fp.kv_vram == fp.kv_ram == 56 * MiB  # half the 112 MiB cache
    assert fp.compute_vram == compute_buffer(QWEN_1_5B, 4096, 512)
    assert fp.compute_ram == 512 * 1536 * 8 + VERIFY_OUTPUTS * 151936 * 4 + MODEL_OVERHEAD  # host staging


def test_output_layer_is_offloaded_only_when_n_gpu_layers_exceeds_n_layer():
    all_layers, plus_output, everything = (estimate(QWEN_1_5B, 4096, 512, g) for g in (28, 29, -1))
    assert all_layers.weights_ram == QWEN_1_5B.token_embd_bytes + QWEN_1_5B.output_bytes
    assert plus_output.weights_ram == QWEN_1_5B.token_embd_bytes  # token_embd never leaves RAM
    assert plus_output.weights_vram - all_layers.weights_vram == QWEN_1_5B.output_bytes
    assert everything == plus_output


def test_tied_output_is_copied_to_the_gpu_while_token_embd_stays_in_ram():
    tied = FakeInfo(tensor_bytes=1111370240 - 191439360, output_bytes=0)
    fp = estimate(tied, 4096, 512, -1)
    assert fp.weights_ram == tied.token_embd_bytes
    assert fp.weights_vram == tied.tensor_bytes  # layers + a copy of token_embd as the output


def test_info_without_io_sizes_falls_back_to_k_quant_types():
    plain = SimpleNamespace(**{k: v for k, v in vars(QWEN_1_5B).items() if not k.endswith(("embd_bytes", "output_bytes"))})
    plain.kv_bytes_per_token = QWEN_1_5B.kv_bytes_per_token
    # Q4_K_M gives this model exactly the fallback's types, so the split is the same.
    assert estimate(plain, 4096, 512, 14) == estimate(QWEN_1_5B, 4096, 512, 14)
    tiny = SimpleNamespace(**{**vars(plain), "tensor_bytes": 100 * MiB})  # io guess larger than the file
    fp = estimate(tiny, 4096, 512, 28)
    assert fp.weights_vram >= 49 * MiB and fp.weights_ram + fp.weights_vram == 100 * MiB


def test_estimate_places_the_measured_io_matrices_of_a_real_gguf_header(tmp_path):
    from homespec.llama.gguf_info import read_gguf_info
    from tests.unit.test_gguf_info import write_gguf

    info = read_gguf_info(write_gguf(tmp_path / "tiny.gguf", output=True))  # embd 1,024 B, output 256 B
    layers_only = estimate(info, 512, 64, info.n_layer)  # every repeating layer on the GPU
    # token_embd and output stay in RAM; before, a k-quant guess from n_vocab * n_embd was used.
    assert layers_only.weights_ram == 1024 + 256
    assert estimate(info, 512, 64, -1).weights_ram == 1024  # the output follows the layers


def test_estimate_rejects_a_nonpositive_context():
    with pytest.raises(ValueError, match="n_ctx"):
        estimate(QWEN_1_5B, 0, 512, 0)


@pytest.mark.skipif(
    not (MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf").exists(), reason="models not pulled (homespec models pull)"
)
def test_estimate_from_the_real_gguf_header_matches_llama_cpp_logged_sizes():
    from homespec.llama.gguf_info import read_gguf_info

    info = read_gguf_info(MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    fp = estimate(info, 4096, 512, 0)
    # llama.cpp 0.3.36 at load: model 1059.89, KV 112.00, compute 302.75 MiB.
    assert (mib(fp.weights_ram), mib(fp.kv)) == (1059.89, 112.00)
    assert mib(compute_buffer(info, 4096, 512)) == 302.75


# -- headroom and NVML ---------------------------------------------------------------------------


@dataclass
class FakeNvml:
    """pynvml stand-in: devices as (free, total, name) in bytes."""

    devices: list[tuple[int, int, str]]
    fail_init: bool = False
    fail_read: bool = False
    inits: int = 0
    calls: list[str] = field(default_factory=list)

    def nvmlInit(self):
        self.inits += 1
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        self.calls.append(f"index {i}")
        return self.devices[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(f"uuid {uuid}")
        return self.devices[0]

    def nvmlDeviceGetMemoryInfo(self, h):
        if self.fail_read:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(free=h[0], total=h[1], used=h[1] - h[0])

    def nvmlDeviceGetName(self, h):
        return h[2].encode()  # old nvidia-ml-py returns bytes


def test_missing_nvml_reads_as_no_vram_and_is_logged_once(caplog):
    def no_module():
        raise ImportError("No module named 'pynvml'")

    vram = NvmlVram(load=no_module)
    with caplog.at_level(logging.DEBUG, logger="homespec.models.memory"):
        assert vram() is None and vram() is None
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1


def test_nvml_without_driver_is_not_retried_every_poll():
    fake = FakeNvml([], fail_init=True)
    vram = NvmlVram(load=lambda: fake)
    assert vram() is None and vram() is None
    assert fake.inits == 1


def test_nvml_sums_the_gpus_cuda_visible_devices_lists(monkeypatch):
    fake = FakeNvml([(1 * GiB, 8 * GiB, "RTX 3060"), (5 * GiB, 12 * GiB, "X"), (2 * GiB, 4 * GiB, "Y")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert NvmlVram(load=lambda: fake)() == (3 * GiB, 12 * GiB, "RTX 3060 x2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert NvmlVram(load=lambda: fake)() == (8 * GiB, 24 * GiB, "RTX 3060 x3")


def test_cuda_visible_devices_empty_means_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert NvmlVram(load=lambda: FakeNvml([(1 * GiB, 8 * GiB, "RTX 3060")]))() is None


def test_nvml_error_while_reading_reads_as_no_vram():
    assert NvmlVram(load=lambda: FakeNvml([(1 * GiB, 8 * GiB, "RTX")], fail_read=True))() is None


def test_read_headroom_reports_ram_and_leaves_vram_empty_without_gpu():
    h = read_headroom(vram=lambda: None)
    assert 0 < h.ram_available <= h.ram_total
    assert (h.vram_free, h.vram_total, h.gpu_name) == (None, None, None)
    g = read_headroom(vram=lambda: (3 * GiB, 12 * GiB, "RTX 3060"))
    assert (g.vram_free, g.vram_total, g.gpu_name) == (3 * GiB, 12 * GiB, "RTX 3060")


def test_read_headroom_on_this_machine_never_raises():
    h = read_headroom()  # real psutil and, when installed, real NVML (no GPU here: None)
    assert h.ram_available > 0 and (h.vram_free is None) == (h.vram_total is None)


def test_fmt_bytes_uses_gib_from_one_gib_and_mib_below():
    assert (fmt_bytes(2 * GiB + GiB // 10), fmt_bytes(512 * MiB), fmt_bytes(-300 * MiB)) == ("2.1 GiB", "512 MiB", "-300 MiB")


# -- plan_load -----------------------------------------------------------------------------------


def fp(ram_mib: float, vram_mib: float = 0) -> Footprint:
    return Footprint(int(ram_mib * MiB), int(vram_mib * MiB), 0, 0, 0, 0)


def pair(target_mib: float, draft_mib: float | None, kv_per_4k_mib: float = 0, vram: tuple[float, float] = (0, 0)):
    """FootprintsAt: fixed RAM per model plus a KV part that scales with n_ctx."""

    def at(n_ctx: int):
        kv = kv_per_4k_mib * n_ctx / 4096
        t = fp(target_mib + kv, vram[0])
        return t, None if draft_mib is None else fp(draft_mib + kv, vram[1])

    return at


def ram(available_gib: float, vram_free_gib: float | None = None) -> Headroom:
    vram = None if vram_free_gib is None else int(vram_free_gib * GiB)
    return Headroom(int(available_gib * GiB), 32 * GiB, vram, None if vram is None else 12 * GiB, "RTX 3060" if vram else None)


def cfg(**kw) -> MemoryConfig:
    return MemoryConfig(**{"prefix_cache_mib": 0, **kw})


def test_pair_that_fits_is_loaded_and_the_log_line_gives_the_numbers(caplog):
    with caplog.at_level(logging.INFO, logger="homespec.models.memory"):
        plan = plan_load(pair(1536, 512), ram(8), cfg(prefix_cache_mib=512), n_ctx=4096)
    assert (plan.decision, plan.load_draft, plan.n_ctx) == ("load", True, 4096)
    assert plan.require() is plan
    assert plan.ram_need == (1536 + 512 + 512) * MiB
    line = caplog.records[-1].message
    for part in ("target + draft at n_ctx 4096", "need 2.5 GiB RAM", "target 1.5 GiB", "draft 512 MiB",
                 "prefix cache 512 MiB", "7.0 GiB available after the 1.0 GiB reserve"):  # fmt: skip
        assert part in line


def test_refuse_policy_refuses_when_pair_does_not_fit_with_an_actionable_line():
    plan = plan_load(pair(1536, 1024), ram(3.3), cfg(policy="refuse"), n_ctx=4096)
    assert (plan.decision, plan.load_draft, plan.ram_need) == ("refuse", False, 2560 * MiB)
    with pytest.raises(InsufficientMemory) as e:
        plan.require()
    assert isinstance(e.value, UserError)
    assert str(e.value) == (
        "not enough memory for target + draft at n_ctx 4096: need 2.5 GiB RAM, 2.3 GiB available after the "
        "1.0 GiB reserve (memory.reserve_mib); free memory, lower runtime.n_ctx or runtime.n_batch, or set memory.policy: drop-draft"
    )


def test_drop_draft_policy_serves_target_alone_when_pair_does_not_fit(caplog):
    with caplog.at_level(logging.WARNING, logger="homespec.models.memory"):
        plan = plan_load(pair(1536, 1024), ram(3.0), cfg(policy="drop-draft"), n_ctx=4096)
    assert (plan.decision, plan.load_draft, plan.n_ctx) == ("drop-draft", False, 4096)
    assert plan.ram_need == 1536 * MiB
    assert "target + draft at n_ctx 4096 would need 2.5 GiB RAM (memory.policy: drop-draft)" in caplog.records[-1].message


def test_drop_draft_policy_refuses_when_target_alone_does_not_fit_and_suggests_shrinking():
    plan = plan_load(pair(3072, 512), ram(3.0), cfg(policy="drop-draft"), n_ctx=4096)
    assert plan.decision == "refuse"
    assert plan.message.startswith("not enough memory for target alone at n_ctx 4096: need 3.0 GiB RAM, 2.0 GiB")
    assert plan.message.endswith("set memory.policy: shrink-context")


def test_shrink_context_halves_the_context_until_the_pair_fits():
    # 1 GiB of KV per model at 4096 tokens: the pair needs 3.5 GiB at 4096, 2.5 at 2048, 2.0 at 1024.
    plan = plan_load(pair(1024, 512, kv_per_4k_mib=1024), ram(3.2), cfg(policy="shrink-context"), n_ctx=4096)
    assert (plan.decision, plan.load_draft, plan.n_ctx) == ("shrink-context", True, 1024)
    assert "target + draft at n_ctx 4096 would need 3.5 GiB RAM" in plan.message


def test_shrink_context_stops_at_the_floor_then_drops_the_draft_at_the_configured_context():
    # The draft alone (1.5 GiB) never fits beside the target, whatever the context.
    plan = plan_load(pair(1024, 1536, kv_per_4k_mib=256), ram(3.5), cfg(policy="shrink-context"), n_ctx=4096)
    assert (plan.decision, plan.load_draft, plan.n_ctx) == ("drop-draft", False, 4096)


def test_shrink_context_never_goes_below_the_floor():
    calls: list[int] = []
    at = pair(4096, 512, kv_per_4k_mib=512)

    def spy(n):
        calls.append(n)
        return at(n)

    plan = plan_load(spy, ram(2), cfg(policy="shrink-context"), n_ctx=3000)
    assert plan.decision == "refuse" and min(calls) == MIN_SHRINK_CTX == plan.n_ctx
    assert sorted(set(calls), reverse=True) == [3000, 1500, 750, 512]
    assert plan.message.endswith("free memory, lower runtime.n_batch, or use a smaller model")


def test_prefix_cache_budget_counts_against_ram():
    assert prefix_cache_budget(cfg(prefix_cache_mib=1024)) == 1024 * MiB
    fits = plan_load(pair(1024, 512), ram(3.0), cfg(policy="refuse"), n_ctx=4096)
    assert fits.decision == "load"
    short = plan_load(pair(1024, 512), ram(3.0), cfg(policy="refuse", prefix_cache_mib=1024), n_ctx=4096)
    assert short.decision == "refuse" and "need 2.5 GiB RAM" in short.message


def test_vram_shortfall_refuses_with_gpu_layer_advice_even_when_ram_is_plentiful():
    plan = plan_load(pair(512, 256, vram=(6144, 1024)), ram(30, vram_free_gib=5), cfg(policy="drop-draft"), n_ctx=4096)
    assert plan.decision == "refuse"
    assert "need 6.0 GiB VRAM, 4.5 GiB free on RTX 3060 after the 512 MiB VRAM reserve" in plan.message
    assert plan.message.endswith("lower models.target.n_gpu_layers or models.draft.n_gpu_layers, or free GPU memory")


def test_drop_draft_frees_vram_when_the_draft_is_offloaded():
    plan = plan_load(pair(512, 256, vram=(4096, 1024)), ram(30, vram_free_gib=5), cfg(), n_ctx=4096)
    assert (plan.decision, plan.vram_need) == ("drop-draft", 4096 * MiB)


def test_unreadable_vram_counts_the_offloaded_part_as_ram():
    plan = plan_load(pair(512, 256, vram=(2048, 512)), ram(3.0), cfg(policy="refuse"), n_ctx=4096)
    assert plan.decision == "refuse" and plan.ram_need == (512 + 256 + 2048 + 512) * MiB
    assert "VRAM unreadable: offloaded part counted as RAM" in plan.message


def test_no_draft_configured_loads_the_target_alone_as_a_plain_load():
    plan = plan_load(pair(1024, None), ram(4), cfg(policy="refuse"), n_ctx=4096)
    assert (plan.decision, plan.load_draft) == ("load", False)


def test_pair_footprints_estimates_both_models_from_gguf_metadata():
    t, d = pair_footprints(QWEN_1_5B, QWEN_0_5B, n_batch=512)(2048)
    assert t == estimate(QWEN_1_5B, 2048, 512, 0) and d == estimate(QWEN_0_5B, 2048, 512, 0)
    assert pair_footprints(QWEN_1_5B, None, n_batch=512)(2048)[1] is None


# -- watcher -------------------------------------------------------------------------------------

DRAFT = fp(600)  # a CPU draft: 600 MiB of RAM


class Clock:
    def __init__(self, t: float = 1_750_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def watcher(levels_gib: list[float], draft: Footprint = DRAFT, vram_gib: list[float] | None = None, **kw):
    """A watcher whose headroom reads come from a script; returns it and the callback log."""
    calls: list[str] = []
    reads = iter(range(len(levels_gib)))

    def read() -> Headroom:
        i = next(reads)
        return ram(levels_gib[i], None if vram_gib is None else vram_gib[i])

    w = HeadroomWatcher(
        cfg(), draft, on_unload_draft=lambda: calls.append("unload"), on_reload_draft=lambda: calls.append("reload"),
        read=read, clock=kw.pop("clock", Clock()), **kw,
    )  # fmt: skip
    return w, calls


def test_watcher_unloads_the_draft_below_the_reserve_and_says_so(caplog):
    clock = Clock()
    w, calls = watcher([0.6], clock=clock)
    with caplog.at_level(logging.WARNING, logger="homespec.models.memory"):
        act = w.check()
    assert act is not None and act.action == "unload-draft" and calls == ["unload"] and not w.draft_loaded
    hhmmss = time.strftime("%H:%M:%S", time.localtime(clock.t))
    (ev,) = w.events
    assert ev.kind == "unload-draft" and ev.at == clock.t
    assert ev.message == (
        f"draft unloaded at {hhmmss}: RAM headroom 614 MiB < 1.0 GiB reserve; speculation falls back to ngram/off"
    )
    assert caplog.records[-1].message == ev.message


def test_watcher_loads_the_draft_back_when_headroom_returns():
    # reserve 1 GiB + draft 600 MiB + margin 256 MiB = 1.84 GiB needed to reload.
    w, calls = watcher([0.5, 1.5, 1.8, 1.9])
    actions = [getattr(w.check(), "action", None) for _ in range(4)]
    assert actions == ["unload-draft", None, None, "reload-draft"]
    assert calls == ["unload", "reload"] and w.draft_loaded
    assert w.events[-1].message.split(": ", 1)[1] == (
        "RAM headroom 1.9 GiB >= 1.0 GiB reserve + 600 MiB draft + 256 MiB margin"
    )


def test_watcher_does_not_flap_near_the_reserve():
    # Headroom wobbles +-100 MiB around the reserve, and after the unload it rises by the draft's
    # 600 MiB: never enough for reserve + draft + margin, so exactly one unload and no reload.
    wobble = [0.95, 1.05] * 10
    after_unload = [x + 600 / 1024 for x in wobble]
    w, calls = watcher([wobble[0], *after_unload])
    for _ in range(len(after_unload) + 1):
        w.check()
    assert calls == ["unload"]


def test_reload_threshold_leaves_the_margin_above_the_unload_threshold():
    c = cfg()
    need = c.reserve_mib * MiB + DRAFT.ram + RELOAD_MARGIN
    just_below = Headroom(need - 1, 32 * GiB)
    assert decide(just_below, False, DRAFT, c) is None
    assert decide(Headroom(need, 32 * GiB), False, DRAFT, c).action == "reload-draft"
    # After that reload the headroom is reserve + margin: well clear of the unload threshold.
    assert decide(Headroom(need - DRAFT.ram, 32 * GiB), True, DRAFT, c) is None


def test_low_vram_unloads_a_gpu_draft_but_not_a_cpu_one():
    gpu_draft = fp(100, vram_mib=800)
    w, calls = watcher([8, 8], draft=gpu_draft, vram_gib=[0.3, 0.3])
    assert w.check().reason == "VRAM headroom 307 MiB < 512 MiB VRAM reserve" and calls == ["unload"]
    assert decide(ram(8, 0.3), True, DRAFT, cfg()) is None
    # Reload waits for VRAM reserve + draft VRAM + margin, not only RAM.
    assert decide(ram(8, 1.4), False, gpu_draft, cfg()) is None
    assert decide(ram(8, 1.6), False, gpu_draft, cfg()).action == "reload-draft"


def test_failed_unload_callback_keeps_the_draft_marked_loaded_and_is_recorded():
    def boom():
        raise MemoryError("cannot free")

    w = HeadroomWatcher(cfg(), DRAFT, on_unload_draft=boom, on_reload_draft=lambda: None,
                        read=lambda: ram(0.5), clock=Clock())  # fmt: skip
    assert w.check() is None and w.draft_loaded
    assert w.events[-1].kind == "callback-failed" and "MemoryError: cannot free" in w.events[-1].message


def test_low_headroom_with_the_draft_gone_is_reported_once_per_episode():
    w, calls = watcher([0.5, 0.4, 0.3, 1.2, 0.5], draft_loaded=False)
    for _ in range(5):
        w.check()
    assert calls == [] and [e.kind for e in w.events] == ["low-headroom", "low-headroom"]


def test_watcher_thread_polls_at_the_interval_and_stops():
    polled = threading.Event()
    count = 0

    def read() -> Headroom:
        nonlocal count
        count += 1
        if count >= 3:
            polled.set()
        return ram(8)

    w = HeadroomWatcher(cfg(watch_interval_s=0.01), DRAFT, on_unload_draft=lambda: None,
                        on_reload_draft=lambda: None, read=read)  # fmt: skip
    w.start()
    try:
        assert polled.wait(5)
    finally:
        w.stop()
    seen = count
    time.sleep(0.05)
    assert count == seen and w.last == ram(8)


def test_a_reserve_larger_than_the_machine_names_memory_reserve_mib_and_never_a_negative_amount():
    plan = plan_load(pair(1536, 512), ram(3.0), cfg(reserve_mib=100 * 1024), n_ctx=4096)  # 100 GiB of 32
    assert plan.decision == "refuse"
    assert "lower memory.reserve_mib: it must stay below this machine's 32.0 GiB of RAM" in plan.message
    assert "-" not in plan.message.split("need", 1)[1].split("reserve")[0]  # "0 B available", not "-97 GiB"
    busy = plan_load(pair(1536, 512), ram(3.0), cfg(reserve_mib=4 * 1024), n_ctx=4096)  # more than is free now
    assert "free memory or lower memory.reserve_mib: its 4.0 GiB exceed the 3.0 GiB available" in busy.message


def test_memory_reserve_mib_is_bounded_in_the_config():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        MemoryConfig(reserve_mib=2_000_000)


def test_a_refusal_says_whether_an_empty_machine_would_fit_it():
    """Only a setup larger than the whole machine is final (serve exits 78, not retried);
    memory other programs hold now may be freed (exit 75, systemd retries)."""
    busy = plan_load(pair(1536, 512), ram(1.0), cfg(), n_ctx=4096)  # 1 GiB free of 32
    assert busy.decision == "refuse" and not busy.never_fits
    with pytest.raises(InsufficientMemory) as e:
        busy.require()
    assert not e.value.never_fits
    huge = plan_load(pair(40 * 1024, 512), ram(3.0), cfg(), n_ctx=4096)  # a 40 GiB model, 32 GiB of RAM
    assert huge.never_fits
    reserve = plan_load(pair(1536, 512), ram(3.0), cfg(reserve_mib=100 * 1024), n_ctx=4096)
    assert reserve.never_fits
    vram = plan_load(pair(1536, 512, vram=(14 * 1024, 0)), ram(20.0, vram_free_gib=8.0), cfg(), n_ctx=4096)  # 14 GiB on a 12 GiB GPU
    assert vram.decision == "refuse" and vram.never_fits
    tiny_gpu = plan_load(pair(1536, 512, vram=(1024, 0)), ram(20.0, vram_free_gib=0.1), cfg(), n_ctx=4096)  # 100 MiB free
    assert "need 1.0 GiB VRAM, 0 MiB free" in tiny_gpu.message, tiny_gpu.message  # not "-924 MiB"


def test_kv_cells_round_the_total_up_and_with_a_stream_per_slot_each_stream_again():
    # llama-context.cpp: n_ctx = pad(n_ctx * slots); per stream n_ctx_seq = pad(n_ctx / slots).
    assert kv_cells(1000, 1) == 1024 and kv_cells(4096, 4) == kv_cells(4096, 4, unified=False) == 16384
    assert kv_cells(1100, 4) == 4608  # one buffer
    assert kv_cells(1100, 4, unified=False) == 4 * 1280  # 4608 / 4 = 1152 -> 1280 a stream
