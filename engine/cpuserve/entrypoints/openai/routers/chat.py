"""POST /v1/chat/completions: the model's chat template, one conversation, n choices."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.engine.outputs import RequestOutput
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import ChatCompletionRequest, now, usage
from cpuserve.entrypoints.openai.serving import ServerState, constraint, generate, sampling_params, server_state
from cpuserve.entrypoints.openai.streaming import DeltaTracker, sse

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model)
    refuse_unsupported(req)
    ids = await asyncio.to_thread(render_conversation, req, st.tokenizer)  # off the event loop
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, st.engine.info.max_model_len - len(ids))
    top = req.top_logprobs if req.top_logprobs is not None else 0
    spec = await constraint(req)
    params = sampling_params(req.sampling_params, max_tokens, top if req.logprobs else None, spec)
    view = ChatView(st, params, top, len(ids), bool(req.stream_options and req.stream_options.include_usage))
    return await generate(request, [(None, ids, params)], view.stream, view.final, req.stream)


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")


def render_conversation(req: ChatCompletionRequest, tok) -> list[int]:
    """The conversation through the chat template, as token ids (a template error is the client's)."""
    try:
        text = tok.apply_chat_template([m.as_template_dict() for m in req.messages],
                                       add_generation_prompt=req.add_generation_prompt,
                                       chat_template=req.chat_template)
    except Exception as e:  # noqa: BLE001 - a template error is the client's input
        raise APIError(400, f"chat template failed: {e}", param="messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages")
    return ids


class ChatView:
    """Renders engine outputs as chat.completion objects, whole or as chunks."""

    def __init__(self, st: ServerState, params: SamplingParams, top: int, prompt_tokens: int, include_usage: bool):
        self.st, self.params, self.top = st, params, top
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
        self.created = now()

    def head(self, base: str, obj: str) -> dict:
        return {"id": f"chatcmpl-{base}", "object": obj, "created": self.created, "model": self.st.served_model_name}

    def logprobs(self, comp, start: int, end: int) -> dict | None:
        if comp.logprobs is None:
            return None
        tok, out = self.st.tokenizer, []
        for tid, entry in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
            s = tok.decode([tid])
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[: self.top]
            out.append({"token": s, "logprob": entry.get(tid), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (ts := tok.decode([t])), "logprob": lp,
                                          "bytes": list(ts.encode())} for t, lp in ranked]})
        return {"content": out}

    def final(self, base: str, outs: list[RequestOutput]) -> dict:
        out = outs[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c, 0, len(c.token_ids)), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {**self.head(base, "chat.completion"), "choices": choices,
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}

    async def stream(self, base: str, items):
        head = self.head(base, "chat.completion.chunk")
        deltas, started = DeltaTracker(self.params.stop_strings), set()
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
                                                    "logprobs": self.logprobs(c, t0, len(c.token_ids)),
                                                    "finish_reason": c.finish_reason if done else None}]})
            if self.include_usage:
                yield sse({**head, "choices": [], "usage": usage(self.prompt_tokens, deltas.completion_tokens())})
            yield sse("[DONE]")
        except APIError as e:
            yield sse(e.body())
