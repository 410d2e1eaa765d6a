"""POST /v1/completions: one or many prompts (text or token ids), n choices each."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.engine.outputs import RequestOutput
from cpuserve.entrypoints.openai import links
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import CompletionRequest, now, usage
from cpuserve.entrypoints.openai.serving import ServerState, constraint, generate, sampling_params, server_state
from cpuserve.entrypoints.openai.streaming import DeltaTracker, sse

router = APIRouter()


@router.post("/v1/completions", operation_id="completions", responses=links.responses("completions"))
async def completions(req: CompletionRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model)
    refuse_unsupported(req)
    prompts = await asyncio.to_thread(tokenize_prompts, req.prompt, st.tokenizer)  # off the event loop
    spec = await constraint(req)
    params = sampling_params(req.sampling_params, req.max_tokens, req.logprobs, spec)
    view = CompletionView(st, params, bool(req.stream_options and req.stream_options.include_usage))
    return await generate(request, [(t, ids, params) for t, ids in prompts], view.stream, view.final, req.stream)


def refuse_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of must equal n", param="best_of")


def tokenize_prompts(p, tok) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt: a string, strings, token ids, or lists of them."""
    if isinstance(p, str):
        prompts = [(p, tok.encode(p))]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [(x, tok.encode(x)) for x in p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [(None, list(p))]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [(None, list(x)) for x in p]
    else:
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token id list(s)",
                       param="prompt")
    if any(not ids for _, ids in prompts):
        raise APIError(400, "a prompt is empty", param="prompt")
    return prompts


class CompletionView:
    """Renders engine outputs as text_completion objects, whole or as stream chunks.
    Choice index = prompt index * n + the completion's own index."""

    def __init__(self, st: ServerState, params: SamplingParams, include_usage: bool):
        self.st, self.params, self.include_usage = st, params, include_usage
        self.created = now()

    def head(self, base: str) -> dict:
        return {"id": f"cmpl-{base}", "object": "text_completion", "created": self.created,
                "model": self.st.served_model_name}

    def logprobs(self, comp, start: int, end: int, offset0: int) -> dict | None:
        if comp.logprobs is None:
            return None
        tok = self.st.tokenizer
        toks, lps, tops, offs, off = [], [], [], [], offset0
        for tid, entry in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
            s = tok.decode([tid])
            toks.append(s)
            lps.append(entry.get(tid))
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.params.logprobs]
            tops.append({tok.decode([t]): lp for t, lp in top})
            offs.append(off)
            off += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def final(self, base: str, outs: list[RequestOutput]) -> dict:
        n = self.params.n
        choices = [{"index": pi * n + c.index, "text": c.text, "logprobs": self.logprobs(c, 0, len(c.token_ids), 0),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for pi, out in enumerate(outs) for c in out.outputs]
        return {**self.head(base), "choices": choices,
                "usage": usage(sum(len(o.prompt_token_ids) for o in outs),
                               sum(len(c.token_ids) for o in outs for c in o.outputs))}

    async def stream(self, base: str, items):
        deltas, prompt_tokens = DeltaTracker(self.params.stop_strings), {}
        try:
            async for pi, out in items:
                prompt_tokens[pi] = len(out.prompt_token_ids)
                for c in out.outputs:
                    key = pi * self.params.n + c.index
                    step = deltas.advance(key, c)
                    if step is None:
                        continue
                    delta, t0, offset, done = step
                    chunk = {"index": key, "text": delta, "logprobs": self.logprobs(c, t0, len(c.token_ids), offset),
                             "finish_reason": c.finish_reason if done else None,
                             "stop_reason": c.stop_reason if done else None}
                    yield sse({**self.head(base), "choices": [chunk]})
            if self.include_usage:
                yield sse({**self.head(base), "choices": [],
                           "usage": usage(sum(prompt_tokens.values()), deltas.completion_tokens())})
            yield sse("[DONE]")
        except APIError as e:
            yield sse(e.body())
