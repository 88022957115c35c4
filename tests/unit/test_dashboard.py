"""The dashboard against a real HTTP server: a scripted fake daemon (FastAPI under uvicorn in a
thread) that serves the StatsView we give it, honours the mode/reset endpoints and the API key,
and can be stopped and started on the same port. The app is driven with Textual's pilot.

Snapshots: tests/snapshots/dashboard.txt is the screen's text at 100×30 with fixed data and a
fixed time zone; tests/snapshots/dashboard.svg is the same screen for review. Both are rewritten
only with UPDATE_SNAPSHOTS=1.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timezone
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from rich.console import Console

from homespec.cli import dashboard as cli
from homespec.dashboard.app import DashboardApp, next_mode
from homespec.dashboard.client import DaemonClient, ProtocolError, Unauthorized, Unreachable
from homespec.dashboard.widgets import (
    Banner,
    HeaderBar,
    HelpScreen,
    Link,
    MemoryBox,
    QueueLine,
    RequestTable,
    SpeculationBox,
    SpeedFigures,
    SpeedupDigits,
    speedup_class,
)
from homespec.errors import UserError
from homespec.serving.stats_schema import RequestRecord, SpeedPoint, StatsView

SNAPSHOTS = Path(__file__).resolve().parent.parent / "snapshots"
SIZE = (100, 30)  # the terminal the "done when" names
T0 = 1_700_000_000.0  # a fixed clock for every timestamp in the scripted stats
POLL_S = 0.1  # fast polls keep the tests short; the app's logic does not depend on the period


# -- the fake daemon -----------------------------------------------------------------------------


def scripted_stats() -> StatsView:
    """A busy daemon on a 2-core CPU: draft k=4 pays 1.42×, ngram is listed but worse."""
    history = [
        SpeedPoint(t=T0 + i, tok_s=(None if i < 6 else 18.0 + (i % 7) * 1.5), baseline_tok_s=17.1)
        for i in range(60)
    ]
    requests = [
        RequestRecord(id=f"r{i}", time=T0 + 3600 - 30 * i, completion_tokens=200 + 10 * i,
                      tok_s=tok_s, speedup=speedup, status=status, prompt_tokens=120)
        for i, (tok_s, speedup, status) in enumerate(
            [(24.3, 1.42, "ok"), (17.0, 0.99, "ok"), (12.1, 0.71, "cancelled"), (None, None, "error")]
        )
    ]
    return StatsView.model_validate(
        {
            "version": "0.1.0",
            "uptime_s": 7384.0,
            "state": "ready",
            "address": "127.0.0.1:8321",
            "load_s": 4.2,
            "models": {
                "target": {"name": "qwen2.5-coder-1.5b-instruct-q4_k_m", "path": "/m/t.gguf", "size_mib": 1065.6},
                "draft": {"name": "qwen2.5-coder-0.5b-instruct-q4_k_m", "path": "/m/d.gguf", "size_mib": 468.6},
                "proposers": ["draft", "ngram"],
            },
            "device": {"kind": "cpu", "threads": 2},
            "speed": {"tok_s": 24.3, "baseline_tok_s": 17.1, "speedup": 1.42, "tokens_generated": 12345,
                      "requests_served": 42, "history": [p.model_dump() for p in history]},
            "speculation": {
                "mode": "auto", "modes": ["auto", "draft", "ngram", "off"], "proposer": "draft", "k": 4,
                "reason": "draft k=4: 24.1 tok/s expected vs plain 17.1",
                "gains": {"draft": [1.12, 1.28, 1.37, 1.41, 1.38, 1.30, 1.21, 1.10],
                          "ngram": [1.02, 0.97, 0.91, 0.84, 0.78, 0.71, 0.66, 0.60]},
                "acceptance_rate": 0.82, "acceptance_length": 3.1, "per_position": [0.95, 0.88, 0.79, 0.70],
                "draft_ms_per_step": 71.0, "verify_ms_per_step": 148.0, "draft_share": 0.32,
                "chosen": {"draft:4": 120, "ngram:2": 30, "off:0": 5},
                "answer_memory": {"answers": 12, "tokens": 3456, "capacity": 32768},
            },
            "memory": {
                "ram_total_mib": 7936.0, "ram_available_mib": 2662.4, "reserve_mib": 1024.0,
                "process_rss_mib": 1945.6, "models_mib": {"target": 1228.8, "draft": 563.2},
                "policy": "drop-draft",
                "events": ["plan: target + draft fit, 2.6 GiB headroom",
                           "draft unloaded at 18:04: headroom 0.6 GiB < 1.0 GiB reserve",
                           "draft loaded at 18:10: headroom 2.1 GiB"],
            },
            "queue": {"running": 1, "waiting": 2, "max_waiting": 8, "parallel": 4, "batch_rows": 3.5,
                      "requests": [{"id": "r9", "slot": 2, "priority": 5, "mode": "auto", "prompt_tokens": 40,
                                    "completion_tokens": 17, "age_s": 3.2, "tok_s": 6.5}]},
            "requests": [r.model_dump() for r in requests],
            "prefix_cache": {"lookups": 10, "hits": 7, "hit_ratio": 0.7},
        }
    )


def idle_stats() -> StatsView:
    """The same daemon just after start: warm, nothing served yet."""
    s = scripted_stats()
    return s.model_copy(
        update={
            "speed": s.speed.model_copy(update={"tok_s": None, "speedup": None, "tokens_generated": 0,
                                                "requests_served": 0, "history": []}),
            "requests": [],
            "queue": s.queue.model_copy(update={"running": 0, "requests": []}),
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeDaemon:
    """Serves `self.stats` as /v1/homespec/stats and records the admin calls it receives."""

    def __init__(self, stats: StatsView, api_key: str | None = None):
        self.stats = stats
        self.api_key = api_key
        self.mode_posts: list[str] = []
        self.resets = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def asgi(self) -> FastAPI:
        api = FastAPI()

        @api.middleware("http")
        async def auth(request: Request, call_next):
            if self.api_key and request.url.path.startswith("/v1"):
                if request.headers.get("authorization") != f"Bearer {self.api_key}":
                    body = {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                      "code": "invalid_api_key"}}
                    return JSONResponse(body, status_code=401)
            return await call_next(request)

        @api.get("/v1/homespec/stats")
        async def stats() -> dict:
            return self.stats.model_dump(mode="json")

        @api.post("/v1/homespec/mode")
        async def mode(request: Request) -> JSONResponse:
            wanted = (await request.json()).get("mode")
            if wanted not in self.stats.speculation.modes:
                return JSONResponse({"error": {"message": f"unknown mode {wanted!r}"}}, status_code=400)
            self.mode_posts.append(wanted)
            spec = self.stats.speculation.model_copy(update={"mode": wanted})
            self.stats = self.stats.model_copy(update={"speculation": spec})
            return JSONResponse({"mode": wanted})

        @api.post("/v1/homespec/reset")
        async def reset() -> dict:
            self.resets += 1
            return {"status": "ok"}

        return api

    def start(self) -> None:
        config = uvicorn.Config(self.asgi(), host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake daemon did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def get(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(self.url + path, headers=headers, timeout=2)


@pytest.fixture
def daemon():
    d = FakeDaemon(scripted_stats())
    d.start()
    yield d
    if d._thread is not None and d._thread.is_alive():
        d.stop()


def dashboard(url: str, api_key: str | None = None) -> DashboardApp:
    return DashboardApp(url, api_key, poll_s=POLL_S, tz=timezone.utc)


async def until(pilot, condition, what: str, timeout_s: float = 30.0, detail: Callable[[], object] | None = None) -> None:
    """Let the app run until `condition()` holds; fail with `what` (and `detail()`, if given)
    otherwise. A guard against a hang, not a timing check: alone the panels fill in ~1 s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}" + (f" ({detail()})" if detail else ""))
        await pilot.pause(0.05)


def screen_text(app: DashboardApp) -> str:
    """The screen as plain text: the compositor's full frame (what export_screenshot draws)
    printed without colour."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True,
                      color_system=None, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def panel_text(app: DashboardApp) -> str:
    """What every panel renders now, as plain text, without the compositor: the header, speed
    figures, speculation, memory and queue lines, and the request table's cells."""
    widgets = (HeaderBar, SpeedFigures, SpeculationBox, MemoryBox, QueueLine)
    parts = [str(app.query_one(w).render()) for w in widgets]
    table = app.query_one(RequestTable)
    parts += [" ".join(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]
    return "\n".join(parts)


def banner(app: DashboardApp) -> str:
    b = app.query_one(Banner)
    return str(b.render()) if b.display else ""


# -- pure helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "speedup, band",
    [(1.42, "good"), (1.051, "good"), (1.05, "even"), (1.0, "even"), (0.95, "even"), (0.949, "bad"),
     (0.5, "bad"), (None, "none")],
)
def test_speedup_band_is_green_above_1_05_amber_near_1_red_below_0_95(speedup, band):
    assert speedup_class(speedup) == band


@pytest.mark.parametrize(
    "modes, current, expected",
    [(["auto", "draft", "off"], "auto", "draft"), (["auto", "draft", "off"], "off", "auto"),
     (["auto", "off"], "ngram", "auto")],
)
def test_next_mode_follows_the_daemon_order_and_wraps(modes, current, expected):
    assert next_mode(modes, current) == expected


def test_api_key_comes_from_the_flag_then_the_environment():
    assert cli.resolve_api_key("flag", {"HOMESPEC_API_KEY": "env"}) == "flag"
    assert cli.resolve_api_key(None, {"HOMESPEC_API_KEY": "env"}) == "env"
    assert cli.resolve_api_key(None, {}) is None


@pytest.mark.parametrize("url", ["127.0.0.1:8321", "ftp://host", "http://"])
def test_cli_refuses_a_url_that_is_not_http_with_a_user_error(url):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with pytest.raises(UserError, match="not an http"):
        cli.main(p.parse_args(["--url", url]))


def test_cli_module_imports_neither_textual_nor_httpx():
    # `homespec --help` imports every subcommand's module; the dashboard's must stay light.
    code = "import sys, homespec.cli.dashboard; print(sorted(m for m in ('textual', 'httpx') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- client --------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_client_reads_stats_and_names_each_failure(daemon):
    ok = DaemonClient(daemon.url)
    assert (await ok.stats()).speed.speedup == 1.42
    await ok.aclose()

    not_homespec = DaemonClient(daemon.url + "/elsewhere")
    with pytest.raises(ProtocolError, match="is this a homespec daemon"):
        await not_homespec.stats()
    await not_homespec.aclose()

    daemon.api_key = "secret"
    keyless = DaemonClient(daemon.url)
    with pytest.raises(Unauthorized, match="needs an API key"):
        await keyless.stats()
    await keyless.aclose()

    daemon.stop()
    gone = DaemonClient(daemon.url, "secret")
    with pytest.raises(Unreachable, match="cannot reach"):
        await gone.stats()
    await gone.aclose()


# -- the app -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_panels_fill_in_after_a_request(daemon):
    daemon.stats = idle_stats()
    app = dashboard(daemon.url)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "connected", "first stats")
        assert "qwen2.5-coder-1.5b-instruct-q4_k_m" in str(app.query_one(HeaderBar).render())
        assert app.query_one(SpeedupDigits).value == "-.--x"
        assert app.query_one(RequestTable).row_count == 0

        daemon.stats = scripted_stats()  # a client streamed a few requests, and their answers are remembered
        await until(pilot, lambda: app.query_one(RequestTable).row_count == 5, "the request table")  # 1 running + 4
        figures = ("24.3 tok/s", "17.1 tok/s", "12,345 tokens · 42 served", "acceptance 82%", "length 3.10",
                   "remembered 12 answers · 3.5k of 32.8k tokens",
                   "best k=4 1.41×", "5.2 GiB of 7.8 GiB used", "headroom 2.6 GiB",
                   "draft unloaded at 18:04", "running 1/4 · waiting 2/8 · 3.5 rows/pass", "slot 2 p+5", "running",
                   "ready · warm", "up 2h 03m")
        # Each panel repaints on its own after a snapshot: wait for the last. What the panels
        # render is checked here; how the screen lays them out, by the snapshot test.
        def missing() -> list[str]:
            text = panel_text(app)  # once per check, not once per figure
            return [f for f in figures if f not in text]

        await until(pilot, lambda: not missing(), "every panel's figures", detail=missing)
        assert app.query_one(SpeedupDigits).value == "1.42x"


@pytest.mark.asyncio
@pytest.mark.parametrize("speedup, band", [(1.42, "good"), (1.0, "even"), (0.71, "bad")])
async def test_big_speedup_carries_its_colour_class(daemon, speedup, band):
    s = scripted_stats()
    daemon.stats = s.model_copy(update={"speed": s.speed.model_copy(update={"speedup": speedup})})
    app = dashboard(daemon.url)
    async with app.run_test(size=SIZE) as pilot:
        digits = app.query_one(SpeedupDigits)
        await until(pilot, lambda: digits.value == f"{speedup:.2f}x", "the speedup")
        assert digits.has_class(band)
        assert not any(digits.has_class(other) for other in {"good", "even", "bad", "none"} - {band})


@pytest.mark.asyncio
async def test_m_sets_the_next_mode_on_the_daemon(daemon):
    app = dashboard(daemon.url)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "connected", "first stats")
        await pilot.press("m")
        await until(pilot, lambda: daemon.mode_posts == ["draft"], "POST mode draft")
        assert daemon.get("/v1/homespec/stats").json()["speculation"]["mode"] == "draft"
        await pilot.press("m")
        await until(pilot, lambda: daemon.mode_posts == ["draft", "ngram"], "POST mode ngram")
        assert daemon.get("/v1/homespec/stats").json()["speculation"]["mode"] == "ngram"


@pytest.mark.asyncio
async def test_admin_keys_send_the_api_key(daemon):
    daemon.api_key = "secret"
    app = dashboard(daemon.url, api_key="secret")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "connected", "first stats")
        await pilot.press("r")
        await until(pilot, lambda: daemon.resets == 1, "POST reset")
        await pilot.press("m")
        await until(pilot, lambda: daemon.mode_posts == ["draft"], "POST mode draft")


@pytest.mark.asyncio
async def test_wrong_api_key_says_so_and_shows_no_figures(daemon):
    daemon.api_key = "secret"
    app = dashboard(daemon.url, api_key="wrong")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "unauthorized", "the 401")
        assert "API key" in banner(app) and "rejected" in banner(app)
        assert "Incorrect API key provided" in banner(app)  # the daemon's own words
        assert app.stats is None


@pytest.mark.asyncio
async def test_disconnected_state_appears_when_the_daemon_stops_and_clears_when_it_returns(daemon):
    app = dashboard(daemon.url)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "connected", "first stats")
        assert banner(app) == ""

        daemon.stop()
        await until(pilot, lambda: "disconnected, retrying" in banner(app), "the disconnected banner")
        assert app.query_one("#body").has_class("stale")
        assert "qwen2.5-coder-1.5b" in screen_text(app)  # the last figures stay on screen

        daemon.start()  # same port, like a restarted daemon
        await until(pilot, lambda: app.link.state == "connected", "reconnection")
        assert banner(app) == ""
        assert not app.query_one("#body").has_class("stale")


@pytest.mark.asyncio
async def test_a_poll_that_ends_after_the_panels_are_gone_does_not_crash_the_app():
    # As when the app shuts down while a poll is in flight (seen once in CI-like runs).
    app = dashboard(f"http://127.0.0.1:{free_port()}")
    async with app.run_test(size=SIZE) as pilot:
        await app.query_one("#body").remove()
        app.link = Link("disconnected", "cannot reach the daemon", app.link.failures + 1)
        await pilot.pause()
        assert app.is_running


@pytest.mark.asyncio
async def test_daemon_not_running_at_start_shows_retrying_not_a_crash():
    app = dashboard(f"http://127.0.0.1:{free_port()}")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.failures >= 2, "two failed polls")
        assert "disconnected, retrying" in banner(app)
        # The frame is composed on the next refresh, a moment after the widget changed.
        await until(pilot, lambda: "disconnected, retrying" in screen_text(app), "the banner on screen")
        await pilot.press("m")  # no daemon: a notice, no request, no exception
        assert app.is_running


@pytest.mark.asyncio
async def test_question_mark_opens_help_and_escape_closes_it(daemon):
    app = dashboard(daemon.url)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
        assert "acceptance length" in screen_text(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen), "help closed")


@pytest.mark.asyncio
async def test_q_quits(daemon):
    app = dashboard(daemon.url)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None, "exit")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_layout_matches_the_committed_snapshot(daemon):
    app = dashboard(daemon.url)
    expected = (SNAPSHOTS / "dashboard.txt")
    update = os.environ.get("UPDATE_SNAPSHOTS") == "1"
    assert update or expected.exists(), "no snapshot yet: run with UPDATE_SNAPSHOTS=1 and review tests/snapshots/"
    async with app.run_test(size=SIZE) as pilot:
        # The fake daemon's port changes per run; the header's separators are fixed, so masking
        # the port leaves every other character where it was.
        def frame() -> str:
            return screen_text(app).replace(daemon.url, "http://127.0.0.1:PORT")

        await until(pilot, lambda: app.query_one(RequestTable).row_count == 5, "all panels")
        await pilot.pause(0.2)  # one more poll and repaint, so every widget shows the same stats
        if update:
            SNAPSHOTS.mkdir(exist_ok=True)
            expected.write_text(frame(), encoding="utf-8")
            app.save_screenshot("dashboard.svg", str(SNAPSHOTS))
        want = expected.read_text(encoding="utf-8")
        # Each widget repaints on its own: on a loaded machine the footer has been seen to come
        # after the panels. Wait a few seconds for the frame; a changed layout never matches.
        deadline = time.monotonic() + 5.0
        while (text := frame()) != want and time.monotonic() < deadline:
            await pilot.pause(0.1)
    assert text == want, "layout changed: rerun with UPDATE_SNAPSHOTS=1 and review the SVG"
