"""`cpuserve serve`: the API process. Starts the engine core, then uvicorn; exits
non-zero when the engine core dies, so that a supervisor (the kubelet) restarts it."""
from __future__ import annotations

import asyncio
import logging
import signal

from cpuserve.config import EngineConfig

log = logging.getLogger("cpuserve.serve")


async def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None, api_key: str | None,
                max_waiting_requests: int) -> int:
    import uvicorn

    from cpuserve.api_server import build_app
    from cpuserve.async_engine import AsyncEngine

    server: uvicorn.Server | None = None

    def on_dead(reason: str) -> None:
        log.error("shutting down: %s", reason)
        if server is not None:
            server.should_exit = True

    engine = AsyncEngine(config, max_waiting_requests, on_dead=on_dead)
    name = served_model_name or ("smollm2" if config.model in (None, "", "default") else
                                 config.model.rstrip("/").split("/")[-1])
    app = build_app(engine, name, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    # Listen from the start: /health and every route answer 503 until the model is loaded.
    serving = asyncio.create_task(server.serve())
    try:
        await engine.start()
    except RuntimeError as e:
        log.error("%s", e)
        server.should_exit = True
        await serving
        await engine.shutdown()
        return 1
    log.info("serving %s on http://%s:%d/v1", name, host, port)
    try:
        await serving
    finally:
        await engine.shutdown()
    return 1 if engine.dead else 0


def run(config: EngineConfig, host: str, port: int, served_model_name: str | None, api_key: str | None,
        max_waiting_requests: int) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(serve(config, host, port, served_model_name, api_key, max_waiting_requests))
    except KeyboardInterrupt:
        return 0
