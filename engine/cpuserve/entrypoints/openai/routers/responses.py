"""POST /v1/responses: OpenAI's Responses API over the same engine requests as chat, stateless
(protocol.ResponsesRequest says what is served). The answer is one assistant message of
output_text; streamed, the event sequence OpenAI sends (response.created ... response.completed,
each event numbered), text deltas as the engine produces them."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.engine.outputs import RequestOutput
from cpuserve.entrypoints.openai import links
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import ResponsesRequest, now
from cpuserve.entrypoints.openai.serving import (ServerState, constraint, generate, rendered, sampling_params,
                                                  server_state)
from cpuserve.entrypoints.openai.streaming import DeltaTracker

router = APIRouter()


@router.post("/v1/responses", operation_id="responses", responses=links.responses("responses"))
async def responses(req: ResponsesRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model)
    refused = req.unserved()
    if refused:
        raise APIError(400, refused[0], param=refused[1])
    ids = await asyncio.to_thread(render_input, req, st.tokenizer)  # off the event loop
    spec = await constraint(req)
    params = sampling_params(req.sampling_params, max(1, st.engine.info.max_model_len - len(ids)), spec, st.defaults)
    view = ResponseView(st, req, params, len(ids))
    return await generate(request, [(None, ids, params)], view.stream, view.final, req.stream)


def render_input(req: ResponsesRequest, tok) -> list[int]:
    ids = tok.encode(rendered(req, tok, req.chat_template), add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered input is empty", param="input")
    return ids


class ResponseView:
    """Renders an engine request as a response object, whole or as its stream of events."""

    def __init__(self, st: ServerState, req: ResponsesRequest, params: SamplingParams, input_tokens: int):
        self.st, self.req, self.params, self.input_tokens = st, req, params, input_tokens
        self.created = now()

    def response(self, base: str, status: str, text: str | None = None, out: RequestOutput | None = None) -> dict:
        """The response object: in progress (no output yet), or done with the message's text."""
        r = self.req
        c = out.outputs[0] if out is not None else None
        incomplete = c is not None and c.finish_reason == "length"
        output = [] if text is None else [self.message(base, text, "incomplete" if incomplete else "completed")]
        return {"id": f"resp_{base}", "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "model": self.st.served_model_name,
                "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": None, "store": False, "temperature": self.params.temperature,
                "text": {"format": r.format}, "tool_choice": "none", "tools": [],
                "top_p": self.params.top_p, "truncation": r.truncation or "disabled",
                "usage": None if c is None else self.usage(out), "user": r.user, "metadata": r.metadata or {}}

    def usage(self, out: RequestOutput) -> dict:
        n = len(out.outputs[0].token_ids)
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + n}

    @staticmethod
    def message(base: str, text: str, status: str) -> dict:
        return {"type": "message", "id": f"msg_{base}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def final(self, base: str, outs: list[RequestOutput]) -> dict:
        out = outs[0]
        c = out.outputs[0]
        return self.response(base, "incomplete" if c.finish_reason == "length" else "completed", c.text, out)

    async def stream(self, base: str, items):
        events = EventStream()
        part = {"type": "output_text", "text": "", "annotations": []}
        at = {"item_id": f"msg_{base}", "output_index": 0, "content_index": 0}
        yield events.send("response.created", response=self.response(base, "in_progress"))
        yield events.send("response.in_progress", response=self.response(base, "in_progress"))
        yield events.send("response.output_item.added", output_index=0,
                          item={**self.message(base, "", "in_progress"), "content": []})
        yield events.send("response.content_part.added", **at, part=part)
        deltas, last = DeltaTracker([]), None
        try:
            async for _, out in items:
                last = out
                step = deltas.advance(0, out.outputs[0])
                if step is not None and step[0]:
                    yield events.send("response.output_text.delta", **at, delta=step[0], logprobs=[])
        except APIError as e:
            yield events.send("error", code=e.type, message=e.message, param=e.param)
            return
        if last is None:  # (the engine ended the request without an output)
            yield events.send("error", code="server_error", message="the engine returned no output", param=None)
            return
        done, text = self.final(base, [last]), last.outputs[0].text
        yield events.send("response.output_text.done", **at, text=text, logprobs=[])
        yield events.send("response.content_part.done", **at, part={**part, "text": text})
        yield events.send("response.output_item.done", output_index=0, item=done["output"][0])
        yield events.send(f"response.{done['status']}", response=done)


class EventStream:
    """Server-sent events as OpenAI's Responses API sends them: an `event:` line naming each, and
    its data numbered (sequence_number) in the order sent."""

    def __init__(self):
        self.sent = 0

    def send(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sent, **fields}
        self.sent += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
