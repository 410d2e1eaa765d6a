"""What every generating route shares: the server's state, and one function that
starts an engine request per prompt and either streams the result or gathers it,
aborting the engine requests when the client goes away."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cpuserve.core.generation_config import SamplingDefaults
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.engine.async_engine import AsyncEngine, EngineDeadError, Overloaded, RequestRejected
from cpuserve.engine.outputs import RequestOutput
from cpuserve.entrypoints.openai import tools as tl
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.metrics import Metrics, RequestTimer
from cpuserve.entrypoints.openai.streaming import first_then_rest, merge
from cpuserve.structured import grammar
from cpuserve.structured.spec import GrammarSpec, SpecError

log = logging.getLogger("cpuserve.requests")


@dataclass(frozen=True)
class RequestLog:
    """vLLM's request logging: each engine request's prompt, token ids and parameters as it starts,
    and (outputs) its text, token ids and finish reason as it ends, each cut to max_len characters
    or ids. Prompts and outputs are the users' data: off by default."""
    max_len: int | None = None
    outputs: bool = False

    def cut(self, seq):
        return seq if self.max_len is None else seq[:self.max_len]

    def started(self, rid: str, text: str, ids: list[int], params: SamplingParams) -> None:
        log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", rid, self.cut(text), params,
                 self.cut(ids))

    def finished(self, rid: str, out: RequestOutput) -> None:
        if self.outputs:
            for c in out.outputs:
                log.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s",
                         rid, c.index, self.cut(c.text), self.cut(c.token_ids), c.finish_reason)


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    metrics: Metrics
    api_key: str | None = None
    draining: bool = False  # after SIGTERM: in-flight requests finish, new ones get 503
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" is served
    defaults: SamplingDefaults = SamplingDefaults()  # the model's generation config, set at start
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage names the cached tokens
    force_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: a request's return_tokens_as_token_ids default
    log_requests: RequestLog | None = None  # --enable-log-requests / --enable-log-outputs
    reasoning_parser: str | None = None  # --reasoning-parser: chat answers' reasoning_content (reasoning.py)
    aliases: tuple[str, ...] = ()  # --served-model-name's further names, which requests may use
    # LoRA adapters by name (--lora-modules, and those loaded at run time) -> their paths; a
    # request naming one as its model runs with it
    loras: dict[str, str] = field(default_factory=dict)

    def adapter(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, or None (the base model)."""
        return name if name and name in self.loras else None

    def model_name(self, name: str | None) -> str:
        """The model an answer names: the adapter the request ran with, else the served model."""
        return self.adapter(name) or self.served_model_name

    def token_text(self, as_ids: bool | None) -> TokenText:
        """How a request's logprobs name tokens: its return_tokens_as_token_ids, else the server's."""
        return TokenText(self.tokenizer, self.tokens_as_ids if as_ids is None else as_ids)

    def cached(self, tokens: int) -> int | None:
        """A usage's cached prompt tokens, where the server reports them."""
        return tokens if self.prompt_tokens_details else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer  # set once the engine core is ready

    def check_model(self, name: str | None, task: str | tuple[str, ...] | None = "generate") -> None:
        """404 for another model's name; 400 for a route the model's task (or tasks) does not serve
        (None: any)."""
        if name not in (None, "", self.served_model_name, *self.aliases, *self.loras):
            served = ", ".join(f"`{n}`" for n in (self.served_model_name, *self.aliases, *self.loras))
            raise APIError(404, f"the model `{name}` does not exist (served: {served})",
                           "not_found_error", "model")
        tasks = (task,) if isinstance(task, str) else task
        served = self.engine.info.task if self.engine.info is not None else tasks[0] if tasks else None
        if tasks is not None and served not in tasks:
            raise APIError(400, f"`{self.served_model_name}` is {_SERVES[served]}", param="model")


_SERVES = {"embed": "an embedding model: it serves POST /v1/embeddings, /v1/score and /v1/rerank",
           "classify": "a classification model (a cross-encoder): it serves POST /classify, /v1/score and "
                       "/v1/rerank",
           "generate": "a generative model: POST /v1/embeddings serves embedding models, such as "
                       "all-MiniLM-L6-v2, or a causal LM started with `--runner pooling`; /classify serves "
                       "*ForSequenceClassification checkpoints"}


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def sampling_params(make: Callable[..., SamplingParams], *args, **kwargs) -> SamplingParams:
    """A request's SamplingParams, or a 400 naming what is wrong with them."""
    try:
        return make(*args, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def constraint(req) -> GrammarSpec | None:
    """The request's output constraint, checked by the grammar engine off the event loop
    (a large grammar takes milliseconds to validate); a 400 naming the field otherwise."""
    try:
        spec = req.constraint()
    except SpecError as e:
        raise APIError(400, str(e), param=e.param) from None
    if spec is not None:
        msg = await asyncio.to_thread(grammar.validate, spec)
        if msg:
            raise APIError(400, f"invalid output constraint: {msg}", param=_field_of(req))
    return spec


async def output_constraint(req, st: ServerState, tools, mode: str, field: str) -> GrammarSpec | None:
    """What a chat or Responses answer is held to: the request's own format (`field`: the name it
    goes by in that API) or the grammar of an enforced tool call, never both (a 400); with a
    reasoning parser, only after the model's free reasoning block, as vLLM constrains the answer."""
    spec = await constraint(req)
    enforced = tl.constraint(tools, mode, req.parallel_tool_calls is not False)
    if enforced is not None and spec is not None:
        raise APIError(400, f"{field} cannot be combined with tool_choice 'required' or a named function (the "
                       "tool call's schema is the constraint)", param="tool_choice")
    structured = spec or enforced
    if structured is not None and st.reasoning_parser:
        structured = replace(structured, after_reasoning=st.reasoning_parser)
    return structured


def _field_of(req) -> str:
    return next((f for f in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                             "guided_choice", "guided_grammar", "text") if getattr(req, f, None) is not None),
                "response_format")


def rendered(req, tok, chat_template: str | None = None, **extra) -> str:
    """A request's conversation through the chat template; its mistakes (the template's errors,
    conflicting fields) as 400s naming the field."""
    try:
        return req.render(tok, [m.as_template_dict() for m in req.messages], chat_template, **extra)
    except Exception as e:  # noqa: BLE001 - a template error is the client's input
        msg = str(e)
        param = next((f for f in ("chat_template_kwargs", "continue_final_message") if msg.startswith(f)), "messages")
        raise APIError(400, msg if param != "messages" else f"chat template failed: {msg}", param=param) from None


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len's worth)."""
    if keep is None:
        return ids
    if keep == 0 or keep > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, max_model_len = {max_model_len}], got {keep}",
                       param="truncate_prompt_tokens")
    return ids[-(max_model_len if keep == -1 else keep):]


class TokenText:
    """How logprobs name a token: its text, or (vLLM's return_tokens_as_token_ids) "token_id:{id}",
    which a client can map back to the token where its text is not valid UTF-8 on its own (a
    byte-fallback piece of a multi-byte character) or is shared by several tokens."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, tid: int, text: str | None = None) -> str:
        """The token's name; `text`: its text where the caller has decoded it already."""
        if self.as_ids:
            return f"token_id:{tid}"
        return self.text(tid) if text is None else text

    def text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])


def prompt_logprobs_json(out, top: int, tokenizer) -> list[dict | None]:
    """vLLM's prompt_logprobs of a response: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}, the prompt token's own entry first with its rank in the distribution, then
    the `top` most likely (ranks 1..top); a logprob of -inf as -9999.0 (JSON has no infinities)."""
    ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_token_ids)
    shown: list[dict | None] = []
    for tid, entry, rank in zip(out.prompt_token_ids, out.prompt_logprobs or [], ranks):
        if entry is None:
            shown.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]  # the entry's top N are the row's
        listed = [(tid, entry[tid], rank)] + [(t, lp, r) for r, (t, lp) in enumerate(ranked, 1) if t != tid]
        shown.append({str(t): {"logprob": max(lp, -9999.0), "rank": r, "decoded_token": tokenizer.decode([t])}
                      for t, lp, r in listed})
    return shown


Prompt = tuple[str | None, list[int], SamplingParams]


async def generate(request: Request, prompts: list[Prompt], stream_fn, final_fn, stream: bool,
                   lora: str | None = None) -> Response:
    """Starts one engine request per prompt (with the LoRA adapter `lora`, if any). Streams through
    stream_fn(base_id, items), or gathers every final output and answers final_fn(base_id, outputs)."""
    st = server_state(request)
    base = f"{request.state.request_id}-{uuid.uuid4().hex[:8]}"
    vocab = st.engine.info.vocab_size
    most = st.engine.config.resolve_max_logprobs(vocab)
    for _, ids, params in prompts:
        err = params.vocab_error(vocab) or params.logprobs_error(most)
        if err:
            raise APIError(400, err[0], param=err[1])
        try:
            st.engine.check(len(ids), params)
        except RequestRejected as e:
            raise APIError(400, str(e), param="prompt") from None
    if st.engine.dead:
        raise APIError(503, f"engine is not available: {st.engine.dead_reason}", "service_unavailable")
    if st.log_requests is not None:
        for i, (text, ids, params) in enumerate(prompts):
            st.log_requests.started(f"{base}-{i}", st.tokenizer.decode(ids) if text is None else text, ids, params)
    gens = [track(st, st.engine.generate(f"{base}-{i}", text, ids, params, lora), f"{base}-{i}")
            for i, (text, ids, params) in enumerate(prompts)]
    if stream:
        return StreamingResponse(stream_fn(base, await first_then_rest(gens)), media_type="text/event-stream")
    final = await gather_unless_disconnected(request, gens)
    if final is None:
        return Response(status_code=499)
    return JSONResponse(final_fn(base, [final[i] for i in range(len(gens))]))


async def gather_unless_disconnected(request: Request, gens: list) -> dict[int, RequestOutput] | None:
    """Every generator's last output, or None when the client went away first (the
    generators are then cancelled, which aborts their engine requests)."""
    final: dict[int, RequestOutput] = {}
    watcher = asyncio.create_task(_watch_disconnect(request))
    try:
        collect = asyncio.create_task(_collect(merge(gens), final))
        done, _ = await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            return None
        collect.result()
    finally:
        watcher.cancel()
    return final


async def track(st: ServerState, gen: AsyncIterator[RequestOutput], rid: str) -> AsyncIterator[RequestOutput]:
    """Passes outputs through, timing tokens for the metrics, logging the finished output where
    asked (--enable-log-outputs), and turning engine errors into API errors."""
    timer = RequestTimer(st.metrics)
    seen, last = 0, None
    try:
        async for out in gen:
            n = sum(len(c.token_ids) for c in out.outputs)
            if n > seen:
                timer.token(out.queued_s)
                seen = n
            last = out
            yield out
    except (RequestRejected, Overloaded, EngineDeadError) as e:
        raise api_error(e, "prompt") from None
    finally:
        if last is not None and last.finished:
            timer.finish([c.finish_reason for c in last.outputs], len(last.prompt_token_ids),
                         sum(len(c.token_ids) for c in last.outputs))
            if st.log_requests is not None:
                st.log_requests.finished(rid, last)


def api_error(e: Exception, param: str) -> APIError:
    """An engine's refusal as the client sees it: 400 naming `param`, or 503."""
    if isinstance(e, RequestRejected):
        return APIError(400, str(e), param=param)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine failed: {e}", "service_unavailable")
    return APIError(503, str(e), "service_unavailable")


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


async def _collect(items, final: dict) -> None:
    async for i, out in items:
        final[i] = out
