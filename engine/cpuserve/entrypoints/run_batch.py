"""`cpuserve run-batch -i requests.jsonl -o results.jsonl`: OpenAI's batch file format, run
offline as vLLM's run_batch does. Each input line is {"custom_id", "method": "POST", "url",
"body"}; each output line, in the input's order, {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}. The requests go through the server's own app in this process
(the same validation, chat templates, tools and structured output as `serve`) against its engine
core, many at once so that the engine batches them; nothing listens on a port.
"""
from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

from cpuserve.config import EngineConfig

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank")


def parse_line(line: str) -> tuple[object, dict | None, str | None]:
    """(custom_id, the request, None), or (custom_id where there is one, None, why it cannot be run)."""
    try:
        req = json.loads(line)
    except ValueError as e:
        return None, None, f"not JSON: {e}"
    custom = req.get("custom_id") if isinstance(req, dict) else None
    if not isinstance(req, dict) or not isinstance(req.get("body"), dict):
        return custom, None, "a batch request is an object with custom_id, method, url and a body object"
    if req.get("method", "POST") != "POST" or req.get("url") not in URLS:
        return custom, None, (f"{req.get('method', 'POST')} {req.get('url')!r} is not served in a batch "
                              f"(POST to {', '.join(URLS)})")
    if req["body"].get("stream"):
        return custom, None, "stream is not served in a batch"
    return custom, req, None


def result(custom_id, status: int | None = None, body=None, error: str | None = None) -> dict:
    """One output line: the response, or (error) why the line was not run."""
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": None}
    if error is not None:
        line["error"] = {"code": "invalid_request", "message": error}
    else:
        line["response"] = {"status_code": status, "request_id": f"cpuserve-batch-{uuid.uuid4().hex}", "body": body}
    return line


async def run_lines(client, lines: list[str], concurrency: int) -> list[dict]:
    """Every line's result, in order, at most `concurrency` requests in flight."""
    gate, done = asyncio.Semaphore(concurrency), [0]

    async def one(line: str) -> dict:
        custom, req, why = parse_line(line)
        if req is None:
            return result(custom, error=why)
        async with gate:
            r = await client.post(req["url"], json=req["body"], timeout=None)
        done[0] += 1
        if done[0] % 100 == 0:
            print(f"run-batch: {done[0]} of {len(lines)} requests done", file=sys.stderr)
        return result(custom, r.status_code, r.json())
    return await asyncio.gather(*(one(line) for line in lines))


async def run(config: EngineConfig, source: Path, dest: Path, concurrency: int, aliases: tuple = ()) -> int:
    """Runs the batch file through the server's app (served as config.served_model_name and the
    aliases); the engine's start-up failure is raised."""
    import httpx

    from cpuserve.engine.async_engine import AsyncEngine
    from cpuserve.entrypoints.openai.app import build_app
    from cpuserve.entrypoints.serve import ServeOptions, default_served_name, model_defaults

    lines = [ln for ln in source.read_text().splitlines() if ln.strip()]
    engine = AsyncEngine(config, max(1024, concurrency))
    app = build_app(engine, config.served_model_name or default_served_name(config),
                    ServeOptions(access_log=False, model_aliases=tuple(aliases)))
    await engine.start()
    if engine.info.task == "generate":
        app.state.server.defaults = model_defaults(config, engine.info.model_dir)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch") as client:
            results = await run_lines(client, lines, concurrency)
    finally:
        await engine.shutdown()
    dest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"run-batch: {len(results)} requests, {failed} failed; results in {dest}", file=sys.stderr)
    return 0
