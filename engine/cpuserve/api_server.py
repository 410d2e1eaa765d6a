"""The OpenAI-compatible HTTP server (the API process). It validates requests,
applies chat templates, tokenizes, streams, and never runs model code: the
engine core runs in its own process (async_engine.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import cpuserve
from cpuserve.async_engine import AsyncEngine, EngineDeadError, Overloaded, RequestRejected
from cpuserve.metrics import Metrics, RequestTimer
from cpuserve.outputs import RequestOutput
from cpuserve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                               now, usage)

log = logging.getLogger("cpuserve.api")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Runs several async generators concurrently, yielding (which, item)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for item in g:
                await q.put((i, item))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class DeltaTracker:
    """What a stream has sent of each completion: yields the new text and token
    range. Until a completion ends, the last len(longest stop) - 1 characters are
    held back, so text later cut by a stop string is never sent."""

    def __init__(self, stop_strings: list[str]):
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}

    def advance(self, key: int, c) -> tuple[str, int, int, bool] | None:
        """(text delta, first new token, text offset, done), or None when nothing is new."""
        done = c.finish_reason is not None
        sent = self.text.get(key, 0)
        upto = len(c.text) if done else max(sent, len(c.text) - self.holdback)
        t0 = self.tokens.get(key, 0)
        if upto == sent and not done and t0 == len(c.token_ids):
            return None
        self.text[key], self.tokens[key] = upto, len(c.token_ids)
        return c.text[sent:upto], t0, sent, done

    def completion_tokens(self) -> int:
        return sum(self.tokens.values())


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="cpuserve", version=cpuserve.__version__)
    metrics = Metrics(served_model_name)
    tok = lambda: engine.tokenizer  # noqa: E731 - set once the core is ready

    # -- plumbing -------------------------------------------------------------------
    @app.middleware("http")
    async def request_context(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = rid
        t0 = time.monotonic()
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                resp = error_response(401, "invalid or missing API key", "authentication_error")
                resp.headers["X-Request-Id"] = rid
                return resp
        if engine.info is None and request.url.path not in ("/version", "/openapi.json", "/docs", "/metrics"):
            resp = error_response(503, "the model is loading", "service_unavailable")
        else:
            resp = await call_next(request)
        resp.headers["X-Request-Id"] = rid
        log.info("request_id=%s method=%s path=%s status=%d duration_ms=%.1f", rid, request.method,
                 request.url.path, resp.status_code, (time.monotonic() - t0) * 1e3)
        return resp

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        return error_response(400, msg or "invalid request", param=param)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                              "invalid_request_error")

    def check_model(name: str | None) -> None:
        if name not in (None, "", served_model_name):
            raise APIError(404, f"the model `{name}` does not exist (served: `{served_model_name}`)", "not_found_error",
                           "model")

    async def run(request: Request, gens_args: list[tuple], stream_fn, final_fn, stream: bool):
        """Starts one engine request per prompt; streams or gathers."""
        base = f"{request.state.request_id}-{uuid.uuid4().hex[:8]}"
        for _, ids, params in gens_args:
            try:
                engine.check(len(ids), params)
            except RequestRejected as e:
                raise APIError(400, str(e), param="prompt") from None
        if engine.dead:
            raise APIError(503, f"engine is not available: {engine.dead_reason}", "service_unavailable")
        gens = [track(engine.generate(f"{base}-{i}", text, ids, params)) for i, (text, ids, params) in
                enumerate(gens_args)]
        if stream:
            first = await _first_or_error(gens)
            return StreamingResponse(stream_fn(base, first), media_type="text/event-stream")
        final: dict[int, RequestOutput] = {}
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            collect = asyncio.create_task(_collect(merge(gens), final))
            done, _ = await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:  # the client went away: cancelling aborts the engine requests
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)
                return Response(status_code=499)
            collect.result()
        finally:
            watcher.cancel()
        return JSONResponse(final_fn(base, [final[i] for i in range(len(gens))]))

    async def track(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(metrics)
        seen = 0
        last = None
        try:
            async for out in gen:
                n = sum(len(c.token_ids) for c in out.outputs)
                if n > seen:
                    timer.token()
                    seen = n
                last = out
                yield out
        except RequestRejected as e:
            raise APIError(400, str(e), param="prompt") from None
        except Overloaded as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except EngineDeadError as e:
            raise APIError(503, f"engine failed: {e}", "service_unavailable") from None
        finally:
            if last is not None and last.finished:
                timer.finish([c.finish_reason for c in last.outputs])

    async def _first_or_error(gens):
        """For streams: surface a rejection as a proper status before the 200 is sent."""
        merged = merge(gens)
        try:
            first = await merged.__anext__()
        except StopAsyncIteration:
            first = None

        async def rest():
            if first is not None:
                yield first
            async for item in merged:
                yield item
        return rest()

    # -- OpenAI endpoints -----------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        info = engine.info
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": now(),
                                            "owned_by": "cpuserve", "root": info.model_dir if info else None,
                                            "max_model_len": info.max_model_len if info else None}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of must equal n", param="best_of")
        p = req.prompt
        if isinstance(p, str):
            prompts = [(p, tok().encode(p))]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [(x, tok().encode(x)) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [(None, list(p))]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [(None, list(x)) for x in p]
        else:
            raise APIError(400, "prompt must be a non-empty string, list of strings, or token id list(s)",
                           param="prompt")
        if any(not ids for _, ids in prompts):
            raise APIError(400, "a prompt is empty", param="prompt")
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        created, n = now(), params.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def logprobs_block(comp, start: int, end: int, offset0: int):
            if comp.logprobs is None:
                return None
            toks, lps, tops, offs, off = [], [], [], [], offset0
            for tid, entry in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
                s = tok().decode([tid])
                toks.append(s)
                lps.append(entry.get(tid))
                top = sorted(entry.items(), key=lambda kv: -kv[1])[: params.logprobs]
                tops.append({tok().decode([t]): lp for t, lp in top})
                offs.append(off)
                off += len(s)
            return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

        def final(base, outs: list[RequestOutput]):
            choices = []
            for pi, out in enumerate(outs):
                for c in out.outputs:
                    choices.append({"index": pi * n + c.index, "text": c.text,
                                    "logprobs": logprobs_block(c, 0, len(c.token_ids), 0),
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            return {"id": f"cmpl-{base}", "object": "text_completion", "created": created,
                    "model": served_model_name, "choices": choices,
                    "usage": usage(sum(len(o.prompt_token_ids) for o in outs),
                                   sum(len(c.token_ids) for o in outs for c in o.outputs))}

        async def stream(base, items):
            deltas, prompt_tokens = DeltaTracker(params.stop_strings), {}
            try:
                async for pi, out in items:
                    prompt_tokens[pi] = len(out.prompt_token_ids)
                    for c in out.outputs:
                        key = pi * n + c.index
                        step = deltas.advance(key, c)
                        if step is None:
                            continue
                        delta, t0, offset, done = step
                        chunk = {"index": key, "text": delta,
                                 "logprobs": logprobs_block(c, t0, len(c.token_ids), offset),
                                 "finish_reason": c.finish_reason if done else None,
                                 "stop_reason": c.stop_reason if done else None}
                        yield sse({"id": f"cmpl-{base}", "object": "text_completion", "created": created,
                                   "model": served_model_name, "choices": [chunk]})
                if include_usage:
                    yield sse({"id": f"cmpl-{base}", "object": "text_completion", "created": created,
                               "model": served_model_name, "choices": [],
                               "usage": usage(sum(prompt_tokens.values()), deltas.completion_tokens())})
                yield sse("[DONE]")
            except APIError as e:
                yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})

        return await run(request, [(t, ids, params) for t, ids in prompts], stream, final, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")
        try:
            text = tok().apply_chat_template([m.as_template_dict() for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt,
                                             chat_template=req.chat_template)
        except Exception as e:  # noqa: BLE001 - a template error is the client's input
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        ids = tok().encode(text, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the rendered conversation is empty", param="messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.info.max_model_len - len(ids))
        top = req.top_logprobs if req.top_logprobs is not None else 0
        try:
            params = req.sampling_params(max_tokens, top if req.logprobs else None)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def lp_content(comp, start: int, end: int):
            if comp.logprobs is None:
                return None
            out = []
            for tid, entry in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
                s = tok().decode([tid])
                ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
                out.append({"token": s, "logprob": entry.get(tid), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (ts := tok().decode([t])), "logprob": lp,
                                              "bytes": list(ts.encode())} for t, lp in ranked]})
            return {"content": out}

        def final(base, outs: list[RequestOutput]):
            out = outs[0]
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp_content(c, 0, len(c.token_ids)), "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason} for c in out.outputs]
            return {"id": f"chatcmpl-{base}", "object": "chat.completion", "created": created,
                    "model": served_model_name, "choices": choices,
                    "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}

        async def stream(base, items):
            head = {"id": f"chatcmpl-{base}", "object": "chat.completion.chunk", "created": created,
                    "model": served_model_name}
            deltas, started = DeltaTracker(params.stop_strings), set()
            try:
                async for _, out in items:
                    for c in out.outputs:
                        k = c.index
                        if k not in started:
                            started.add(k)
                            yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}]})
                        step = deltas.advance(k, c)
                        if step is None:
                            continue
                        delta, t0, _, done = step
                        yield sse({**head, "choices": [{"index": k, "delta": {"content": delta} if delta else {},
                                                        "logprobs": lp_content(c, t0, len(c.token_ids)),
                                                        "finish_reason": c.finish_reason if done else None}]})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(len(ids), deltas.completion_tokens())})
                yield sse("[DONE]")
            except APIError as e:
                yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})

        return await run(request, [(None, ids, params)], stream, final, req.stream)

    # -- utility endpoints ----------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages")
        if req.messages is not None:
            text = tok().apply_chat_template([m.as_template_dict() for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt)
            ids = tok().encode(text, add_special_tokens=False)
        else:
            ids = tok().encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        if any(t < 0 or t >= engine.info.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {engine.info.vocab_size})", param="tokens")
        return {"prompt": tok().decode(req.tokens)}

    @app.get("/health")
    async def health():
        if engine.dead:
            return error_response(503, f"engine core is down: {engine.dead_reason}", "service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": cpuserve.__version__}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        metrics.update_stats(engine.stats)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    return app


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


async def _collect(items, final: dict) -> None:
    async for i, out in items:
        final[i] = out
