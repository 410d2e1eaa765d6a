"""The engine loop: requests in, one scheduled step at a time, outputs out."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from cpuserve.block_manager import BlockManager
from cpuserve.config import EngineConfig
from cpuserve.detokenizer import Detokenizer
from cpuserve.model_runner import ModelRunner
from cpuserve.outputs import CompletionOutput, RequestOutput
from cpuserve.sampling_params import SamplingParams
from cpuserve.scheduler import Scheduler
from cpuserve.sequence import FinishReason, Sequence
from cpuserve.tokenizer import load_tokenizer


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    detoks: list[Detokenizer] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = load_tokenizer(self.runner.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.resolve_batched_tokens(self.max_model_len), self.max_model_len,
                                   config.enable_chunked_prefill)
        self.eos_token_ids = self.runner.sampler.eos_token_ids
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        vocab = self.runner.model.lm_head.weight.n * 1  # rank-local; full vocab when tp == 1
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self.scheduler.check_admissible(len(ids), params.max_tokens)
        req = Request(request_id, text, ids, params)
        now = time.monotonic()
        for i in range(params.n):
            seq = Sequence(ids, params, request_id, i, now)
            seed = params.seed * 1_000_003 + i if params.seed is not None else self._rng.getrandbits(63)
            if not params.greedy:
                seq.generator = torch.Generator().manual_seed(seed)
            req.seqs.append(seq)
            req.detoks.append(Detokenizer(self.tokenizer, params.stop_strings, params.skip_special_tokens,
                                          params.include_stop_str_in_output))
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of the requests it touched."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (cache exhausted)")
            return []
        samplers, tokens, logprobs = self.runner.execute(batch)
        self.stats.steps += 1
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats.prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
        touched: dict[str, Request] = {}
        for seq, tok, lp in zip(samplers, tokens, logprobs):
            self._append_token(seq, tok, lp)
            req = self.requests.get(seq.request_id)
            if req is not None:
                touched[req.request_id] = req
        outputs = [self._output(r) for r in touched.values()]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _append_token(self, seq: Sequence, tok: int, lp: dict | None) -> None:
        seq.token_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
        self.stats.generation_tokens += 1
        p = seq.params
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        reason, stop_reason = None, None
        if may_stop and not p.ignore_eos and tok in self.eos_token_ids:
            reason = FinishReason.STOP
        elif may_stop and tok in p.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, tok
        req = self.requests[seq.request_id]
        det = req.detoks[seq.index]
        if reason is None:
            matched = det.update(seq.output_token_ids, check_stop=may_stop)
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
        else:  # the stop token stays in token_ids but not in the text (as vLLM)
            det.update(seq.output_token_ids[:-1], check_stop=False)
        if reason is None and p.max_tokens is not None and n_out >= p.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and len(seq) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason, stop_reason)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for seq, det in zip(req.seqs, req.detoks):
            outs.append(CompletionOutput(
                index=seq.index, text=det.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason, logprobs=list(seq.logprobs) if req.params.logprobs is not None else None))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             max(s.num_cached_tokens for s in req.seqs))

    # -- metrics --------------------------------------------------------------------
    def prefix_cache_stats(self) -> dict[str, int]:
        return {"queries": self.block_manager.prefix_queries, "hits": self.block_manager.prefix_hits}
