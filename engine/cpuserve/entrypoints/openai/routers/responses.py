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
from cpuserve.entrypoints.openai import reasoning as rs
from cpuserve.entrypoints.openai import tools as tl
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import ResponsesRequest, now
from cpuserve.entrypoints.openai.serving import (ServerState, generate, output_constraint, rendered, sampling_params,
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
    tools, mode = function_tools(req, st)
    ids = await asyncio.to_thread(render_input, req, st.tokenizer, tools)  # off the event loop
    structured = await output_constraint(req, st, tools, mode, "text.format")
    params = sampling_params(req.sampling_params, max(1, st.engine.info.max_model_len - len(ids)), structured,
                             st.defaults)
    view = ResponseView(st, req, params, len(ids), mode)
    return await generate(request, [(None, ids, params)], view.stream, view.final, req.stream,
                          st.adapter(req.model))


def function_tools(req: ResponsesRequest, st: ServerState) -> tuple[list | None, str]:
    """The request's function tools in chat's shape and the tool mode they are served in (tools.py)."""
    try:
        tools = req.chat_tools()
    except ValueError as e:
        raise APIError(400, f"invalid tools: {e}", param="tools") from None
    try:
        return tools, tl.resolve_choice(tools, req.chat_tool_choice(), st.tool_call_parser is not None)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None


def render_input(req: ResponsesRequest, tok, tools: list | None = None) -> list[int]:
    extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
    ids = tok.encode(rendered(req, tok, req.chat_template, **extra), add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered input is empty", param="input")
    return ids


class ResponseView:
    """Renders an engine request as a response object, whole or as its stream of events: a
    message of output_text, and the function calls the answer makes (tools.py finds them)."""

    def __init__(self, st: ServerState, req: ResponsesRequest, params: SamplingParams, input_tokens: int,
                 mode: str = "none"):
        self.st, self.req, self.params, self.input_tokens, self.mode = st, req, params, input_tokens, mode
        self.created = now()

    def tool_stream(self) -> tl.ToolStream:
        parser = tl.make_parser(self.st.tool_call_parser) if self.mode == "auto" else None
        return tl.ToolStream(self.mode, parser)

    def response(self, base: str, status: str, output: list | None = None, out: RequestOutput | None = None) -> dict:
        """The response object: in progress (no output yet), or done with its output items."""
        r = self.req
        incomplete = status == "incomplete"
        return {"id": f"resp_{base}", "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "model": self.st.model_name(self.req.model), "output": output or [],
                "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": None, "store": False, "temperature": self.params.temperature,
                "text": {"format": r.format}, "tool_choice": r.tool_choice or ("auto" if r.tools else "none"),
                "tools": r.tools or [], "top_p": self.params.top_p, "truncation": r.truncation or "disabled",
                "usage": None if out is None else self.usage(out), "user": r.user, "metadata": r.metadata or {}}

    def usage(self, out: RequestOutput) -> dict:
        n = len(out.outputs[0].token_ids)
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + n}

    @staticmethod
    def message(base: str, text: str, status: str) -> dict:
        return {"type": "message", "id": f"msg_{base}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def call_item(base: str, k: int, call: tl.ToolCall) -> dict:
        return {"type": "function_call", "id": f"fc_{base}_{k}", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}

    def parts(self, text: str) -> tuple[str | None, list[tl.ToolCall]]:
        """The answer's text (None where it is only calls) and its calls."""
        ts = self.tool_stream()
        try:
            content, _ = ts.push(text, done=True)
        except ValueError:  # an enforced call cut short by max_output_tokens: the text as it is
            return text, []
        return (content or None) if ts.calls else content, ts.calls

    @staticmethod
    def reasoning_item(base: str, text: str, status: str) -> dict:
        return {"type": "reasoning", "id": f"rs_{base}", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def final(self, base: str, outs: list[RequestOutput]) -> dict:
        out = outs[0]
        c = out.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        parser = self.st.reasoning_parser
        reasoning, answer = rs.split(parser, c.text) if parser else ("", c.text)
        text, calls = self.parts(answer)
        output = [self.reasoning_item(base, reasoning, status)] if reasoning else []
        if text is not None and (text or not reasoning):  # (a cut-short thought has no message)
            output.append(self.message(base, text, status))
        output += [self.call_item(base, k, call) for k, call in enumerate(calls)]
        return self.response(base, status, output, out)

    async def stream(self, base: str, items):
        events = ResponseEvents(self, base)
        yield events.send("response.created", response=self.response(base, "in_progress"))
        yield events.send("response.in_progress", response=self.response(base, "in_progress"))
        deltas, ts, last = DeltaTracker([]), self.tool_stream(), None
        thinking = rs.ReasoningStream(self.st.reasoning_parser) if self.st.reasoning_parser else None
        try:
            async for _, out in items:
                last = out
                step = deltas.advance(0, out.outputs[0])
                if step is None:
                    continue
                text, _, _, done = step
                reasoning, text = thinking.push(text, done) if thinking else ("", text)
                sent = "".join([*events.delta("reasoning", reasoning),
                                *events.delta("message", self.stream_text(ts, text, done))])
                if sent:
                    yield sent
        except APIError as e:
            yield events.send("error", code=e.type, message=e.message, param=e.param)
            return
        if last is None:  # (the engine ended the request without an output)
            yield events.send("error", code="server_error", message="the engine returned no output", param=None)
            return
        done = self.final(base, [last])
        yield "".join(events.finish(done))
        yield events.send(f"response.{done['status']}", response=done)

    @staticmethod
    def stream_text(ts: tl.ToolStream, text: str, done: bool) -> str:
        """The answer's text a step releases (what may be a call is held back by the tool stream)."""
        try:
            return ts.push(text, done)[0]
        except ValueError:  # an enforced call cut short: what is left goes out as text
            return ts.text[ts.sent:]


class ResponseEvents:
    """One response's events: its reasoning and its message opened as their first text arrives
    (the reasoning first, closed as the message opens), and at the end the message's done events
    and each function call's."""

    def __init__(self, view: ResponseView, base: str):
        self.view, self.base, self.events = view, base, EventStream()
        self.items: list[str] = []  # the kinds opened, in output order
        self.reasoning, self.reasoning_closed = "", False

    def send(self, kind: str, **fields) -> str:
        return self.events.send(kind, **fields)

    def at(self, kind: str) -> dict:
        return {"item_id": f"{'rs' if kind == 'reasoning' else 'msg'}_{self.base}",
                "output_index": self.items.index(kind), "content_index": 0}

    def delta(self, kind: str, text: str):
        if not text:
            return
        if kind not in self.items:
            if kind == "message":
                yield from self.close_reasoning()
            yield from self.open(kind)
        if kind == "reasoning":
            self.reasoning += text
            yield self.send("response.reasoning_text.delta", **self.at(kind), delta=text)
        else:
            yield self.send("response.output_text.delta", **self.at(kind), delta=text, logprobs=[])

    def open(self, kind: str):
        self.items.append(kind)
        if kind == "reasoning":
            item = {**self.view.reasoning_item(self.base, "", "in_progress"), "content": []}
            yield self.send("response.output_item.added", output_index=len(self.items) - 1, item=item)
            return
        item = {**self.view.message(self.base, "", "in_progress"), "content": []}
        yield self.send("response.output_item.added", output_index=len(self.items) - 1, item=item)
        yield self.send("response.content_part.added", **self.at(kind),
                        part={"type": "output_text", "text": "", "annotations": []})

    def close_reasoning(self):
        if "reasoning" in self.items and not self.reasoning_closed:
            self.reasoning_closed = True
            yield self.send("response.reasoning_text.done", **self.at("reasoning"), text=self.reasoning)
            yield self.send("response.output_item.done", output_index=self.items.index("reasoning"),
                            item=self.view.reasoning_item(self.base, self.reasoning, "completed"))

    def finish(self, done: dict):
        """The done events of every item of the finished response (done["output"], in its order)."""
        yield from self.close_reasoning()
        for k, item in enumerate(done["output"]):
            if item["type"] == "message":
                if "message" not in self.items:
                    yield from self.open("message")
                part = item["content"][0]
                yield self.send("response.output_text.done", **self.at("message"), text=part["text"], logprobs=[])
                yield self.send("response.content_part.done", **self.at("message"), part=part)
                yield self.send("response.output_item.done", output_index=k, item=item)
            elif item["type"] == "function_call":
                yield from self.call(k, item)

    def call(self, k: int, item: dict):
        yield self.send("response.output_item.added", output_index=k, item={**item, "arguments": "",
                                                                           "status": "in_progress"})
        yield self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                        delta=item["arguments"])
        yield self.send("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                        arguments=item["arguments"])
        yield self.send("response.output_item.done", output_index=k, item=item)


class EventStream:
    """Server-sent events as OpenAI's Responses API sends them: an `event:` line naming each, and
    its data numbered (sequence_number) in the order sent."""

    def __init__(self):
        self.sent = 0

    def send(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sent, **fields}
        self.sent += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
