"""How the daemon's HTTP server meets a hostile or clumsy network: uvicorn's h11 protocol with a
deadline for reading a request and a cap on connections (a stalled client must not hold a file
descriptor forever), and a log filter that keeps a flood of identical lines to one per window.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from homespec.config import ServerConfig
from homespec.errors import UserError

# When to look for a reset after probing a peer that sent EOF (seconds after the probe): loopback
# answers within microseconds, a LAN within milliseconds, a busy Wi-Fi link later.
PEER_CHECK_S = (0.05, 0.5, 2.0)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus what it lacks (0.54 has no header-read timeout, and
    limit_concurrency answers 503 only once a request has fully arrived, so stalled half
    headers still pile up until file descriptors run out):

    - a request (headers and body) must arrive within header_timeout_s of the connection opening
      or of the previous response; otherwise the connection is closed;
    - a client that half-closes after its request still gets the answer, while one that hangs
      up is still cancelled (eof_received);
    - at max_connections, a new connection evicts one that is waiting for its request: first
      the oldest that never completed a request (a staller), then the oldest idle keep-alive
      one (a client that has been answered before); or it is closed itself when every
      connection is busy with a request. Measured in scripts/soak.py: evicting by age alone
      dropped pooled keep-alive connections of real clients mid-send under a flood.
    """

    header_timeout_s: float = 10.0
    max_connections: int = 512
    # This server's connections, oldest first (by opening or last answer): eviction walks from
    # the front and stops at the first staller, instead of scanning every connection for each
    # new one (a flood opens hundreds a second; uvicorn_config gives each server its own dict).
    _by_age: dict[GuardedH11Protocol, None] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._opened = time.monotonic()
        self._served = 0  # responses completed on this connection
        self._read_timer: asyncio.TimerHandle | None = None
        if len(self.connections) >= self.max_connections and not self._evict_one():
            transport.close()
            return
        super().connection_made(transport)
        self._by_age[self] = None
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if getattr(self, "_half_closed", False):  # the client said it sends nothing more
            self.transport.close()
            return
        self._served += 1
        self._opened = time.monotonic()
        self._by_age.pop(self, None)
        self._by_age[self] = None  # now the youngest
        self._arm()

    def eof_received(self) -> bool | None:
        """A client may half-close (shutdown(SHUT_WR)) once its request is sent and still read
        the answer (netcat, some scripts and proxies do). uvicorn closed the socket at that EOF,
        so the request was taken for a hang-up and cancelled. Keep it open for writing until the
        answer is sent (on_response_complete closes it); EOF anywhere else closes as before.

        At the TCP level a hang-up (close) and a half-close are the same EOF; only a write tells
        them apart: a closed peer answers it with a reset. A stream writes soon anyway; a
        request whose answer has not started gets an interim `100 Continue` (clients must skip
        an unexpected 1xx, RFC 9110 15.2; HTTP/1.0 ones may not, so theirs is taken for a
        hang-up), and the socket is checked for that reset shortly after."""
        cycle = getattr(self, "cycle", None)
        if self.conn.their_state is not h11.DONE or cycle is None or cycle.response_complete:
            return None
        if cycle.response_started:
            self._half_closed = True
            return True
        if self.conn.their_http_version != b"1.1":
            return None
        self._half_closed = True
        self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        cycle.waiting_for_100_continue = False  # sent: uvicorn must not send a second one
        for delay_s in PEER_CHECK_S:
            self.loop.call_later(delay_s, self._close_if_peer_reset)
        return True

    def _close_if_peer_reset(self) -> None:
        """The peer answered the interim response with a reset: it hung up, so close, and the
        request is cancelled as for any hang-up (connection_lost tells the app)."""
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._by_age.pop(self, None)
        if self._read_timer is not None:
            self._read_timer.cancel()
        if self.transport is not None:  # None: closed in connection_made, never registered
            super().connection_lost(exc)

    def _waiting(self) -> bool:
        """The client has not finished sending its request (and nothing is answering it)."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and self.conn.our_state is h11.IDLE

    def _arm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.header_timeout_s, self._read_timeout)

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self._waiting() and not self.transport.is_closing():
            self.transport.close()

    def _evict_one(self) -> bool:
        """Close the oldest staller, else the oldest idle keep-alive connection; False if every
        connection is busy with a request."""
        idle: GuardedH11Protocol | None = None
        for c in self._by_age:
            if c._waiting() and not c.transport.is_closing():
                if c._served == 0:
                    c.transport.close()
                    return True
                idle = idle or c
        if idle is not None:
            idle.transport.close()
            return True
        return False


def uvicorn_config(app: ASGIApp, server: ServerConfig, **kw: Any) -> uvicorn.Config:
    """The uvicorn settings `homespec serve` runs with (tests start their servers with it too)."""
    protocol = type("HomespecH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": server.header_timeout_s, "max_connections": server.max_connections, "_by_age": {}})
    kw.setdefault("timeout_graceful_shutdown", max(1, int(server.drain_timeout_s)))
    return uvicorn.Config(app, host=server.host, port=server.port, http=protocol, timeout_keep_alive=server.keep_alive_s,
                          access_log=False, **kw)


# File descriptors the daemon needs besides its client connections: model files, the state
# directory, logs, the event loop's own sockets and pipes, llama.cpp's threads.
FD_HEADROOM = 256


def ensure_open_files(max_connections: int) -> int:
    """Raise the soft open-file limit (up to the hard one) so that max_connections clients fit
    with FD_HEADROOM to spare: a shell's soft limit is often 1,024 while the hard one allows far
    more. Returns the soft limit now; UserError naming server.max_connections when even the hard
    limit is too low, rather than `accept() out of system resource` under load."""
    need = max_connections + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if cap > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
            soft = cap
    if soft != resource.RLIM_INFINITY and soft < need:
        raise UserError(f"server.max_connections is {max_connections}, but this process may open only {soft} files "
                        f"({FD_HEADROOM} are kept for the daemon itself): lower it or raise LimitNOFILE / ulimit -n")
    return soft


class RepeatFilter(logging.Filter):
    """Lets the first of a run of identical log lines through, then one per window_s with a count
    of those dropped: a flood (e.g. `socket.accept() out of system resource`, logged once per
    failed accept) must not bury everything else in the journal."""

    def __init__(self, window_s: float = 10.0) -> None:
        super().__init__()
        self.window_s = window_s
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0])
        now = time.monotonic()
        first, dropped = self._seen.get(key, (-self.window_s, 0))
        if now - first < self.window_s:
            self._seen[key] = (first, dropped + 1)
            return False
        if len(self._seen) > 1000:  # bounded: distinct messages are few; forget old ones
            self._seen.clear()
        self._seen[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} identical lines suppressed in the last {self.window_s:.0f} s)"
        return True


def install_repeat_filter(window_s: float = 10.0) -> RepeatFilter:
    """Attach one RepeatFilter to the loggers that can flood: asyncio's accept errors, uvicorn's."""
    f = RepeatFilter(window_s)
    for name in ("asyncio", "uvicorn", "uvicorn.error", "homespec"):
        logging.getLogger(name).addFilter(f)
    return f
