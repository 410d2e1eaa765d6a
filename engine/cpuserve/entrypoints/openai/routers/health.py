"""GET /health, /version and /metrics: what probes and monitoring read."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

import cpuserve
from cpuserve.entrypoints.openai.errors import error_response
from cpuserve.entrypoints.openai.serving import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    engine = server_state(request).engine
    if engine.dead:
        return error_response(503, f"engine core is down: {engine.dead_reason}", "service_unavailable")
    return Response(status_code=200)


@router.get("/version")
async def version():
    return {"version": cpuserve.__version__}


@router.get("/metrics")
async def prometheus(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    st = server_state(request)
    st.metrics.update_stats(st.engine.stats)
    return PlainTextResponse(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
