"""Watching memory while serving: shed the draft model below the reserve, take it back when
room returns (with hysteresis, so it does not flap). The decision is a pure function; the
watcher is a thin polling thread around it. Sizes in bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from homespec.models.memory import Footprint, Headroom, MiB, fmt_bytes, read_headroom

if TYPE_CHECKING:
    from homespec.config import MemoryConfig

log = logging.getLogger("homespec.models.memory")

# Hysteresis: reload the draft only when headroom exceeds reserve + draft + this margin, larger than
# the drift of available memory between two polls on a quiet server (page cache, small services).
RELOAD_MARGIN = 256 * MiB  # bytes
# Events kept for stats: a flapping bug cannot grow memory, and 100 events cover days of normal use.
MAX_EVENTS = 100


@dataclass(frozen=True)
class WatchAction:
    action: Literal["unload-draft", "reload-draft"]
    reason: str  # e.g. "RAM headroom 0.6 GiB < 1.0 GiB reserve"


EventKind = Literal["unload-draft", "reload-draft", "low-headroom", "callback-failed"]


@dataclass(frozen=True)
class WatchEvent:
    at: float  # seconds since the epoch (the watcher's clock)
    kind: EventKind
    message: str  # one line, e.g. "draft unloaded at 18:04:05: RAM headroom 0.6 GiB < 1.0 GiB reserve"


def decide(
    headroom: Headroom,
    draft_loaded: bool,
    draft: Footprint,
    cfg: MemoryConfig,
    *,
    margin: int = RELOAD_MARGIN,  # bytes
) -> WatchAction | None:
    """Pure: unload the draft when RAM (or VRAM) headroom is below its reserve; reload it when the
    headroom covers reserve + the draft's need + margin. The gap between the two thresholds
    (the draft's own size + margin) is the hysteresis: a reload never itself triggers an unload."""
    reserve, vram_reserve = cfg.reserve_mib * MiB, cfg.vram_reserve_mib * MiB
    vram_free = headroom.vram_free
    if draft_loaded:
        if headroom.ram_available < reserve:
            return WatchAction(
                "unload-draft", f"RAM headroom {fmt_bytes(headroom.ram_available)} < {fmt_bytes(reserve)} reserve"
            )
        if draft.vram and vram_free is not None and vram_free < vram_reserve:
            return WatchAction(
                "unload-draft", f"VRAM headroom {fmt_bytes(vram_free)} < {fmt_bytes(vram_reserve)} VRAM reserve"
            )
        return None
    ram_room = headroom.ram_available >= reserve + draft.ram + margin
    # An unreadable GPU cannot veto a reload; the load-time plan already accepted the draft.
    vram_room = not draft.vram or vram_free is None or vram_free >= vram_reserve + draft.vram + margin
    if ram_room and vram_room:
        reason = (
            f"RAM headroom {fmt_bytes(headroom.ram_available)} >= {fmt_bytes(reserve)} reserve"
            f" + {fmt_bytes(draft.ram)} draft"
        )
        if draft.vram and vram_free is not None:
            reason += f", VRAM {fmt_bytes(vram_free)} >= {fmt_bytes(vram_reserve)} + {fmt_bytes(draft.vram)}"
        return WatchAction("reload-draft", reason + f" + {fmt_bytes(margin)} margin")
    return None


class HeadroomWatcher:
    """Polls headroom every cfg.watch_interval_s on a daemon thread and sheds or restores the draft.

    on_unload_draft / on_reload_draft run on the watcher thread; the engine does the unloading
    (speculation falls back to ngram or off) and its metrics. A callback that raises leaves the
    state unchanged and is recorded as an event; the next poll tries again. `events` keeps the last
    MAX_EVENTS one-line events for /v1/homespec/stats.
    """

    def __init__(
        self,
        cfg: MemoryConfig,
        draft: Footprint,
        *,
        on_unload_draft: Callable[[], None],
        on_reload_draft: Callable[[], None],
        read: Callable[[], Headroom] = read_headroom,
        clock: Callable[[], float] = time.time,
        draft_loaded: bool = True,
        margin: int = RELOAD_MARGIN,  # bytes
    ) -> None:
        self.cfg = cfg
        self.draft = draft
        self._on_unload = on_unload_draft
        self._on_reload = on_reload_draft
        self._read = read
        self._clock = clock
        self._margin = margin
        self._draft_loaded = draft_loaded
        self._low = False  # inside a low-headroom episode with nothing left to unload
        self._events: deque[WatchEvent] = deque(maxlen=MAX_EVENTS)
        self.last: Headroom | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one check at a time (thread and direct callers)

    @property
    def draft_loaded(self) -> bool:
        return self._draft_loaded

    @property
    def events(self) -> list[WatchEvent]:
        return list(self._events)

    def _record(self, kind: EventKind, what: str, why: str, level: int, exc_info: bool = False) -> None:
        now = self._clock()
        msg = f"{what} at {time.strftime('%H:%M:%S', time.localtime(now))}: {why}"
        self._events.append(WatchEvent(now, kind, msg))
        log.log(level, "%s", msg, exc_info=exc_info)

    def check(self) -> WatchAction | None:
        """One poll: read headroom, decide, run the callback, record the event. Returns the action."""
        with self._lock:
            h = self._read()
            self.last = h
            act = decide(h, self._draft_loaded, self.draft, self.cfg, margin=self._margin)
            if act is None:
                self._note_low(h)
                return None
            loaded = act.action == "reload-draft"
            try:
                (self._on_reload if loaded else self._on_unload)()
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                self._record("callback-failed", f"{act.action} failed", why, logging.ERROR, exc_info=True)
                return None
            self._draft_loaded = loaded
            self._low = False
            if loaded:
                self._record(act.action, "draft loaded back", act.reason, logging.INFO)
            else:
                why = act.reason + "; speculation falls back to ngram/off"
                self._record(act.action, "draft unloaded", why, logging.WARNING)
            return act

    def _note_low(self, h: Headroom) -> None:
        # Below the reserve with the draft already gone: say so once per episode, not every poll.
        low = h.ram_available < self.cfg.reserve_mib * MiB
        if low and not self._low and not self._draft_loaded:
            self._record(
                "low-headroom",
                "headroom still low",
                f"RAM headroom {fmt_bytes(h.ram_available)} < {fmt_bytes(self.cfg.reserve_mib * MiB)} reserve "
                "with the draft already unloaded; nothing more to shed",
                logging.WARNING,
            )
        self._low = low

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.watch_interval_s):
            try:
                self.check()
            except Exception:  # a failed read must not end the watch
                log.exception("headroom check failed")

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="homespec-headroom", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:  # seconds
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
