"""HTTP hardening against a real uvicorn on loopback, run with the settings `homespec serve` uses
(`uvicorn_config`): stalled connections, Host / Origin / Content-Type checks, empty bodies and
Retry-After on 503.

The daemon behind these apps is never started (no model load): /health answers, /ready is 503
("loading"), and POST /v1/homespec/reset works, which is all the middleware tests need.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from homespec.config import ServerConfig
from homespec.dashboard.client import DaemonClient
from homespec.serving.app import create_app
from homespec.serving.daemon import Daemon
from tests.integration.server_fixtures import API_KEY, Served, ThreadServer, server_config

pytestmark = pytest.mark.integration

STALLED = 200
MAX_CONNECTIONS = 50
HEADER_TIMEOUT_S = 1.0
CLOSE_WAIT_S = 60  # bound on waiting for the server to close a stalled socket (a loaded machine)
HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def serve(**server: object) -> ThreadServer:
    cfg = server_config(**server)
    return ThreadServer(create_app(Daemon(cfg), api_key=server.get("api_key"), address="127.0.0.1"),  # type: ignore[arg-type]
                        server=cfg.server).start()


@pytest.fixture(scope="module")
def guarded() -> Iterator[ThreadServer]:
    srv = serve(header_timeout_s=HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS, allowed_hosts=["homeserver.lan"],
                cors_origins=["http://dash.example"])
    yield srv
    srv.stop()


def closed_by_server(sock: socket.socket) -> bool:
    """True once the peer closed (EOF or reset); the socket has a timeout, so this is bounded."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- item 1: stalled half headers ------------------------------------------------------------------


def test_stalled_half_headers_are_closed_and_health_still_answers(guarded: ThreadServer) -> None:
    socks: list[socket.socket] = []
    try:
        for _ in range(STALLED):
            s = socket.create_connection(("127.0.0.1", guarded.port), timeout=CLOSE_WAIT_S)
            s.sendall(HALF_HEADER)
            socks.append(s)
        # Far more stalled connections than max_connections: a new client is still served.
        r = httpx.get(f"{guarded.url}/health", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        # Every stalled socket is closed by the server: evicted at the cap or at header_timeout_s.
        still_open = [s for s in socks if not closed_by_server(s)]
        assert not still_open, f"{len(still_open)} of {STALLED} stalled sockets were never closed"
        r = httpx.get(f"{guarded.url}/health", timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (head and Content-Length body): a recv may return less, and
    the rest would be read as the start of the next response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "connection closed mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_at_the_cap_stallers_are_evicted_before_a_keep_alive_client_that_was_answered() -> None:
    srv = serve(header_timeout_s=30, max_connections=20)  # the read deadline plays no part here
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    socks: list[socket.socket] = []
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=CLOSE_WAIT_S) as client:
            client.sendall(request)
            assert read_response(client).startswith(b"HTTP/1.1 200")  # answered; now idle, kept alive
            for _ in range(60):  # three times the cap: every new staller evicts a waiting connection
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=CLOSE_WAIT_S)
                s.sendall(HALF_HEADER)
                socks.append(s)
            assert sum(closed_by_server(s) for s in socks[:40]) == 40  # the oldest stallers went
            client.sendall(request)  # the answered client's connection survived the flood
            assert read_response(client).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_a_complete_request_sent_slowly_within_the_timeout_is_answered(guarded: ThreadServer) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
        s.sendall(HALF_HEADER)
        s.sendall(b"1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


# -- item 2: Host, Origin, Content-Type ------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8321", "localhost", "localhost:1234", "[::1]:8321",
                                  "192.168.1.20:8321", "homeserver.lan", "HomeServer.lan:8321"])
def test_trusted_hosts_are_accepted(guarded: ThreadServer, host: str) -> None:
    r = httpx.get(f"{guarded.url}/health", headers={"host": host}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8321", "localhost.evil.example"])
def test_a_foreign_host_name_is_refused_with_an_openai_error(guarded: ThreadServer, host: str) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/reset", headers={"host": host}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "untrusted_host" and host in err["message"] and "server.allowed_hosts" in err["message"]


@pytest.mark.parametrize("origin,status", [
    ("http://evil.example", 403),
    ("null", 403),
    ("http://dash.example", 200),  # listed in server.cors_origins
])
def test_cross_origin_posts_are_refused_unless_the_origin_is_allowed(guarded: ThreadServer, origin: str, status: int) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/reset", json={}, headers={"origin": origin}, timeout=30)
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["code"] == "cross_origin_refused"


def test_same_origin_post_is_accepted(guarded: ThreadServer) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/reset", json={}, headers={"origin": guarded.url}, timeout=30)
    assert r.status_code == 200, r.text


def test_cross_origin_post_with_the_api_key_is_accepted() -> None:
    srv = serve(api_key=API_KEY)
    try:
        headers = {"origin": "http://evil.example", "authorization": f"Bearer {API_KEY}"}
        assert httpx.post(f"{srv.url}/v1/homespec/reset", json={}, headers=headers, timeout=30).status_code == 200
        r = httpx.post(f"{srv.url}/v1/homespec/reset", json={}, headers={"origin": "http://evil.example"}, timeout=30)
        assert r.status_code == 401, r.text
    finally:
        srv.stop()


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_post_that_is_not_json_gets_415_naming_the_content_type(guarded: ThreadServer, ctype: str) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/reset", content=b'{"x": 1}', headers={"content-type": ctype}, timeout=30)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and ctype.split(";")[0] in err["message"], err
    assert "application/json" in err["message"], err


def test_a_post_without_a_body_or_content_type_gets_415_too(guarded: ThreadServer) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/reset", timeout=30)  # what a cross-site form can send
    assert r.status_code == 415, r.text
    assert "no Content-Type" in r.json()["error"]["message"], r.text


def test_the_dashboards_reset_is_a_json_post(guarded: ThreadServer) -> None:
    async def reset() -> None:
        client = DaemonClient(guarded.url)
        try:
            await client.reset()  # raises on any answer but 2xx
        finally:
            await client.aclose()

    asyncio.run(reset())


def test_json_posts_pass_the_content_type_check(guarded: ThreadServer) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/reset", content=b"{}",
                   headers={"content-type": "application/json; charset=utf-8"}, timeout=30)
    assert r.status_code == 200, r.text


# -- item 6: empty body, Retry-After -------------------------------------------------------------


def test_an_empty_json_body_is_called_missing_not_field_none(guarded: ThreadServer) -> None:
    r = httpx.post(f"{guarded.url}/v1/homespec/mode", content=b"", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "missing or empty" in msg and "None" not in msg, msg


def test_every_503_carries_retry_after(guarded: ThreadServer) -> None:
    r = httpx.get(f"{guarded.url}/ready", timeout=30)  # the daemon was never started: loading
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.headers)
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.headers)
    assert r.json()["error"]["code"] == "not_ready"



# -- a half-closed client --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(served: Served, stream: bool) -> None:
    """shutdown(SHUT_WR) after the request: uvicorn took the EOF for a hang-up and the generation
    was cancelled before its first token; now the answer comes (after an interim 100), then the
    server closes."""
    srv = ThreadServer(create_app(served.daemon, address="127.0.0.1"), server=served.daemon.cfg.server).start()
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0,
                           "stream": stream}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=CLOSE_WAIT_S) as s:
            s.sendall(head + body)
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(65536):  # until the server closes: it must, once answered
                data += chunk
        interim, _, data = data.partition(b"\r\n\r\n")  # the 100 that tells a half-close from a hang-up
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert (b"data: [DONE]" in data) if stream else (b'"finish_reason"' in data and b'"content"' in data)
    finally:
        srv.stop()


class PatientApp:
    """An ASGI app that answers a POST after WAIT_S unless the client hangs up first, and
    records which happened (a stand-in for a non-streaming generation: no model needed)."""

    WAIT_S = 4.0

    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.done = threading.Event()

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        try:
            msg = await asyncio.wait_for(receive(), self.WAIT_S)
            self.outcomes.append(msg["type"])  # http.disconnect
        except asyncio.TimeoutError:
            self.outcomes.append("answered")
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"done"})
        self.done.set()


POST = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def test_a_client_that_hangs_up_on_a_waiting_request_is_seen_to_go_though_it_sent_only_eof() -> None:
    """A close and a half-close both arrive as EOF; keeping half-closed clients served must not
    leave a request whose client hung up running to its end (the interim 100 draws a reset)."""
    app = PatientApp()
    srv = ThreadServer(app, server=ServerConfig()).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(POST)
        assert app.done.wait(30)
        assert app.outcomes == ["http.disconnect"], app.outcomes
    finally:
        srv.stop()


def test_a_half_closed_client_gets_an_interim_100_then_the_answer() -> None:
    app = PatientApp()
    srv = ThreadServer(app, server=ServerConfig()).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(POST)
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert app.outcomes == ["answered"], app.outcomes
        assert data.startswith(b"HTTP/1.1 100 "), data
        assert b"HTTP/1.1 200 " in data and data.endswith(b"done"), data
        # httpx (h11) skips the interim response like any client must (RFC 9110 15.2).
        assert httpx.post(srv.url, json={}, timeout=30).text == "done"
    finally:
        srv.stop()
