"""The dashboard app: polls the daemon once a second and shows whether speculation pays off now.

State lives in two reactives at the top — `stats` (the last StatsView the daemon sent) and `link`
(the connection) — and flows down to the widgets by data binding. The poll is an async worker
on Textual's own event loop (httpx.AsyncClient), so a slow or dead daemon never blocks the UI;
a poll that is still waiting makes the next tick skip rather than pile up requests.
"""

from __future__ import annotations

from datetime import tzinfo

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer

from homespec.dashboard.client import DEFAULT_URL, DaemonClient, DaemonError, ProtocolError, Unauthorized, Unreachable
from homespec.dashboard.widgets import (
    Banner,
    HeaderBar,
    HelpScreen,
    Link,
    LinkState,
    MemoryBox,
    QueueLine,
    RequestTable,
    SpeculationBox,
    SpeedFigures,
    SpeedPlot,
    SpeedupDigits,
)
from homespec.serving.stats_schema import StatsView

POLL_S = 1.0  # the issue asks for every panel to update at least once a second

PANEL_TITLES = {"speed": "Speed", "speculation": "Speculation", "memory": "Memory", "requests": "Requests"}


def next_mode(modes: list[str], current: str) -> str:
    """The mode after `current` in the daemon's cycle order (wrapping); the first if `current`
    is not one of them."""
    if current not in modes:
        return modes[0]
    return modes[(modes.index(current) + 1) % len(modes)]


class DashboardApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "homespec dashboard"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("m", "cycle_mode", "mode"),
        Binding("r", "reset", "reset stats"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    stats: reactive[StatsView | None] = reactive(None)
    link: reactive[Link] = reactive(Link())

    def __init__(
        self,
        url: str = DEFAULT_URL,
        api_key: str | None = None,
        poll_s: float = POLL_S,
        tz: tzinfo | None = None,
    ) -> None:
        """`tz`: the zone of the request times (None: local); tests fix it for a stable snapshot."""
        super().__init__()
        self.client = DaemonClient(url, api_key)
        self.poll_s = poll_s
        self.tz = tz
        self._polling = False

    def compose(self) -> ComposeResult:
        stats, link = DashboardApp.stats, DashboardApp.link
        yield HeaderBar(self.client.url, id="header").data_bind(stats, link)
        yield Banner(id="banner").data_bind(link)
        with Grid(id="body"):
            with Vertical(id="speed", classes="panel"):
                with Horizontal(id="speed-top"):
                    yield SpeedupDigits(id="speedup").data_bind(stats)
                    yield SpeedFigures(id="speed-figures").data_bind(stats)
                yield SpeedPlot(id="speed-plot").data_bind(stats)
            yield SpeculationBox(id="speculation", classes="panel").data_bind(stats)
            yield MemoryBox(id="memory", classes="panel").data_bind(stats)
            with Vertical(id="requests", classes="panel"):
                yield QueueLine(id="queue").data_bind(stats)
                yield RequestTable(tz=self.tz, id="request-table").data_bind(stats)
        yield Footer()

    def on_mount(self) -> None:
        for panel_id, title in PANEL_TITLES.items():
            self.query_one(f"#{panel_id}").border_title = title
        self.poll()
        self.set_interval(self.poll_s, self.poll)

    async def on_unmount(self) -> None:
        await self.client.aclose()

    def watch_link(self, link: Link) -> None:
        # Keep the last figures on screen while disconnected, dimmed, so they read as old.
        # query, not query_one: a poll that ends while the app shuts down finds no body left.
        self.query("#body").set_class(link.state != "connected", "stale")

    # -- polling ---------------------------------------------------------------------------------

    def poll(self) -> None:
        if not self._polling:
            self._polling = True
            self._fetch_stats()

    @work(group="poll")
    async def _fetch_stats(self) -> None:
        try:
            stats = await self.client.stats()
        except Unauthorized as e:
            self._lost("unauthorized", e)
        except Unreachable as e:
            self._lost("disconnected", e)
        except ProtocolError as e:
            self._lost("error", e)
        else:
            self.stats = stats
            self.link = Link("connected")
        finally:
            self._polling = False

    def _lost(self, state: LinkState, e: DaemonError) -> None:
        self.link = Link(state, str(e), self.link.failures + 1)

    # -- keys ------------------------------------------------------------------------------------

    def action_cycle_mode(self) -> None:
        s = self.stats
        if s is None or self.link.state != "connected":
            self.notify("not connected to the daemon", severity="warning")
        elif not s.speculation.modes:
            self.notify("the daemon offers no speculation modes to switch between", severity="warning")
        else:
            self._set_mode(next_mode(s.speculation.modes, s.speculation.mode))

    @work(group="admin")
    async def _set_mode(self, mode: str) -> None:
        try:
            now = await self.client.set_mode(mode)
        except DaemonError as e:
            self.notify(str(e), title="mode not changed", severity="error")
            return
        s = self.stats
        if s is not None:  # show it now rather than at the next poll
            self.stats = s.model_copy(update={"speculation": s.speculation.model_copy(update={"mode": now})})
        self.notify(f"speculation mode: {now}")

    def action_reset(self) -> None:
        if self.link.state != "connected":
            self.notify("not connected to the daemon", severity="warning")
        else:
            self._reset()

    @work(group="admin")
    async def _reset(self) -> None:
        try:
            await self.client.reset()
        except DaemonError as e:
            self.notify(str(e), title="stats not reset", severity="error")
            return
        self.notify("rolling stats reset")
        self.poll()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
