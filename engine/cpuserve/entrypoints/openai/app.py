"""The OpenAI-compatible HTTP server (the API process): an app factory that
composes the routers. It validates requests, applies chat templates, tokenizes
and streams, and never runs model code: the engine core runs in its own process
(engine/async_engine.py)."""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import FastAPI, Request

import cpuserve
from cpuserve.engine.async_engine import AsyncEngine
from cpuserve.entrypoints.openai.errors import error_response, install_error_handlers
from cpuserve.entrypoints.openai.metrics import Metrics
from cpuserve.entrypoints.openai.routers import chat, completions, health, models, tokenize
from cpuserve.entrypoints.openai.serving import ServerState

log = logging.getLogger("cpuserve.api")

ROUTERS = (models.router, completions.router, chat.router, tokenize.router, health.router)
# Answered while the model loads (everything else gets 503 until it is ready).
SERVED_WHILE_LOADING = ("/version", "/openapi.json", "/docs", "/metrics")


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="cpuserve", version=cpuserve.__version__)
    app.state.server = ServerState(engine, served_model_name, Metrics(served_model_name), api_key)
    install_request_context(app, app.state.server)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


def install_request_context(app: FastAPI, st: ServerState) -> None:
    """Request ids (X-Request-Id in and out), the API key, 503 while loading, and
    one log line per request."""

    @app.middleware("http")
    async def request_context(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = rid
        t0 = time.monotonic()
        if st.api_key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization") != f"Bearer {st.api_key}":
            resp = error_response(401, "invalid or missing API key", "authentication_error")
        elif st.engine.info is None and request.url.path not in SERVED_WHILE_LOADING:
            resp = error_response(503, "the model is loading", "service_unavailable")
        else:
            resp = await call_next(request)
        resp.headers["X-Request-Id"] = rid
        log.info("request_id=%s method=%s path=%s status=%d duration_ms=%.1f", rid, request.method,
                 request.url.path, resp.status_code, (time.monotonic() - t0) * 1e3)
        return resp
