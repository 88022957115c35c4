"""Liveness, readiness and Prometheus metrics: GET /health, /ready and /metrics.

/health and /ready stay open when an API key is set (OPEN_PATHS in serving/middleware.py), so a service
manager or load balancer can probe without one; /metrics does not.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from homespec.serving.routes.common import RETRY_AFTER_503_S, daemon_of

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and monitors' probe
async def health(request: Request) -> JSONResponse:
    """Liveness, as the systemd watchdog sees it: a failed load or a stalled worker is a 503
    (a monitor restarts a daemon that refuses every request; a healthy "ok" would hide it)."""
    daemon = daemon_of(request)
    if daemon.healthy():
        return JSONResponse({"status": "ok", "state": daemon.state})
    body = {"status": "unhealthy", "state": daemon.state, "error": daemon.error}
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_503_S)})


@router.api_route("/ready", methods=["GET", "HEAD"])
async def ready(request: Request) -> JSONResponse:
    daemon = daemon_of(request)
    if daemon.ready:
        return JSONResponse({"ready": True, "state": daemon.state})
    headers = {"Retry-After": str(RETRY_AFTER_503_S)}  # every 503 says when to try again
    return JSONResponse({"ready": False, "state": daemon.state}, status_code=503, headers=headers)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(daemon_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
