"""The dashboard against the real daemon (real models, real uvicorn on loopback), driven by
Textual's pilot: panels fill in after a request, `m` changes the daemon's mode, and the
disconnected state comes and goes with the daemon's HTTP side."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from homespec.dashboard.app import DashboardApp
from homespec.dashboard.widgets import Banner, HeaderBar, RequestTable, SpeedupDigits
from homespec.serving.app import create_app
from tests.integration.server_fixtures import Served, ThreadServer

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
SIZE = (100, 30)


async def until(pilot, condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await pilot.pause(0.1)


def banner(app: DashboardApp) -> str:
    b = app.query_one(Banner)
    return str(b.render()) if b.display else ""


async def test_panels_fill_in_after_a_request_to_the_real_daemon(served: Served):
    app = DashboardApp(served.url, poll_s=0.25)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "connected", "first stats")
        assert served.model in str(app.query_one(HeaderBar).render())
        before = app.query_one(RequestTable).row_count
        body = {"model": served.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                "homespec": {"speculation": "ngram", "k": 2}}
        r = await asyncio.to_thread(httpx.post, f"{served.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200
        # The table lists running requests too: wait for a snapshot taken after this one ended.
        await until(pilot, lambda: app.query_one(RequestTable).row_count > before and not app.stats.queue.requests,
                    "the request in the table")
        assert app.stats is not None and app.stats.speed.requests_served >= 1
        assert app.stats.speed.baseline_tok_s and app.query_one(SpeedupDigits).value != "-.--x"


async def test_m_changes_the_real_daemons_mode(served: Served):
    app = DashboardApp(served.url, poll_s=0.25)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.link.state == "connected", "first stats")
            start = app.stats.speculation.mode
            modes = app.stats.speculation.modes
            await pilot.press("m")
            expected = modes[(modes.index(start) + 1) % len(modes)]
            await until(
                pilot,
                lambda: httpx.get(f"{served.url}/v1/homespec/stats", timeout=10).json()["speculation"]["mode"] == expected,
                f"the daemon's mode to become {expected}",
            )
    finally:
        httpx.post(f"{served.url}/v1/homespec/mode", json={"mode": "auto"}, timeout=10)


async def test_disconnected_state_appears_when_the_daemon_stops_and_clears_when_it_returns(served: Served):
    srv = ThreadServer(create_app(served.daemon)).start()
    port = srv.port
    app = DashboardApp(srv.url, poll_s=0.25)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state == "connected", "first stats")
        await asyncio.to_thread(srv.stop)
        await until(pilot, lambda: "disconnected, retrying" in banner(app), "the disconnected banner")
        again = await asyncio.to_thread(lambda: ThreadServer(create_app(served.daemon), port=port).start())
        try:
            await until(pilot, lambda: app.link.state == "connected", "reconnection")
            assert banner(app) == ""
        finally:
            await asyncio.to_thread(again.stop)
