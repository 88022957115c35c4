"""homespec's own endpoints, which the dashboard uses: GET /v1/homespec/stats, and
POST /v1/homespec/mode and /v1/homespec/reset."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from homespec.errors import UserError
from homespec.serving import openai_api as oa
from homespec.serving.routes.common import daemon_of
from homespec.serving.stats_view import build_stats_view

router = APIRouter()


class ModeBody(BaseModel):
    mode: str


@router.get("/v1/homespec/stats")
async def stats(request: Request) -> dict:
    return build_stats_view(daemon_of(request), request.app.state.address).model_dump(mode="json")


@router.post("/v1/homespec/mode")
async def set_mode(request: Request, body: ModeBody) -> dict:
    daemon = daemon_of(request)
    try:
        daemon.set_mode(body.mode)
    except UserError as e:
        raise oa.ApiError(400, str(e), param="mode") from None
    return {"mode": daemon.mode}


@router.post("/v1/homespec/reset")
async def reset(request: Request) -> dict:
    daemon_of(request).live.reset()
    return {"reset": True}
