"""POST /v1/chat/completions: the model's chat template, one conversation, n choices,
and tool calls (tools.py) found by the server's parser or enforced by the grammar."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.engine.outputs import RequestOutput
from cpuserve.entrypoints.openai import links
from cpuserve.entrypoints.openai import reasoning as rs
from cpuserve.entrypoints.openai import tools as tl
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import ChatCompletionRequest, now, usage
from cpuserve.entrypoints.openai.serving import (ServerState, generate, output_constraint, prompt_logprobs_json,
                                                  rendered, sampling_params, server_state, truncated)
from cpuserve.entrypoints.openai.streaming import DeltaTracker, sse

router = APIRouter()


@router.post("/v1/chat/completions", operation_id="chat_completions", responses=links.responses("chat_completions"))
async def chat_completions(req: ChatCompletionRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model)
    mode = tool_mode(req, st)
    ids = await asyncio.to_thread(render_conversation, req, st.tokenizer)  # off the event loop
    ids = truncated(ids, req.truncate_prompt_tokens, st.engine.info.max_model_len)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, st.engine.info.max_model_len - len(ids))
    top = req.top_logprobs if req.top_logprobs is not None else 0
    structured = await output_constraint(req, st, req.tools, mode, "response_format and guided_*")
    params = sampling_params(req.sampling_params, max_tokens, top if req.logprobs else None, structured,
                             defaults=st.defaults)
    view = ChatView(st, req, params, top, len(ids), mode)
    return await generate(request, [(None, ids, params)], view.stream, view.final, req.stream,
                          st.adapter(req.model))


def tool_mode(req: ChatCompletionRequest, st: ServerState) -> str:
    try:
        return tl.resolve_choice(req.tools, req.tool_choice, st.tool_call_parser is not None)
    except tl.ToolError as e:
        raise APIError(400, str(e), param=e.param) from None


def render_conversation(req: ChatCompletionRequest, tok) -> list[int]:
    """The conversation through the chat template, as token ids (a template error is the client's)."""
    extra = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
    text = rendered(req, tok, req.chat_template, **extra)
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages")
    return ids


class ChatView:
    """Renders engine outputs as chat.completion objects, whole or as chunks."""

    def __init__(self, st: ServerState, req: ChatCompletionRequest, params: SamplingParams, top: int,
                 prompt_tokens: int, mode: str = "none"):
        self.st, self.params, self.top, self.prompt_tokens, self.mode = st, params, top, prompt_tokens, mode
        self.model = st.model_name(req.model)  # the adapter the request named, else the served model
        self.stream_usage = req.stream_usage(st.force_usage)
        self.token_text = st.token_text(req.return_tokens_as_token_ids)
        self.prompt_top = req.prompt_logprobs  # the answer carries the prompt's
        self.echo = req.echoed
        self.created = now()

    def tool_stream(self) -> tl.ToolStream:
        parser = tl.make_parser(self.st.tool_call_parser) if self.mode == "auto" else None
        return tl.ToolStream(self.mode, parser)

    def finish_reason(self, ts: tl.ToolStream, reason: str | None) -> str | None:
        """'tool_calls' when a call ended the turn ('stop' for a named function, as OpenAI says)."""
        if ts.calls and reason == "stop" and not self.mode.startswith("function:"):
            return "tool_calls"
        return reason

    def message(self, c) -> tuple[dict, str | None]:
        parser = self.st.reasoning_parser
        reasoning, text = rs.split(parser, c.text) if parser else (None, c.text)
        thought = {} if parser is None else {"reasoning_content": reasoning or None}
        ts = self.tool_stream()
        try:
            content, _ = ts.push(text, done=True)
        except ValueError:  # an enforced call cut short by max_tokens: the text as it is
            return {"role": "assistant", "content": text, **thought}, c.finish_reason
        if ts.calls:
            body = content or None
        elif parser is not None and not content and not self.echo:
            body = None  # all of it was reasoning
        else:
            body = self.echo + content
        msg = {"role": "assistant", "content": body, **thought}
        if ts.calls:
            msg["tool_calls"] = [call.as_dict() for call in ts.calls]
        return msg, self.finish_reason(ts, c.finish_reason)

    def head(self, base: str, obj: str) -> dict:
        return {"id": f"chatcmpl-{base}", "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, comp, start: int, end: int) -> dict | None:
        if comp.logprobs is None:
            return None
        name, out = self.token_text, []
        for tid, entry in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
            s = name(tid)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[: self.top]
            out.append({"token": s, "logprob": entry.get(tid), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (ts := name(t)), "logprob": lp,
                                          "bytes": list(ts.encode())} for t, lp in ranked]})
        return {"content": out}

    def final(self, base: str, outs: list[RequestOutput]) -> dict:
        out = outs[0]
        choices = []
        for c in out.outputs:
            msg, reason = self.message(c)
            choices.append({"index": c.index, "message": msg, "logprobs": self.logprobs(c, 0, len(c.token_ids)),
                            "finish_reason": reason, "stop_reason": c.stop_reason})
        extra = {} if self.prompt_top is None else \
            {"prompt_logprobs": prompt_logprobs_json(out, self.prompt_top, self.st.tokenizer)}
        return {**self.head(base, "chat.completion"), "choices": choices,
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                               self.st.cached(out.num_cached_tokens)), **extra}

    async def stream(self, base: str, items):
        head = self.head(base, "chat.completion.chunk")
        deltas, tools, cached, thinking = DeltaTracker(self.params.stop_strings), {}, [0], {}

        def counts() -> dict:
            return usage(self.prompt_tokens, deltas.completion_tokens(), self.st.cached(cached[0]))

        def so_far() -> dict:
            return {"usage": counts()} if self.stream_usage.every_chunk else {}
        try:
            async for _, out in items:
                cached[0] = out.num_cached_tokens
                for c in out.outputs:
                    k = c.index
                    if k not in tools:
                        tools[k] = self.tool_stream()
                        if self.st.reasoning_parser:
                            thinking[k] = rs.ReasoningStream(self.st.reasoning_parser)
                        yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}], **so_far()})
                        if self.echo:
                            yield sse({**head, "choices": [{"index": k, "delta": {"content": self.echo},
                                                            "logprobs": None, "finish_reason": None}], **so_far()})
                    step = deltas.advance(k, c)
                    if step is None:
                        continue
                    text, t0, _, done = step
                    reasoning, text = thinking[k].push(text, done) if k in thinking else ("", text)
                    yield sse({**head, "choices": [{"index": k, **self.delta(tools[k], text, done, c, reasoning),
                                                    "logprobs": self.logprobs(c, t0, len(c.token_ids))}], **so_far()})
            if self.stream_usage.final:
                yield sse({**head, "choices": [], "usage": counts()})
            yield sse("[DONE]")
        except APIError as e:
            yield sse(e.body())

    def delta(self, ts: tl.ToolStream, text: str, done: bool, c, reasoning: str = "") -> dict:
        try:
            content, calls = ts.push(text, done)
        except ValueError:  # an enforced call cut short: what is left goes out as text
            content, calls = ts.text[ts.sent:], []
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return {"delta": delta, "finish_reason": self.finish_reason(ts, c.finish_reason) if done else None}
