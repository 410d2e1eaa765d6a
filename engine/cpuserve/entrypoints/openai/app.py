"""The OpenAI-compatible HTTP server (the API process): an app factory that
composes the routers. It validates requests, applies chat templates, tokenizes
and streams, and never runs model code: the engine core runs in its own process
(engine/async_engine.py)."""
from __future__ import annotations

import hmac
import logging
import time
import uuid

from fastapi import FastAPI

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
    app.add_middleware(RequestContext, st=app.state.server)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


class RequestContext:
    """Request ids (X-Request-Id in and out), the API key, 503 while loading, and one
    log line per request. A plain ASGI middleware, not Starlette's BaseHTTPMiddleware:
    that one hides the client's disconnect from the routes, so a non-streaming
    request whose client gave up would keep generating."""

    def __init__(self, app, st: ServerState):
        self.app, self.st = app, st

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid  # request.state.request_id
        path, t0, status = scope["path"], time.monotonic(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        refusal = self.refusal(path, headers.get(b"authorization"))
        if refusal is not None:
            await refusal(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)
        log.info("request_id=%s method=%s path=%s status=%d duration_ms=%.1f", rid, scope["method"], path,
                 status[0], (time.monotonic() - t0) * 1e3)

    def refusal(self, path: str, authorization: bytes | None):
        if self.st.api_key and path.startswith("/v1") and not hmac.compare_digest(
                authorization or b"", f"Bearer {self.st.api_key}".encode()):  # constant time
            return error_response(401, "invalid or missing API key", "authentication_error")
        if self.st.engine.info is None and path not in SERVED_WHILE_LOADING:
            return error_response(503, "the model is loading", "service_unavailable")
        return None
