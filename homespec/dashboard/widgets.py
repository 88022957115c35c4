"""The dashboard's widgets. Each one reads the bound `stats` (a StatsView, or None before the first
answer) and renders itself; none of them talks to the daemon.

Text is built with rich.Text, never with markup strings, so a model name or a daemon message that
contains brackets cannot break the rendering.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any, Literal

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import DataTable, Digits, Static

from homespec.serving.stats_schema import SpeculationView, StatsView

# Speedup bands. Within ±5 % of plain decoding the difference is run-to-run noise on a busy home
# server, so it is "even" (amber), not a win or a loss.
GOOD_ABOVE = 1.05
BAD_BELOW = 0.95
STYLE = {"good": "green", "even": "yellow", "bad": "red", "none": "dim"}
EIGHTHS = " ▁▂▃▄▅▆▇█"  # index = filled eighths of one cell

LinkState = Literal["connecting", "connected", "disconnected", "unauthorized", "error"]


@dataclass(frozen=True)
class Link:
    """The dashboard's view of its connection to the daemon."""

    state: LinkState = "connecting"
    detail: str = ""  # one line from the client's error
    failures: int = 0  # consecutive failed polls


# -- formatting (pure) ---------------------------------------------------------------------------


def speedup_class(x: float | None) -> str:
    """CSS class / colour band of a speedup: good (> 1.05), even (0.95..1.05), bad (< 0.95), none."""
    if x is None:
        return "none"
    if x > GOOD_ABOVE:
        return "good"
    if x < BAD_BELOW:
        return "bad"
    return "even"


def num(x: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{unit}"


def gib(mib: float | None) -> str:
    return "–" if mib is None else f"{mib / 1024:.1f} GiB"


def duration(s: float) -> str:
    s = int(s)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    if d:
        return f"{d}d {h:02d}h"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {s % 60:02d}s" if m else f"{s}s"


def blocks(values: list[float], top: float, bottom: float = 0.0) -> str:
    """One row of bars on a fixed scale bottom..top (a sparkline that does not rescale to its data).
    The lowest bar is one eighth, not blank, so that every value has a visible cell."""
    span = (top - bottom) or 1.0
    return "".join(EIGHTHS[max(1, min(8, round((v - bottom) / span * 8)))] for v in values)


def meter(frac: float, width: int) -> str:
    """A horizontal fill bar, e.g. ████░░░░ for 0.5 of 8 cells."""
    filled = max(0, min(width, round(frac * width)))
    return "█" * filled + "░" * (width - filled)


def _row(*parts: tuple[str, str] | str) -> Text:
    return Text.assemble(*parts)


def _lines(lines: list[Text]) -> Text:
    # Lines are cut at the widget's edge, never wrapped (text-wrap: nowrap in app.tcss): a wrapped
    # line would push a panel's last lines out of sight.
    return Text("\n").join(lines)


# -- header and connection banner ----------------------------------------------------------------

STATE_LABEL = {  # daemon state -> (words, style)
    "ready": ("ready · warm", "green"),
    "warming": ("warming up", "yellow"),
    "loading": ("loading models", "yellow"),
    "unloaded": ("cold · models unloaded", "yellow"),
    "failed": ("failed", "red"),
    "stopping": ("stopping", "yellow"),
}
LINK_LABEL = {
    "connecting": ("… connecting", "yellow"),
    "connected": ("● connected", "green"),
    "disconnected": ("✕ disconnected", "red"),
    "unauthorized": ("✕ unauthorized", "red"),
    "error": ("✕ error", "red"),
}


class HeaderBar(Widget):
    """Two lines: where and what (address, link, state, uptime) and which models on which device."""

    stats: reactive[StatsView | None] = reactive(None)
    link: reactive[Link] = reactive(Link())

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url = url

    def render(self) -> Text:
        s, link = self.stats, self.link
        top = _row(("homespec", "bold"), f" {s.version}" if s else "", "  ", self.url, "  ", LINK_LABEL[link.state])
        if s is None:
            return _lines([top, Text("waiting for the daemon's first answer", style="dim")])
        words, style = STATE_LABEL[s.state]
        top.append_text(_row("  ", (words, style), f"  up {duration(s.uptime_s)}  "))
        dev = s.device
        if dev.kind == "gpu":
            top.append(f"GPU {dev.gpu_name or ''} · {dev.gpu_layers} layers · {dev.threads} threads")
        else:
            top.append(f"CPU · {dev.threads} threads")
        m = s.models
        models = _row("target ", (m.target.name if m.target else "–", "bold"))
        if m.draft:
            models.append_text(_row(" · draft ", (m.draft.name, "bold" if m.draft.loaded else "dim strike")))
        if m.mtp:
            models.append_text(_row(" · mtp ", (m.mtp.name, "bold")))
        if s.state == "unloaded" and s.load_s:
            models.append(f" · next request loads them (~{s.load_s:.0f} s)", "yellow")
        return _lines([top, models])


class Banner(Widget):
    """One red line while the daemon cannot be read; hidden while connected."""

    link: reactive[Link] = reactive(Link())

    def watch_link(self, link: Link) -> None:
        self.display = link.state != "connected"

    def render(self) -> Text:
        link = self.link
        if link.state == "unauthorized":
            return _row(("API key problem: ", "bold"), link.detail)
        if link.state == "connecting":
            return _row("connecting…")
        tries = f" · {link.failures} failed polls" if link.failures > 1 else ""
        words = "disconnected, retrying" if link.state == "disconnected" else "daemon error, retrying"
        return _row((words, "bold"), f" — {link.detail}{tries}")


# -- speed ---------------------------------------------------------------------------------------


class SpeedupDigits(Digits):
    """The live speedup, large; its CSS class (good / even / bad / none) sets the colour."""

    stats: reactive[StatsView | None] = reactive(None)

    def watch_stats(self, s: StatsView | None) -> None:
        x = s.speed.speedup if s else None
        # Digits draws "x" as a multiplication sign.
        self.update("-.--x" if x is None else f"{x:.2f}x")
        self.set_classes(speedup_class(x))


class SpeedFigures(Widget):
    stats: reactive[StatsView | None] = reactive(None)

    def render(self) -> Text:
        sp = self.stats.speed if self.stats else None
        x = sp.speedup if sp else None
        return _lines(
            [
                _row("speedup vs plain ", (num(x, ".2f", "×"), STYLE[speedup_class(x)])),
                _row("live  ", (num(sp and sp.tok_s, ".1f"), "bold"), " tok/s"),
                _row("plain ", num(sp and sp.baseline_tok_s, ".1f"), " tok/s"),
                _row(f"{sp.tokens_generated:,} tokens · {sp.requests_served:,} served" if sp else ""),
            ]
        )


class SpeedPlot(Widget):
    """Output tok/s per second (bars, coloured by speedup band) against the plain-decoding baseline
    (a blue line drawn across the bars), on one shared scale: unlike two sparklines, each scaled
    to its own range, it shows which of the two is higher."""

    stats: reactive[StatsView | None] = reactive(None)

    def render(self) -> Text:
        w, h = self.size.width, max(1, self.size.height - 1)  # last row: the legend
        pts = self.stats.speed.history[-w:] if self.stats else []
        top = 1.1 * max([v for p in pts for v in (p.tok_s, p.baseline_tok_s) if v] or [1.0])
        rows = [Text(" " * (w - len(pts))) for _ in range(h)]  # rows[0] is the top; newest at the right
        for p in pts:
            v, b = p.tok_s or 0.0, p.baseline_tok_s
            colour = STYLE[speedup_class(v / b if v and b else None)]
            base_row = min(h - 1, int(b / top * h)) if b else -1  # counted from the bottom
            for r in range(h):
                fill = max(0, min(8, round(v / top * h * 8) - r * 8))
                if r == base_row and fill in (0, 8):
                    rows[h - 1 - r].append("━" if fill else "─", f"blue on {colour}" if fill else "blue")
                else:
                    rows[h - 1 - r].append(EIGHTHS[fill], colour)
        legend = _row(("█ live", "green"), " ", ("─ plain", "blue"), f"  0–{top:.0f} tok/s · last {len(pts)} s")
        return _lines([*rows, legend])


# -- speculation ---------------------------------------------------------------------------------


class SpeculationBox(Widget):
    """What the controller does now and why: choice, acceptance, per-position acceptance, time
    split, and its expected gain (× plain) for every k of every proposer."""

    stats: reactive[StatsView | None] = reactive(None)

    def render(self) -> Text:
        if self.stats is None:
            return Text("–", style="dim")
        sp, w = self.stats.speculation, self.size.width
        now = "off (plain decoding)" if sp.k == 0 or sp.proposer == "off" else f"{sp.proposer} k={sp.k}"
        rate = sp.acceptance_rate
        lines = [
            _row("mode ", (sp.mode, "bold"), " → now ", (now, "bold")),
            _row((sp.reason or "no decision yet", "dim italic")),
            _row("acceptance ", (num(rate and 100 * rate, ".0f", "%"), "bold"),
                 " · length ", (num(sp.acceptance_length, ".2f"), "bold"), " tok/step"),
        ]
        pos = sp.per_position[: max(1, (w - 16) // 4)]
        figures = " ".join(f"{100 * p:.0f}" for p in pos) + " %" if pos else "–"
        lines.append(_row("per position ", (blocks(pos, 1.0), "cyan"), " ", figures))
        if sp.draft_share is not None:
            n = round(sp.draft_share * 10)
            lines.append(_row(f"draft {100 * sp.draft_share:.0f}% ", ("█" * n, "magenta"), ("░" * (10 - n), "dim"),
                              f" {num(sp.draft_ms_per_step, '.0f')} ms · verify {num(sp.verify_ms_per_step, '.0f')} ms"))
        else:
            lines.append(_row(("no drafting time measured yet", "dim")))
        lines.append(_row(("expected gain by k, × plain (inverse: now)", "dim")))
        lines.extend(self._gain_row(name, sp, w) for name in sp.gains)
        chosen = sorted(sp.chosen.items(), key=lambda kv: -kv[1])[:4]
        lines.append(_row(("steps ", "dim"), " · ".join(f"{key} ×{n}" for key, n in chosen) or "–"))
        lines.append(_row(("proposers ", "dim"), ", ".join(self.stats.models.proposers) or "none",
                          f" · probes {sp.probes}"))
        if (m := sp.answer_memory) is not None:  # prompt lookup's memory of earlier answers
            lines.append(_row(("remembered ", "dim"), f"{m.answers} answers · {m.tokens / 1000:.1f}k of "
                              f"{m.capacity / 1000:.1f}k tokens"))
        return _lines(lines)

    @staticmethod
    def _gain_row(name: str, sp: SpeculationView, width: int) -> Text:
        every = [g for gs in sp.gains.values() for g in gs]
        # From just under the lowest gain (or plain) up: the bars differ where the choice is made.
        top, bottom = max(every + [1.0]), 0.9 * min(every + [1.0])
        gains = sp.gains[name][: max(1, width - 24)]
        row = Text(f"{name:<6}")
        for k, g in enumerate(gains, start=1):
            style = STYLE[speedup_class(g)] + (" reverse" if name == sp.proposer and k == sp.k else "")
            row.append(blocks([g], top, bottom), style)
        if gains:
            best = max(range(len(gains)), key=gains.__getitem__)
            row.append(f" best k={best + 1} {gains[best]:.2f}×")
        return row


# -- memory --------------------------------------------------------------------------------------


class MemoryBox(Widget):
    """RAM (and VRAM) use, each model's share, headroom against the reserve, and what the memory
    policy did (the daemon's one-line events, the newest that fit, wrapped so none loses its end)."""

    stats: reactive[StatsView | None] = reactive(None)

    def render(self) -> Text:
        if self.stats is None:
            return Text("–", style="dim")
        m = self.stats.memory
        lines = []
        for label, total, free in (("RAM ", m.ram_total_mib, m.ram_available_mib), ("VRAM", m.vram_total_mib, m.vram_free_mib)):
            if total:
                used = total - (free or 0.0)
                lines.append(_row(f"{label} ", (meter(used / total, 14), "cyan"), f" {gib(used)} of {gib(total)} used"))
        low = m.ram_available_mib < m.reserve_mib
        lines.append(_row("headroom ", (gib(m.ram_available_mib), "red bold" if low else "green"),
                          (" < " if low else " ≥ ") + f"{gib(m.reserve_mib)} reserve"))
        share = " · ".join(f"{name} {gib(mib)}" for name, mib in m.models_mib.items()) or "none loaded"
        lines.append(_row("models ", share))
        lines.append(_row(f"daemon RSS {gib(m.process_rss_mib)} · policy ", (m.policy, "bold")))
        room = self.size.height - len(lines)
        shown: list[list[str]] = []
        for event in reversed(m.events):
            wrapped = textwrap.wrap(event, max(10, self.size.width - 2), subsequent_indent="  ")
            if sum(map(len, shown)) + len(wrapped) > room:
                break
            shown.insert(0, wrapped)
        lines.extend(Text(line, style="yellow") for event in shown for line in event)
        return _lines(lines)


# -- requests ------------------------------------------------------------------------------------


class QueueLine(Widget):
    stats: reactive[StatsView | None] = reactive(None)

    def render(self) -> Text:
        if self.stats is None:
            return Text("queue –", style="dim")
        q, pc = self.stats.queue, self.stats.prefix_cache
        busy = "yellow" if q.waiting else ""
        line = _row(f"running {q.running}/{q.parallel} · ", (f"waiting {q.waiting}", busy), f"/{q.max_waiting}")
        if q.batch_rows is not None and q.parallel > 1:
            line.append(f" · {q.batch_rows:.1f} rows/pass")
        if pc.hit_ratio is not None:
            line.append(f" · prefix hits {100 * pc.hit_ratio:.0f}%")
        return _lines([line])


STATUS_STYLE = {"ok": "green", "cancelled": "yellow", "timeout": "yellow", "error": "red"}


class RequestTable(DataTable):
    """The running set (slot and priority), then recent requests, newest first: arrival time,
    tokens, tok/s, speedup, status."""

    stats: reactive[StatsView | None] = reactive(None)

    def __init__(self, tz: tzinfo | None = None, **kwargs: Any) -> None:
        super().__init__(cursor_type="none", zebra_stripes=True, **kwargs)
        self.tz = tz  # None: the local zone; tests pass UTC so the text snapshot is stable

    def on_mount(self) -> None:
        self.add_column("time", key="time")
        self.add_column(Text("tokens", justify="right"), key="tokens")
        self.add_column(Text("tok/s", justify="right"), key="tok_s")
        self.add_column(Text("speedup", justify="right"), key="speedup")
        self.add_column("status", key="status")
        self.watch_stats(self.stats)  # stats bound before the columns existed do not fire again

    def watch_stats(self, s: StatsView | None) -> None:
        if not self.columns:
            return  # not mounted yet: on_mount fills in
        self.clear()
        for a in s.queue.requests if s else []:
            self.add_row(
                f"slot {a.slot}" + (f" p{a.priority:+d}" if a.priority else ""),
                Text(f"{a.completion_tokens:,}", justify="right"),
                Text(num(a.tok_s), justify="right"),
                Text("–", justify="right"),
                Text("running", style="cyan"),
            )
        for r in s.requests if s else []:
            when = datetime.fromtimestamp(r.time, self.tz).strftime("%H:%M:%S")
            self.add_row(
                when,
                Text(f"{r.completion_tokens:,}", justify="right"),
                Text(num(r.tok_s), justify="right"),
                Text(num(r.speedup, ".2f", "×"), justify="right", style=STYLE[speedup_class(r.speedup)]),
                Text(r.status + (" cold" if r.cold else ""), style=STATUS_STYLE[r.status]),
            )


# -- help ----------------------------------------------------------------------------------------

HELP = """\
[b]Keys[/b]
  m   switch the daemon to its next speculation mode (auto, ngram, draft, …, off:
      the order the daemon lists them in)
  r   reset the daemon's rolling statistics
  ?   this help          q   quit

[b]Words[/b]
  [b]speedup[/b]            output tok/s with speculation ÷ tok/s of plain decoding of the
                     same target; green above 1.05×, amber near 1, red below 0.95×
  [b]accepted[/b]           proposed tokens the target's verify pass keeps
  [b]bonus[/b]              the one token the target adds after the accepted ones
  [b]acceptance rate[/b]    accepted ÷ proposed
  [b]acceptance length[/b]  tokens emitted per step (≥ 1): accepted + bonus
  [b]per position[/b]       P(accepted | reached) at draft positions 1, 2, …
  [b]expected gain[/b]      the controller's estimate of tok/s ÷ plain for each k;
                     it picks the best, and k = 0 (plain) when none pays
  [b]headroom[/b]           available RAM; below the reserve the policy sheds the draft

Press escape or ? to close."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP)
