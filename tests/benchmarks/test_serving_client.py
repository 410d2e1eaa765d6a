"""The serving benchmark's client (benchmarks/serving.py, aiohttp) against a small streaming server
on loopback: what it counts as tokens, what it times, and that a failed or empty stream is an
error rather than a level's silent figure."""
import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving  # noqa: E402


def sse_app(texts: list[str], status: int = 200) -> tuple[web.Application, list]:
    """/v1/completions streaming one server-sent event per text (an empty text: a chunk with no
    token, as a stop-string hold-back sends), then [DONE]; `status` other than 200: an error.
    With it, the list of request bodies it was sent."""
    seen = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for t in texts:
            chunk = {"choices": [{"index": 0, "text": t}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.001)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app, seen


async def served(app: web.Application, body):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_level_counts_tokens_with_text_and_times_each_request():
    app, seen = sse_app(["a", "", "b", "c"])
    prompts = [[1, 2, 3], [4, 5, 6]]
    r = asyncio.run(served(app, lambda url: serving.level(url, 2, prompts, keepalive=False, output_len=3)))
    # two clients of two requests each, after one warm-up request
    assert r["requests"] == 4 and len(seen) == 5
    assert all(b["stream"] and b["max_tokens"] == 3 and b["ignore_eos"] for b in seen)
    assert {tuple(b["prompt"]) for b in seen} == {(1, 2, 3), (4, 5, 6)}
    assert r["tok_s"] == pytest.approx(4 * 3 / r["wall_s"])
    assert 0 < r["ttft_p50"] <= r["ttft_p99"] < 1000
    assert 0 < r["itl_p50"] <= r["itl_p99"] < 1000
    assert r["client_cpu_us_per_token"] > 0
    assert r["api_cpu_us_per_token"] is None and r["engine_steps"] is None


def test_a_stream_without_text_is_an_error():
    async def one(url):
        async with aiohttp.ClientSession() as s:
            return await serving.one_request(s, url, [1], 3)
    with pytest.raises(RuntimeError, match="no text"):
        asyncio.run(served(sse_app(["", ""])[0], one))


def test_a_refused_request_fails_the_level():
    with pytest.raises(aiohttp.ClientResponseError):
        asyncio.run(served(sse_app(["a"], status=503)[0], lambda url: serving.level(url, 1, [[1]], output_len=1)))


def metrics_app(pages: list[str]) -> web.Application:
    """/metrics answering the given pages in turn (the last one from then on)."""
    calls = []

    async def metrics(request: web.Request) -> web.Response:
        calls.append(1)
        return web.Response(text=pages[min(len(calls), len(pages)) - 1])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def test_levels_wait_for_the_start_up_work_of_a_server_that_reports_it():
    pending, done = ('cpuserve:startup_work_pending{model_name="m"} %s\n' % v for v in ("1.0", "0.0"))
    waited = asyncio.run(served(metrics_app([pending, pending, done]),
                                lambda url: asyncio.to_thread(serving.wait_settled, url)))
    assert waited >= 0.4  # two pending answers, 0.2 s apart
    other = asyncio.run(served(metrics_app(["vllm:num_requests_running 0.0\n"]),
                               lambda url: asyncio.to_thread(serving.wait_settled, url)))
    assert other is None
    with pytest.raises(RuntimeError, match="start-up work was not done 1 s after it was ready"):
        asyncio.run(served(metrics_app([pending]), lambda url: asyncio.to_thread(serving.wait_settled, url, 1)))
