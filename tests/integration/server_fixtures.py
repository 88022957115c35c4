"""A real daemon behind a real uvicorn on a loopback port, with the small real models.

One model load for the whole session: `served` builds a Daemon over the real target and draft
GGUFs and serves it twice on 127.0.0.1 — once open, once behind an API key (both apps share the
daemon, so the auth tests cost no second load). Sockets are bound before uvicorn starts (port 0),
so there is no race for a "free" port. Waits are polls with deadlines, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from homespec.config import (
    Config,
    ControllerConfig,
    DraftRef,
    MemoryConfig,
    ModelRef,
    ModelsConfig,
    RuntimeConfig,
    SamplingDefaults,
    ServerConfig,
    SpeculationConfig,
)
from homespec.serving.app import create_app
from homespec.serving.daemon import Daemon
from homespec.serving.http_server import uvicorn_config
from tests.conftest import DRAFT, ROOT, TARGET, require

API_KEY = "test-key-0123456789"
QUEUE_DEPTH = 2
MAX_BODY = 64 * 1024
N_CTX = 1024
# Loading + warming both models takes ~10 s alone; the machine is shared, so be generous.
READY_TIMEOUT_S = 600


def server_config(**server: object) -> Config:
    """Light settings for tests: 1k context, small queue and body limit, a short warm-up."""
    return Config(
        models=ModelsConfig(target=ModelRef(path=require(TARGET)), draft=DraftRef(path=require(DRAFT))),
        runtime=RuntimeConfig(n_ctx=N_CTX, n_batch=256),
        speculation=SpeculationConfig(k_max=8, controller=ControllerConfig(warmup_passes=1)),
        sampling=SamplingDefaults(max_tokens=64),
        # The memory policy is not under test here: never shed the draft because another
        # engineer's job happens to use RAM at the same time.
        # Nor kept across daemons: each test's daemon starts from what its own requests leave.
        memory=MemoryConfig(reserve_mib=0, prefix_cache_persist=False),
        server=ServerConfig(
            queue_depth=QUEUE_DEPTH, max_body_bytes=MAX_BODY, request_timeout_s=300, drain_timeout_s=20, **server
        ),
        base_dir=ROOT,
    )


def wait_for(check: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05) -> object:
    """Poll check() until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except Exception as e:  # keep polling; report the last error
            last_error = e
            result = None
        if result:
            return result
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last_error!r})")


class ThreadServer:
    """uvicorn.Server on a pre-bound loopback socket, run in a background thread."""

    def __init__(self, app: object, port: int = 0, server: ServerConfig | None = None) -> None:
        """port 0: any free port; a given port lets a test restart a server where it was.
        server: the [server] settings whose limits and timeouts uvicorn runs with (default: the defaults)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # Always the protocol and limits `homespec serve` runs with: a test on plain uvicorn
        # would miss what GuardedH11Protocol changes (a hang-up went unseen that way once).
        config = uvicorn_config(app, server or ServerConfig(), log_level="warning", timeout_graceful_shutdown=5)  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> ThreadServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 60, f"uvicorn on {self.url} to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@dataclass
class Served:
    url: str  # no API key
    auth_url: str  # same daemon, API_KEY required
    daemon: Daemon
    model: str  # the id /v1/models reports

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=httpx.Timeout(300, connect=10), **kw)


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    cfg = server_config()
    daemon = Daemon(cfg)
    open_srv = ThreadServer(create_app(daemon, address="127.0.0.1")).start()
    auth_srv = ThreadServer(create_app(daemon, api_key=API_KEY, address="127.0.0.1")).start()
    daemon.start()
    try:
        wait_for(
            lambda: httpx.get(f"{open_srv.url}/ready", timeout=5).status_code == 200 or daemon.state == "failed",
            READY_TIMEOUT_S,
            "the daemon to load and warm up",
            interval_s=0.25,
        )
        assert daemon.state == "ready", f"daemon failed to load: {daemon.error}"
        model = httpx.get(f"{open_srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Served(open_srv.url, auth_srv.url, daemon, model)
    finally:
        open_srv.stop()
        auth_srv.stop()
        daemon.shutdown(timeout_s=10)


def free_port() -> int:
    """A loopback port that was free a moment ago (for a subprocess that binds it itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
