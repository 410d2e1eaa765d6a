"""GET /health (and /ping), /version, /topology and /metrics: what probes, the node agent and
monitoring read."""
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


@router.get("/ping", operation_id="ping")
@router.post("/ping", operation_id="ping_post")
async def ping(request: Request):
    """/health under the name SageMaker's and vLLM's servers answer it by (GET or POST)."""
    return await health(request)


@router.get("/topology")
async def topology(request: Request):
    """Where the engine's ranks really run: each rank's thread CPUs and the NUMA node its memory
    is bound to (null where the kernel refused the policy). The node agent records it on the
    pod, and the CPUModelServer's status.placements shows it."""
    engine = server_state(request).engine
    info = getattr(engine, "info", None)
    if info is None:
        return error_response(503, "the engine is still loading", "service_unavailable")
    return {"ranks": info.binding}


@router.get("/version")
async def version():
    return {"version": cpuserve.__version__}


@router.get("/metrics")
async def prometheus(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    st = server_state(request)
    st.metrics.update_stats(st.engine.stats)
    return PlainTextResponse(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
