"""Liveness, readiness and Prometheus metrics: GET /health, /ready and /metrics.

/health and /ready stay open when an API key is set (see OPEN_PATHS in the app), so a service
manager or load balancer can probe without one; /metrics does not.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from homespec.serving.routes.common import daemon_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    daemon = daemon_of(request)
    return {"status": "ok", "state": daemon.state}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    daemon = daemon_of(request)
    return JSONResponse({"ready": daemon.ready, "state": daemon.state}, status_code=200 if daemon.ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(daemon_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
