"""POST /v1/completions: one or many prompts (text or token ids), n choices each."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import APIRouter, Request

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.engine.outputs import CompletionOutput, RequestOutput
from cpuserve.entrypoints.openai import links
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import CompletionRequest, now, usage
from cpuserve.entrypoints.openai.serving import (ServerState, constraint, generate, prompt_logprobs_json,
                                                  sampling_params, server_state, truncated)
from cpuserve.entrypoints.openai.streaming import DeltaTracker, StreamUsage, sse

router = APIRouter()


@router.post("/v1/completions", operation_id="completions", responses=links.responses("completions"))
async def completions(req: CompletionRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model)
    refuse_unsupported(req)
    prompts = await asyncio.to_thread(tokenize_prompts, req.prompt, st.tokenizer)  # off the event loop
    check_prompt_ids(prompts, st.engine.info.vocab_size)  # before echo decodes them
    if req.truncate_prompt_tokens is not None:  # a cut prompt's text is its tokens' (echo decodes them)
        cut = [truncated(ids, req.truncate_prompt_tokens, st.engine.info.max_model_len) for _, ids in prompts]
        prompts = [(t if len(c) == len(ids) else None, c) for (t, ids), c in zip(prompts, cut)]
    if req.echo:  # the text echoed: token-id prompts decoded once here, not at every streamed token
        prompts = [(st.tokenizer.decode(ids) if t is None else t, ids) for t, ids in prompts]
    spec = await constraint(req)
    # echo with logprobs: the prompt's logprobs too; max_tokens 0 runs one token, never shown
    params = sampling_params(req.sampling_params, max(1, req.max_tokens) if req.max_tokens is not None else None,
                             req.logprobs, spec, req.logprobs if req.echo else None, defaults=st.defaults)
    view = CompletionView(st, params, req.stream_usage(st.force_usage), Echo(req.echo, req.max_tokens == 0),
                          req.prompt_logprobs, req.return_tokens_as_token_ids, req.model)
    return await generate(request, [(t, ids, params) for t, ids in prompts], view.stream, view.final, req.stream,
                          st.adapter(req.model))


def refuse_unsupported(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt back)", param="max_tokens")
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


def check_prompt_ids(prompts: list[tuple[str | None, list[int]]], vocab: int) -> None:
    """Token-id prompts hold ids of the vocabulary (the engine refuses others too, but echo and
    truncation handle the ids before it sees them: an id the tokenizer cannot decode was a 500)."""
    if any(t is None and (min(ids) < 0 or max(ids) >= vocab) for t, ids in prompts):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")


@dataclass(frozen=True)
class Echo:
    """`echo` (the prompt, and with logprobs its logprobs, before each choice's own) and max_tokens 0
    (the prompt alone: the one token the engine ran is not shown), as vLLM answers them."""
    on: bool = False
    prompt_only: bool = False

    def shown(self, out: RequestOutput, c: CompletionOutput) -> CompletionOutput:
        """The choice as the client sees it (an echoed request's prompt text is always given)."""
        if not self.on:
            return c
        prompt = out.prompt
        lps = None
        if c.logprobs is not None:
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        if self.prompt_only:
            return CompletionOutput(c.index, prompt, list(out.prompt_token_ids), "length" if c.finished else None,
                                    None, lps)
        return CompletionOutput(c.index, prompt + c.text, out.prompt_token_ids + c.token_ids, c.finish_reason,
                                c.stop_reason, None if lps is None else lps + c.logprobs)

    def generated(self, c: CompletionOutput) -> int:
        """The choice's tokens counted in usage (none where max_tokens was 0)."""
        return 0 if self.prompt_only else len(c.token_ids)


class CompletionView:
    """Renders engine outputs as text_completion objects, whole or as stream chunks.
    Choice index = prompt index * n + the completion's own index."""

    def __init__(self, st: ServerState, params: SamplingParams, stream_usage: StreamUsage = StreamUsage(),
                 echo: Echo = Echo(), prompt_top: int | None = None, tokens_as_ids: bool | None = None,
                 model: str | None = None):
        self.st, self.params, self.stream_usage, self.echo = st, params, stream_usage, echo
        self.model = st.model_name(model)  # the adapter the request named, else the served model
        self.prompt_top = prompt_top  # the request's prompt_logprobs: each choice carries its prompt's
        self.token_text = st.token_text(tokens_as_ids)
        self.created = now()

    def head(self, base: str) -> dict:
        return {"id": f"cmpl-{base}", "object": "text_completion", "created": self.created,
                "model": self.model}

    def logprobs(self, comp, start: int, end: int, offset0: int) -> dict | None:
        if comp.logprobs is None:
            return None
        name = self.token_text
        toks, lps, tops, offs, off = [], [], [], [], offset0
        for tid, entry in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
            text = name.text(tid)
            toks.append(name(tid, text))
            lps.append(None if entry is None else entry.get(tid))  # None: the prompt's first token
            top = [] if entry is None else sorted(entry.items(), key=lambda kv: -kv[1])[: self.params.logprobs]
            tops.append(None if entry is None else {name(t): lp for t, lp in top})
            offs.append(off)
            off += len(text)  # offsets into the text, whatever names the tokens
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def final(self, base: str, outs: list[RequestOutput]) -> dict:
        n = self.params.n
        shown = [(pi, self.echo.shown(out, c)) for pi, out in enumerate(outs) for c in out.outputs]
        choices = [{"index": pi * n + c.index, "text": c.text, "logprobs": self.logprobs(c, 0, len(c.token_ids), 0),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for pi, c in shown]
        if self.prompt_top is not None:
            prompts = [prompt_logprobs_json(o, self.prompt_top, self.st.tokenizer) for o in outs]
            for (pi, _), choice in zip(shown, choices):
                choice["prompt_logprobs"] = prompts[pi]
        return {**self.head(base), "choices": choices,
                "usage": usage(sum(len(o.prompt_token_ids) for o in outs),
                               sum(self.echo.generated(c) for o in outs for c in o.outputs),
                               self.st.cached(sum(o.num_cached_tokens for o in outs)))}

    async def stream(self, base: str, items):
        deltas, prompt_tokens, generated, cached = DeltaTracker(self.params.stop_strings), {}, {}, {}

        def counts() -> dict:
            return usage(sum(prompt_tokens.values()), sum(generated.values()), self.st.cached(sum(cached.values())))
        try:
            async for pi, out in items:
                prompt_tokens[pi], cached[pi] = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    key = pi * self.params.n + c.index
                    generated[key] = self.echo.generated(c)
                    c = self.echo.shown(out, c)
                    step = deltas.advance(key, c)
                    if step is None:
                        continue
                    delta, t0, offset, done = step
                    chunk = {"index": key, "text": delta, "logprobs": self.logprobs(c, t0, len(c.token_ids), offset),
                             "finish_reason": c.finish_reason if done else None,
                             "stop_reason": c.stop_reason if done else None}
                    so_far = {"usage": counts()} if self.stream_usage.every_chunk else {}
                    yield sse({**self.head(base), "choices": [chunk], **so_far})
            if self.stream_usage.final:
                yield sse({**self.head(base), "choices": [], "usage": counts()})
            yield sse("[DONE]")
        except APIError as e:
            yield sse(e.body())
