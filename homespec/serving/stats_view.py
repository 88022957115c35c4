"""Daemon state -> the StatsView JSON that GET /v1/homespec/stats serves."""

from __future__ import annotations

import psutil

from homespec.serving.daemon import Daemon
from homespec.serving.stats_schema import (
    AnswerMemoryView,
    DeviceView,
    MemoryView,
    ModelInfo,
    ModelsView,
    PrefixCacheView,
    QueueView,
    SpeculationView,
    SpeedView,
    StatsView,
)
from homespec.speculation.proposers.ngram_memory import NgramMemory

MiB = 2**20


def build_stats_view(d: Daemon, address: str = "") -> StatsView:
    snap = d.live.snapshot()
    running, waiting = d.queue_view()
    session = d.session
    view = session.controller.view if session else None
    return StatsView(
        version=d.version(),
        uptime_s=round(d.uptime(), 1),
        state=d.state,
        address=address,
        load_s=d.load_s,
        warmup_s=d.warmup_s,
        cold_loads=d.cold_loads,
        models=_models(d),
        device=_device(d),
        speed=SpeedView(
            tok_s=snap.tok_s,
            baseline_tok_s=view.baseline_tps if view else None,
            speedup=(snap.tok_s / view.baseline_tps) if (view and view.baseline_tps and snap.tok_s) else None,
            tokens_generated=snap.tokens_generated,
            requests_served=snap.requests_served,
            history=snap.history,
        ),
        speculation=SpeculationView(
            mode=d.mode,
            modes=d.available_modes(),
            proposer=view.proposer if view else "off",
            k=view.k if view else 0,
            reason=view.reason if view else "",
            gains=view.gains if view else {},
            acceptance_rate=snap.acceptance_rate,
            acceptance_length=snap.acceptance_length,
            per_position=snap.per_position,
            draft_ms_per_step=snap.draft_ms,
            verify_ms_per_step=snap.verify_ms,
            draft_share=snap.draft_share,
            chosen=snap.chosen,
            probes=view.probes if view else 0,
            answer_memory=_answer_memory(session.ngram_memory) if session else None,
        ),
        memory=_memory(d),
        queue=QueueView(running=running, waiting=waiting, max_waiting=d.cfg.server.queue_depth,
                        parallel=d.parallel(), requests=d.running_view(), batch_rows=d.mean_batch_rows),
        requests=snap.requests,
        prefix_cache=PrefixCacheView(
            lookups=snap.cache_lookups,
            hits=snap.cache_hits,
            hit_ratio=snap.cache_hits / snap.cache_lookups if snap.cache_lookups else None,
            tokens_reused=snap.tokens_reused,
            tokens_evaluated=snap.tokens_evaluated,
            **_saved_states(d),
        ),
    )


def _answer_memory(memory: NgramMemory | None) -> AnswerMemoryView | None:
    if memory is None:
        return None
    return AnswerMemoryView(answers=memory.answers, tokens=len(memory), capacity=memory.capacity)


def _models(d: Daemon) -> ModelsView:
    s = d.session
    if s is None:
        return ModelsView()
    m = s.models
    target = ModelInfo(
        name=m.target_name, path=str(m.target_path), n_gpu_layers=d.cfg.models.target.n_gpu_layers,
        size_mib=round(m.target_path.stat().st_size / MiB, 1),
    )
    draft = None
    if m.draft_path is not None:
        draft = ModelInfo(
            name=m.draft_name or "", path=str(m.draft_path),
            n_gpu_layers=d.cfg.models.draft.n_gpu_layers if d.cfg.models.draft else 0,
            size_mib=round(m.draft_path.stat().st_size / MiB, 1), loaded=m.draft is not None,
        )
    mtp = None
    if m.mtp_path is not None:
        mtp = ModelInfo(name=m.mtp_path.name.removesuffix(".safetensors"), path=str(m.mtp_path),
                        size_mib=round(m.mtp_path.stat().st_size / MiB, 1), loaded=m.mtp_head is not None)
    return ModelsView(target=target, draft=draft, mtp=mtp, proposers=s.proposers)


def _device(d: Daemon) -> DeviceView:
    layers = d.cfg.models.target.n_gpu_layers
    threads = d.session.models.target.n_threads if d.session else 0
    h = d.watcher.last if d.watcher else None
    return DeviceView(kind="gpu" if layers else "cpu", threads=threads, gpu_layers=layers, gpu_name=getattr(h, "gpu_name", None))


def _memory(d: Daemon) -> MemoryView:
    vm = psutil.virtual_memory()
    target_fp, draft_fp = d.footprints
    models = {}
    if target_fp is not None:
        models["target"] = round(target_fp.ram / MiB, 1)
    if draft_fp is not None and d.session is not None and d.session.models.draft is not None:
        models["draft"] = round(draft_fp.ram / MiB, 1)
    h = d.watcher.last if d.watcher else None
    events = [e.message for e in d.watcher.events] if d.watcher else []
    if d.plan is not None:
        events.insert(0, d.plan.message)
    return MemoryView(
        ram_total_mib=round(vm.total / MiB, 1),
        ram_available_mib=round(vm.available / MiB, 1),
        reserve_mib=d.cfg.memory.reserve_mib,
        process_rss_mib=round(psutil.Process().memory_info().rss / MiB, 1),
        models_mib=models,
        vram_total_mib=(h.vram_total / MiB) if h is not None and h.vram_total else None,
        vram_free_mib=(h.vram_free / MiB) if h is not None and h.vram_free is not None else None,
        policy=d.cfg.memory.policy,
        events=events[-10:],
    )


def _saved_states(d: Daemon) -> dict:
    cache = getattr(d.session, "prefix_cache", None) if d.session else None
    if cache is None:
        return {}
    return {"saved_states": len(cache), "saved_mib": round(cache.bytes / MiB, 1)}
