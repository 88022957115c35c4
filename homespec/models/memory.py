"""Memory headroom: what each model needs, what the machine has, what to load, and when to shed.

Four parts, each small:
  estimate()        bytes one model needs (weights, KV cache, compute buffers), RAM and VRAM apart
  read_headroom()   available RAM (psutil) and free VRAM (NVML, optional) now
  plan_load()       the load decision under memory.policy, with one log line that gives the numbers
  (memory_watch.py) while serving: unload the draft below the reserve, load it back when room returns

mmap and "available": with use_mmap the weights are page cache. Pages not yet touched are not
resident, and resident ones count as reclaimable, so psutil's `available` barely moves when a model
is mapped. The estimate nevertheless counts every weight byte as needed RAM: every forward pass
reads all weights (a model whose weights do not stay resident re-reads them from disk each token),
and on CPUs with repacked kernels (AVX2 q4_K, AMX) llama.cpp copies them into anonymous memory at
load anyway (measured here: the AMX buffer took 951 MiB of a 1060 MiB model). A file that is
already cached when the daemon starts is thus counted twice, a conservative error of at most its
size. While serving, the watcher compares `available` as psutil reports it: mapped weights in use
still look reclaimable there, so without mlock the watcher notices pressure late, when the kernel
has started evicting them; set runtime.use_mlock for a strict reserve.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import psutil

from homespec.errors import UserError

if TYPE_CHECKING:
    from homespec.config import MemoryConfig
    from homespec.llama.gguf_info import GGUFInfo, KvType

log = logging.getLogger("homespec.models.memory")

MiB = 1024**2  # bytes
GiB = 1024**3  # bytes

# llama.cpp rounds the KV cache up to a multiple of 256 cells (measured: n_ctx 1000 -> 1024 cells).
KV_PAD = 256  # tokens
# Logits rows the verify pass asks for: k + 1 with k <= speculation.k_max <= 64. llama.cpp grows
# its host output buffer to the most rows ever requested in one batch and keeps it.
VERIFY_OUTPUTS = 65  # rows
# Per loaded model, beyond its buffers: llama.cpp's vocabulary tables, graph metadata and thread
# work buffers. Measured 49-51 MiB of anonymous RSS for each of the Qwen2.5 pair (151,936 tokens).
MODEL_OVERHEAD = 64 * MiB  # bytes
# Below ~512 tokens a system prompt plus one exchange hardly fits; shrinking further only turns a
# clear refusal into a daemon that fails on the first real request.
MIN_SHRINK_CTX = 512  # tokens

# Used only when the GGUF info lacks token_embd_bytes/output_bytes (a file without a
# token_embd.weight tensor, or an info built by hand): the tensor types llama.cpp's
# k-quant presets give these matrices (q4_K for token_embd and q6_K for output in Q4_K_M).
_FALLBACK_EMBD_BITS = 4.5  # bits per element
_FALLBACK_OUTPUT_BITS = 6.5625  # bits per element


# -- estimate ------------------------------------------------------------------------------------


def kv_cells(n_ctx: int, slots: int, unified: bool = True) -> int:
    """KV cells llama.cpp allocates for `slots` sequences of n_ctx tokens (llama-context.cpp): the
    total rounded up to KV_PAD, and with a stream per sequence each stream rounded up again."""
    total = -(-n_ctx * slots // KV_PAD) * KV_PAD
    if unified:
        return total
    return -(-(total // slots) // KV_PAD) * KV_PAD * slots


@dataclass(frozen=True)
class Footprint:
    """What one loaded model occupies, split by where llama.cpp puts it. All sizes in bytes."""

    weights_ram: int  # bytes
    weights_vram: int  # bytes
    kv_ram: int  # bytes
    kv_vram: int  # bytes
    compute_ram: int  # bytes: compute buffer (or its host staging part), logits buffer, MODEL_OVERHEAD
    compute_vram: int  # bytes

    @property
    def kv(self) -> int:  # bytes
        return self.kv_ram + self.kv_vram

    @property
    def compute(self) -> int:  # bytes
        return self.compute_ram + self.compute_vram

    @property
    def ram(self) -> int:  # bytes
        return self.weights_ram + self.kv_ram + self.compute_ram

    @property
    def vram(self) -> int:  # bytes
        return self.weights_vram + self.kv_vram + self.compute_vram


def _io_bytes(info: GGUFInfo) -> tuple[int, int]:
    """(token_embd, output) matrix sizes in bytes; output 0 when tied to token_embd.

    read_gguf_info measures both from the tensor table; the k-quant guess is the fallback."""
    embd = getattr(info, "token_embd_bytes", None)
    out = getattr(info, "output_bytes", None)
    if embd is None or out is None:
        elems = info.n_vocab * info.n_embd
        embd = int(elems * _FALLBACK_EMBD_BITS / 8)
        out = int(elems * _FALLBACK_OUTPUT_BITS / 8)
        # Never let the guess eat the repeating layers of a small or unusual model.
        scale = min(1.0, info.tensor_bytes / 2 / max(1, embd + out))
        embd, out = int(embd * scale), int(out * scale)
    return embd, out


def compute_buffer(info: GGUFInfo, n_ctx: int, n_ubatch: int, *, flash_attn: bool = True) -> int:
    """llama.cpp's compute buffer (bytes) for the worst-case graph it reserves at context creation.

    llama.cpp reserves a graph of n_ubatch tokens that all produce logits; the buffer is the peak of
    live tensors, which is either at the output layer or (without flash attention) in attention:
      output:    n_ubatch * (n_vocab + 2 * n_embd) * 4    (logits f32 + normed hidden state)
                 + n_ubatch * n_embd * 4 more without flash attention
      attention: n_ubatch * n_kv * (n_head + 1) * 4       (KQ scores f32 + mask) when not flash
                 + n_ubatch * n_embd * 24                 (Q/K/V and residual activations)
    Fitted to llama.cpp's "CPU compute buffer size" for Qwen2.5 0.5B and 1.5B at n_ctx 512..32768,
    n_ubatch 64..2048, flash attention on and off: exact to 0.1 MiB with flash attention, within
    +2 % / -0 % without.
    """
    n_kv = -(-n_ctx // KV_PAD) * KV_PAD  # cells
    out = n_ubatch * (info.n_vocab + (2 if flash_attn else 3) * info.n_embd) * 4
    if flash_attn:
        return out
    attn = n_ubatch * n_kv * (info.n_head + 1) * 4 + n_ubatch * info.n_embd * 24
    return max(out, attn)


def estimate(
    info: GGUFInfo,
    n_ctx: int,
    n_batch: int,
    n_gpu_layers: int,
    *,
    n_ubatch: int | None = None,
    flash_attn: bool = True,
    n_outputs: int = VERIFY_OUTPUTS,
    kv_type: KvType = "f16",
) -> Footprint:
    """Bytes `info`'s model needs at this context, as llama.cpp places it.

    n_ubatch defaults to n_batch, as runtime.py sets it. flash_attn: llama.cpp's default "auto"
    turns it on for the CPU (measured) and for CUDA. kv_type: the cache's element type ("f16", the
    default; exact mode's "q8_0" takes 34 bytes per 32 elements).

    Placement follows llama.cpp's layer split: token_embd always stays in RAM; n_gpu_layers counts
    the n_layer repeating layers from the last one down, and the output matrix is one more "layer",
    offloaded only when n_gpu_layers > n_layer (-1 = everything). A tied output (no output.weight)
    is a copy of token_embd on the GPU. Repeating layers are taken as equal in size (q4_K_M gives a
    few layers q6_K tensors: +/- 7 % per layer). With layers offloaded the KV cache of those layers
    is on the GPU (offload_kqv, the default) and so is the compute buffer (op_offload moves large
    batches there); RAM keeps a host staging buffer of n_ubatch * n_embd * 8 bytes. The GPU side is
    modelled on llama.cpp's CUDA logs, not measured here (no GPU on the development machine).

    Buffers count at the size llama.cpp allocates, though Linux backs only the pages it touches:
    after a 512-token prefill and a 17-token verify pass the 1.5B target held 1302 MiB resident
    (1576 estimated); a batch with logits at all 512 positions touches everything (1823 MiB
    measured, 1835 estimated with n_outputs=512).
    """
    if n_ctx <= 0 or n_batch <= 0:
        raise ValueError(f"n_ctx and n_batch must be positive, got {n_ctx} and {n_batch}")
    u = min(n_ubatch or n_batch, n_batch)  # tokens per graph; llama.cpp clamps n_ubatch to n_batch
    n_layer = info.n_layer
    gpu_layers = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    gpu_rep = min(gpu_layers, n_layer)  # repeating layers on the GPU
    output_on_gpu = gpu_layers > n_layer

    embd, out = _io_bytes(info)
    layers_vram = max(0, info.tensor_bytes - embd - out) * gpu_rep // max(1, n_layer)  # bytes
    weights_vram = layers_vram + ((out or embd) if output_on_gpu else 0)
    weights_ram = info.tensor_bytes - layers_vram - (out if output_on_gpu else 0)

    cells = kv_cells(n_ctx, 1)
    kv = cells * info.kv_bytes_per_token(kv_type)
    kv_vram = kv * gpu_rep // max(1, n_layer)

    graph = compute_buffer(info, cells, u, flash_attn=flash_attn)
    host = n_outputs * info.n_vocab * 4 + MODEL_OVERHEAD  # bytes: logits (f32) and the rest
    if gpu_layers > 0:
        compute_ram, compute_vram = u * info.n_embd * 8 + host, graph
    else:
        compute_ram, compute_vram = graph + host, 0
    return Footprint(
        weights_ram=weights_ram,
        weights_vram=weights_vram,
        kv_ram=kv - kv_vram,
        kv_vram=kv_vram,
        compute_ram=compute_ram,
        compute_vram=compute_vram,
    )


def prefix_cache_budget(cfg: MemoryConfig) -> int:
    """Bytes of saved KV states the prefix cache keeps in RAM (its arena, held and written at
    warm-up); plan_load counts all of them."""
    return cfg.prefix_cache_mib * MiB


# -- headroom ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Headroom:
    """Memory free now. All sizes in bytes; the VRAM fields are None when it cannot be read."""

    ram_available: int  # bytes: psutil's `available` (free + reclaimable cache)
    ram_total: int  # bytes
    vram_free: int | None = None  # bytes, summed over the visible NVIDIA GPUs
    vram_total: int | None = None  # bytes
    gpu_name: str | None = None


Vram = tuple[int, int, str]  # free bytes, total bytes, device name


class NvmlVram:
    """Free and total VRAM of the visible NVIDIA GPUs via NVML, or None without one.

    nvidia-ml-py (module `pynvml`) is optional. Missing module, missing driver and any NVML error
    all read as None, each logged once at debug: a CPU-only box is normal, not a problem. The
    devices are those in CUDA_VISIBLE_DEVICES when it lists indices or UUIDs (what llama.cpp's
    CUDA backend sees), else all; with several GPUs the sums are reported (llama.cpp splits layers
    across them).
    """

    def __init__(self, load: Callable[[], ModuleType] = lambda: importlib.import_module("pynvml")) -> None:
        self._load = load
        self._nvml: ModuleType | None = None
        self._failed = False  # init failed: do not retry every poll
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def _debug_once(self, msg: str) -> None:
        if msg not in self._logged:
            self._logged.add(msg)
            log.debug("VRAM not read: %s", msg)

    def _init(self) -> ModuleType | None:
        if self._nvml is None and not self._failed:
            try:
                nvml = self._load()
                nvml.nvmlInit()
                self._nvml = nvml
            except Exception as e:  # ImportError, NVMLError (no driver), OSError (no libnvidia-ml)
                self._failed = True
                self._debug_once(f"NVML unavailable ({type(e).__name__}: {e})")
        return self._nvml

    def _handles(self, nvml: ModuleType) -> list:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        ids = [s.strip() for s in visible.split(",") if s.strip()]
        handles = []
        for s in ids:
            if s.lstrip("-").isdigit():
                if int(s) < 0:  # CUDA stops at the first invalid index
                    break
                handles.append(nvml.nvmlDeviceGetHandleByIndex(int(s)))
            else:
                handles.append(nvml.nvmlDeviceGetHandleByUUID(s))
        return handles

    def __call__(self) -> Vram | None:
        with self._lock:
            nvml = self._init()
            if nvml is None:
                return None
            try:
                handles = self._handles(nvml)
                if not handles:
                    self._debug_once("no visible NVIDIA GPU")
                    return None
                infos = [nvml.nvmlDeviceGetMemoryInfo(h) for h in handles]
                name = nvml.nvmlDeviceGetName(handles[0])
            except Exception as e:  # NVMLError of any kind (GPU lost, bad UUID...)
                self._debug_once(f"NVML error ({type(e).__name__}: {e})")
                return None
            if isinstance(name, bytes):  # older nvidia-ml-py returns bytes
                name = name.decode("utf-8", "replace")
            if len(handles) > 1:
                name = f"{name} x{len(handles)}"
            return sum(int(i.free) for i in infos), sum(int(i.total) for i in infos), name


read_vram = NvmlVram()


def read_headroom(vram: Callable[[], Vram | None] = read_vram) -> Headroom:
    """Available RAM and, when an NVIDIA GPU is readable, free VRAM. Never raises for a missing GPU."""
    vm = psutil.virtual_memory()
    v = vram()
    if v is None:
        return Headroom(ram_available=int(vm.available), ram_total=int(vm.total))
    free, total, name = v
    return Headroom(int(vm.available), int(vm.total), free, total, name)


def fmt_bytes(n: int) -> str:
    """'1.3 GiB' from 1 GiB up, '512 MiB' below: what the log lines and errors show."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    return f"{sign}{n / GiB:.1f} GiB" if n >= GiB else f"{sign}{n / MiB:.0f} MiB"


# -- load plan -----------------------------------------------------------------------------------


class InsufficientMemory(UserError):
    """The models do not fit in memory under the configured policy; the message says what to change.

    never_fits: not even with every byte of the machine free (a reserve or a model larger than
    its RAM): retrying cannot help, unlike memory that other programs hold for now."""

    def __init__(self, message: str, never_fits: bool = False) -> None:
        super().__init__(message)
        self.never_fits = never_fits


Decision = Literal["load", "drop-draft", "shrink-context", "refuse"]
# n_ctx -> (target, draft or None): footprints at a given context, so shrink-context can re-ask.
FootprintsAt = Callable[[int], tuple[Footprint, Footprint | None]]


@dataclass(frozen=True)
class LoadPlan:
    decision: Decision
    load_draft: bool
    n_ctx: int  # tokens
    ram_need: int  # bytes: models + prefix cache (for a refusal: the smallest setup tried)
    ram_available: int  # bytes, before the reserve
    vram_need: int  # bytes
    vram_free: int | None  # bytes, before the VRAM reserve; None when unreadable
    message: str  # one line with the numbers
    never_fits: bool = False  # a refusal that would stand with the whole machine free

    def require(self) -> LoadPlan:
        """This plan, or InsufficientMemory with the plan's message when it is a refusal."""
        if self.decision == "refuse":
            raise InsufficientMemory(self.message, self.never_fits)
        return self


def pair_footprints(
    target: GGUFInfo,
    draft: GGUFInfo | None,
    *,
    n_batch: int,
    target_gpu_layers: int = 0,
    draft_gpu_layers: int = 0,
    flash_attn: bool = True,
    target_kv_type: KvType = "f16",  # the draft's cache is always f16 (exact mode changes the target only)
    target_extra_ram: int = 0,  # bytes: what rides with the target in RAM (the MTP head)
) -> FootprintsAt:
    """The FootprintsAt plan_load wants, from GGUF metadata and the runtime settings."""

    def at(n_ctx: int) -> tuple[Footprint, Footprint | None]:
        t = estimate(target, n_ctx, n_batch, target_gpu_layers, flash_attn=flash_attn, kv_type=target_kv_type)
        t = replace(t, compute_ram=t.compute_ram + target_extra_ram)
        d = None if draft is None else estimate(draft, n_ctx, n_batch, draft_gpu_layers, flash_attn=flash_attn)
        return t, d

    return at


def _candidates(policy: str, n_ctx: int, has_draft: bool) -> list[tuple[bool, int]]:
    """(load_draft, n_ctx) setups in the order the policy accepts them; the first is the config."""
    shrunk: list[int] = []
    n = n_ctx
    while policy == "shrink-context" and n > MIN_SHRINK_CTX:
        n = max(MIN_SHRINK_CTX, n // 2)
        shrunk.append(n)
    # shrink-context keeps the draft as long as some context fits with it, then behaves like
    # drop-draft at the configured context, shrinking again for the target alone.
    out = [(True, n) for n in [n_ctx, *shrunk]] if has_draft else []
    if not has_draft or policy != "refuse":
        out += [(False, n) for n in [n_ctx, *shrunk]]
    return out


@dataclass(frozen=True)
class _Check:
    ram_need: int  # bytes
    vram_need: int  # bytes
    ram_ok: bool
    vram_ok: bool
    vram_as_ram: bool  # VRAM unreadable: its part was counted against RAM


def _check(t: Footprint, d: Footprint | None, prefix: int, h: Headroom, cfg: MemoryConfig) -> _Check:
    parts = [t] if d is None else [t, d]
    ram = sum(p.ram for p in parts) + prefix
    vram = sum(p.vram for p in parts)
    # Without a readable GPU the offloaded part lands in RAM: unified memory (Apple), a CPU-only
    # build that ignores n_gpu_layers, or a GPU NVML cannot see (counted as RAM: conservative).
    as_ram = vram > 0 and h.vram_free is None
    if as_ram:
        ram, vram = ram + vram, 0
    ram_ok = ram + cfg.reserve_mib * MiB <= h.ram_available
    vram_ok = vram == 0 or (h.vram_free is not None and vram + cfg.vram_reserve_mib * MiB <= h.vram_free)
    return _Check(ram, vram, ram_ok, vram_ok, as_ram)


def _never_fits(c: _Check, h: Headroom, cfg: MemoryConfig) -> bool:
    """The setup needs more than the machine has in all (plus the reserve), free or not."""
    ram = c.ram_need + cfg.reserve_mib * MiB > h.ram_total
    vram = c.vram_need > 0 and h.vram_total is not None and c.vram_need + cfg.vram_reserve_mib * MiB > h.vram_total
    return ram or vram


def _what(load_draft: bool, n_ctx: int, has_draft: bool) -> str:
    models = "target + draft" if load_draft else "target alone" if has_draft else "target"
    return f"{models} at n_ctx {n_ctx}"


def _numbers(c: _Check, h: Headroom, cfg: MemoryConfig) -> str:
    # Never a negative "available": a reserve above what is free leaves nothing.
    s = (
        f"need {fmt_bytes(c.ram_need)} RAM, {fmt_bytes(max(0, h.ram_available - cfg.reserve_mib * MiB))} available "
        f"after the {fmt_bytes(cfg.reserve_mib * MiB)} reserve (memory.reserve_mib)"
    )
    if c.vram_as_ram:
        s += " (VRAM unreadable: offloaded part counted as RAM)"
    elif c.vram_need:
        gpu = f" on {h.gpu_name}" if h.gpu_name else ""
        s += (
            f"; need {fmt_bytes(c.vram_need)} VRAM, {fmt_bytes(max(0, (h.vram_free or 0) - cfg.vram_reserve_mib * MiB))} "
            f"free{gpu} after the {fmt_bytes(cfg.vram_reserve_mib * MiB)} VRAM reserve"
        )
    return s


def _advice(c: _Check, h: Headroom, cfg: MemoryConfig, has_draft: bool) -> str:
    if cfg.reserve_mib * MiB >= h.ram_total:
        return f"lower memory.reserve_mib: it must stay below this machine's {fmt_bytes(h.ram_total)} of RAM"
    if cfg.reserve_mib * MiB > h.ram_available:
        return f"free memory or lower memory.reserve_mib: its {fmt_bytes(cfg.reserve_mib * MiB)} exceed the {fmt_bytes(h.ram_available)} available"
    if not c.vram_ok:
        return "lower models.target.n_gpu_layers or models.draft.n_gpu_layers, or free GPU memory"
    # n_batch sizes the compute buffer (n_batch x vocab logits: 297 MiB per Qwen2.5 model at 512),
    # often a bigger lever than n_ctx for small models.
    if cfg.policy == "refuse" and has_draft:
        return "free memory, lower runtime.n_ctx or runtime.n_batch, or set memory.policy: drop-draft"
    if cfg.policy != "shrink-context":
        return "free memory, lower runtime.n_ctx or runtime.n_batch, or set memory.policy: shrink-context"
    if cfg.prefix_cache_mib:
        return "free memory, lower runtime.n_batch or memory.prefix_cache_mib, or use a smaller model"
    return "free memory, lower runtime.n_batch, or use a smaller model"


def plan_load(footprints: FootprintsAt, headroom: Headroom, cfg: MemoryConfig, *, n_ctx: int) -> LoadPlan:
    """Decide what to load under cfg.policy, and log one line with the numbers.

    refuse:          the configured pair (target + draft, if any) at n_ctx, or refuse.
    drop-draft:      then the target alone at n_ctx.
    shrink-context:  the pair at n_ctx, n_ctx/2, ... down to MIN_SHRINK_CTX; then the target alone
                     at n_ctx, n_ctx/2, ... (a shorter context is the smaller loss, speculation the
                     next one; both before refusing).
    The prefix-cache budget is counted in full in every setup; RAM and VRAM each keep their reserve.
    """
    prefix = prefix_cache_budget(cfg)
    cache: dict[int, tuple[Footprint, Footprint | None]] = {}
    cache[n_ctx] = footprints(n_ctx)
    has_draft = cache[n_ctx][1] is not None
    tried: list[tuple[bool, int, _Check]] = []
    for load_draft, n in _candidates(cfg.policy, n_ctx, has_draft):
        if n not in cache:
            cache[n] = footprints(n)
        t, d = cache[n]
        c = _check(t, d if load_draft else None, prefix, headroom, cfg)
        tried.append((load_draft, n, c))
        if c.ram_ok and c.vram_ok:
            break
    load_draft, n, c = tried[-1]
    if not (c.ram_ok and c.vram_ok):
        msg = (
            f"not enough memory for {_what(load_draft, n, has_draft)}: {_numbers(c, headroom, cfg)}; "
            f"{_advice(c, headroom, cfg, has_draft)}"
        )
        log.error("%s", msg)
        return LoadPlan("refuse", False, n, c.ram_need, headroom.ram_available, c.vram_need, headroom.vram_free, msg,
                        never_fits=_never_fits(c, headroom, cfg))
    decision: Decision = "load" if len(tried) == 1 else "shrink-context" if n < n_ctx else "drop-draft"
    parts = f"target {fmt_bytes(cache[n][0].ram)}"
    if load_draft and cache[n][1] is not None:
        parts += f", draft {fmt_bytes(cache[n][1].ram)}"
    if prefix:
        parts += f", prefix cache {fmt_bytes(prefix)}"
    msg = f"loading {_what(load_draft, n, has_draft)} ({parts}): {_numbers(c, headroom, cfg)}"
    if decision != "load":
        first = tried[0]
        msg += f"; {_what(first[0], first[1], has_draft)} would need {fmt_bytes(first[2].ram_need)} RAM"
        if first[2].vram_need:
            msg += f" and {fmt_bytes(first[2].vram_need)} VRAM"
        msg += f" (memory.policy: {cfg.policy})"
    log.log(logging.INFO if decision == "load" else logging.WARNING, "%s", msg)
    return LoadPlan(decision, load_draft, n, c.ram_need, headroom.ram_available, c.vram_need, headroom.vram_free, msg)
