"""Turns the engine core's token outputs into RequestOutputs: incremental
detokenization and stop strings. In the server it runs in the API process, so
text work never competes with the model for the engine's cores."""
from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.engine.detokenizer import Detokenizer
from cpuserve.engine.outputs import CompletionOutput, RequestOutput, SeqOutput
from cpuserve.core.sampling_params import SamplingParams


@dataclass
class _Completion:
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    num_cached_tokens: int = 0
    queued_s: float | None = None
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    final_only: bool = False  # an output only once every completion finished (the offline LLM)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, final_only: bool = False) -> None:
        """final_only: the request's one output is its last (nothing streamed); without stop strings
        its text is then decoded once, when it finishes, not a window a token (whose cost, its
        caches cold after the model's weights streamed through them, was 80 us of a batch-1 step)."""
        comps = [_Completion(Detokenizer(self.tokenizer, params.stop_strings, params.skip_special_tokens,
                                         params.include_stop_str_in_output)) for _ in range(params.n)]
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, comps,
                                                 final_only=final_only)

    def abort_request(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)

    def process(self, outputs: list[SeqOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Returns the touched requests' outputs (finished ones are forgotten) and
        the (request, index) sequences the core must stop (a stop string matched)."""
        touched: dict[str, RequestState] = {}
        to_stop: list[tuple[str, int]] = []
        for out in outputs:
            st = self.requests.get(out.request_id)
            if st is None:
                continue
            comp = st.completions[out.index]
            if comp.finish_reason is not None:  # already stopped here; the core had not heard yet
                continue
            st.num_cached_tokens = max(st.num_cached_tokens, out.num_cached_tokens)
            if out.queued_s is not None and st.queued_s is None:
                st.queued_s = out.queued_s
            if out.prompt_logprobs is not None:
                st.prompt_logprobs, st.prompt_ranks = out.prompt_logprobs, out.prompt_ranks
            if out.token_id is not None:
                comp.token_ids.append(out.token_id)
                if out.logprobs is not None:
                    comp.logprobs.append(out.logprobs)
            touched[st.request_id] = st
            if st.final_only and not st.params.stop_strings:  # the text once, at the end
                if out.finish_reason is not None:
                    comp.detok.finish(comp.token_ids[:-1] if out.finish_reason == "stop" else comp.token_ids)
                    comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                continue
            if out.finish_reason == "stop":  # EOS or a stop token: kept in token_ids, not in text
                comp.detok.update(comp.token_ids[:-1], check_stop=False)
                comp.finish_reason, comp.stop_reason = "stop", out.stop_reason
            else:
                matched = comp.detok.update(comp.token_ids, check_stop=len(comp.token_ids) >= st.params.min_tokens)
                if matched is not None:
                    comp.finish_reason, comp.stop_reason = "stop", matched
                    if out.finish_reason is None:
                        to_stop.append((st.request_id, out.index))
                elif out.finish_reason is not None:
                    comp.finish_reason = out.finish_reason
        results = []
        for st in touched.values():
            if st.final_only and not st.finished:
                continue
            results.append(self.to_output(st))
            if st.finished:
                del self.requests[st.request_id]
        return results, to_stop

    @staticmethod
    def to_output(st: RequestState) -> RequestOutput:
        outs = [CompletionOutput(index=i, text=c.detok.text, token_ids=list(c.token_ids),
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 logprobs=list(c.logprobs) if st.params.logprobs is not None else None)
                for i, c in enumerate(st.completions)]
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, outs, st.finished, st.num_cached_tokens,
                             st.queued_s, st.prompt_logprobs, st.prompt_ranks)
