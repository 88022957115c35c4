"""HTTP client for the daemon's dashboard endpoints; the dashboard's only link to the daemon.

It speaks the contract in homespec/stats_schema.py and imports nothing from the engine, so it can
watch a daemon on another machine. Every failure becomes one of three exceptions whose message is
a single line a person can act on; the app decides whether to retry.
"""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from homespec.serving.stats_schema import StatsView

DEFAULT_URL = "http://127.0.0.1:8321"
# Short: the app polls every second and must notice a dead daemon within a couple of polls,
# while a loaded daemon on a 2-core box still answers the stats endpoint in well under this.
TIMEOUT_S = 2.0


class DaemonError(Exception):
    """Base for the client's errors; str(e) is one line for the screen."""


class Unreachable(DaemonError):
    """No answer (refused, reset, timed out) or a 5xx: worth retrying."""


class Unauthorized(DaemonError):
    """401: the API key is missing or wrong; retrying with the same key will not help."""


class ProtocolError(DaemonError):
    """An answer that is not what a homespec daemon sends (404, bad JSON, schema mismatch)."""


class DaemonClient:
    """Async calls to one daemon: stats, set_mode, reset. Call aclose() when done."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, timeout_s: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.has_key = bool(api_key)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s)

    async def stats(self) -> StatsView:
        body = await self._call("GET", "/v1/homespec/stats")
        try:
            return StatsView.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(root)"
            raise ProtocolError(
                f"stats from {self.url} do not match this dashboard's schema ({where}: {first['msg']}); "
                "are the daemon and the dashboard the same homespec version?"
            ) from None

    async def set_mode(self, mode: str) -> str:
        """Set the daemon's speculation mode; returns the mode the daemon reports back."""
        body = await self._call("POST", "/v1/homespec/mode", json={"mode": mode})
        return str(body.get("mode", mode)) if isinstance(body, dict) else mode

    async def reset(self) -> None:
        """Reset the daemon's rolling statistics."""
        await self._call("POST", "/v1/homespec/reset", json={})  # the daemon takes only JSON POSTs

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, json: object | None = None) -> object:
        try:
            r = await self._http.request(method, path, json=json)
        except httpx.TimeoutException:
            raise Unreachable(f"{self.url} did not answer within {self._http.timeout.read:g} s") from None
        except httpx.HTTPError as e:
            # ConnectError and friends: the message is often empty, the class name is not.
            raise Unreachable(f"cannot reach {self.url} ({type(e).__name__})") from None
        if r.status_code == 401:
            if self.has_key:
                raise Unauthorized(f"the daemon rejected the API key ({_error_message(r)})")
            raise Unauthorized("the daemon needs an API key: pass --api-key or set HOMESPEC_API_KEY")
        if r.status_code >= 500:
            raise Unreachable(f"{method} {path} answered {r.status_code}: {_error_message(r)}")
        if r.status_code == 404:
            raise ProtocolError(f"{self.url} has no {path}: is this a homespec daemon?")
        if r.status_code >= 400:
            raise ProtocolError(f"{method} {path} answered {r.status_code}: {_error_message(r)}")
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise ProtocolError(f"{method} {path} answered something that is not JSON") from None


def _error_message(r: httpx.Response) -> str:
    """The message of an OpenAI-style error body, or FastAPI's `detail`, or the reason phrase."""
    try:
        body = r.json()
    except ValueError:
        return r.reason_phrase or "no message"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("detail"):
            return str(body["detail"])
    return r.reason_phrase or "no message"
