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
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

import cpuserve
from cpuserve.engine.async_engine import AsyncEngine
from cpuserve.entrypoints.openai.errors import error_response, install_error_handlers
from cpuserve.entrypoints.openai.metrics import Metrics
from cpuserve.entrypoints.openai.routers import (chat, classify, completions, embeddings, health, lora, models,
                                                 responses, score, tokenize)
from cpuserve.entrypoints.openai.serving import ServerState
from cpuserve.entrypoints.serve import ServeOptions

log = logging.getLogger("cpuserve.api")

ROUTERS = (models.router, completions.router, chat.router, responses.router, embeddings.router, score.router,
           classify.router, tokenize.router, health.router)
# Answered while the model loads (everything else gets 503 until it is ready).
SERVED_WHILE_LOADING = ("/version", "/openapi.json", "/docs", "/metrics")
# Answered without the API key: the probes, the scrape, the docs. vLLM asks for the key on /v1 alone,
# which leaves /tokenize, /score, /rerank and /v2/rerank open; here every other path asks for it.
OPEN_WITHOUT_KEY = ("/health", "/ping", "/version", "/metrics", "/topology", "/openapi.json", "/docs",
                    "/docs/oauth2-redirect", "/redoc")


def build_app(engine: AsyncEngine, served_model_name: str, opts: ServeOptions = ServeOptions()) -> FastAPI:
    docs = opts.docs
    app = FastAPI(title="cpuserve", version=cpuserve.__version__, root_path=opts.root_path,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    lora_slots = engine.config.max_loras if engine.config.enable_lora else None
    app.state.server = ServerState(engine, served_model_name, Metrics(served_model_name, lora_slots), opts.api_key,
                                   tool_call_parser=opts.tool_call_parser,
                                   prompt_tokens_details=opts.prompt_tokens_details, force_usage=opts.force_usage,
                                   tokens_as_ids=opts.tokens_as_ids, log_requests=opts.log_requests,
                                   reasoning_parser=opts.reasoning_parser, aliases=opts.model_aliases,
                                   loras=dict(engine.config.lora_modules or {}))
    app.add_middleware(RequestContext, st=app.state.server, max_body_bytes=opts.max_request_body_bytes,
                       access_log=opts.access_log)
    # outermost: a preflight is answered before the API key is asked for, and every answer (a 401
    # and a 503 too) carries the headers that let the page read it
    cors = opts.cors
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                       allow_headers=list(cors.headers), allow_credentials=cors.credentials)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if lora.runtime_updates_allowed():  # as vLLM: the routes exist only where allowed
        app.include_router(lora.router)
    return app


def route_path(scope) -> str:
    """The path the routes see: under --root-path, a proxy may pass the prefix on or strip it
    (Starlette routes both), and the API key check and the loading gate must see what the route
    does, or /prefix/v1/... would pass the check that /v1/... meets."""
    root, path = scope.get("root_path", ""), scope["path"]
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class RequestContext:
    """Request ids (X-Request-Id in and out), the API key, 503 while loading, the body
    size limit, and one log line per request. A plain ASGI middleware, not Starlette's
    BaseHTTPMiddleware: that one hides the client's disconnect from the routes, so a
    non-streaming request whose client gave up would keep generating."""

    def __init__(self, app, st: ServerState, max_body_bytes: int, access_log: bool = True):
        self.app, self.st, self.max_body, self.access_log = app, st, max_body_bytes, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid  # request.state.request_id
        path, t0, status = route_path(scope), time.monotonic(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        refusal = self.refusal(path, headers.get(b"authorization"), headers.get(b"content-length"))
        try:
            if refusal is not None:
                await refusal(scope, receive, send_with_id)
            else:
                await self.app(scope, self.limited(receive), send_with_id)
        finally:  # a request that failed or was cancelled is logged too (status 0: nothing was sent)
            if self.access_log:
                log.info("request_id=%s method=%s path=%s status=%d duration_ms=%.1f", rid, scope["method"],
                         path, status[0], (time.monotonic() - t0) * 1e3)

    def too_large(self) -> HTTPException:
        return HTTPException(413, f"the request body exceeds {self.max_body} bytes (--max-request-body-bytes)")

    def limited(self, receive):
        """receive, counting body bytes: a body sent without a length (chunked) that grows
        past the limit ends in the same 413, raised where the route reads it."""
        seen = 0

        async def receive_limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise self.too_large()
            return message
        return receive_limited

    def refusal(self, path: str, authorization: bytes | None, content_length: bytes | None):
        if content_length is not None and content_length.isdigit() and int(content_length) > self.max_body:
            e = self.too_large()
            return error_response(e.status_code, e.detail, "invalid_request_error")
        if self.st.api_key and path not in OPEN_WITHOUT_KEY and not hmac.compare_digest(
                authorization or b"", f"Bearer {self.st.api_key}".encode()):  # constant time
            return error_response(401, "invalid or missing API key", "authentication_error")
        if self.st.engine.info is None and path not in SERVED_WHILE_LOADING:
            return error_response(503, "the model is loading", "service_unavailable")
        if self.st.draining and path not in SERVED_WHILE_LOADING:  # /health too: readiness fails
            return error_response(503, "the server is shutting down", "service_unavailable")
        return None
