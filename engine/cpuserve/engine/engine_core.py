"""The engine core: scheduler + model runner + token-level stop conditions.

It speaks token ids only: no tokenizer, no text. Offline, LLMEngine runs it in
the same process; served, it runs in its own process (core_process.py) and the
API process turns its outputs into text (output_processor.py).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from cpuserve.core.block_manager import BlockManager
from cpuserve.config import EngineConfig
from cpuserve.worker.model_runner import ModelRunner
from cpuserve.engine.outputs import CoreStats, SeqOutput
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.core.scheduler import Scheduler
from cpuserve.core.sequence import FinishReason, Sequence


@dataclass
class _Request:
    seqs: list[Sequence] = field(default_factory=list)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.resolve_batched_tokens(self.max_model_len), self.max_model_len,
                                   config.enable_chunked_prefill, config.max_prefill_tokens_while_decoding)
        self.eos_token_ids = self.runner.sampler.eos_token_ids
        self.requests: dict[str, _Request] = {}
        self.stats = CoreStats()
        self._rng = random.Random(config.seed)
        self._grammars = None  # GrammarCompiler, made at the first constrained request

    # -- requests -------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that can never be served."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        err = params.vocab_error(self.vocab_size) or params.logprobs_error(
            self.config.resolve_max_logprobs(self.vocab_size))
        if err:
            raise ValueError(err[0])
        self.scheduler.check_admissible(len(prompt_token_ids), params.max_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival: float | None = None, lora: str | None = None) -> None:
        """`lora`: the name of a loaded LoRA adapter the request runs with (None: the base model)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if lora is not None and lora not in self.runner.loras:
            raise ValueError(f"no LoRA adapter {lora!r} is loaded (loaded: {sorted(self.runner.loras) or 'none'})")
        now = time.monotonic() if arrival is None else arrival
        req = _Request()
        for i in range(params.n):
            seq = Sequence(prompt_token_ids, params, request_id, i, now, lora,
                           self.runner.loras[lora].serial if lora is not None else 0)
            if params.structured is not None:
                seq.matcher = self._compiler().matcher(params.structured)
            if not params.greedy:
                seed = params.seed * 1_000_003 + i if params.seed is not None else self._rng.getrandbits(63)
                seq.generator = torch.Generator().manual_seed(seed)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def load_lora(self, name: str, path: str) -> None:
        """A LoRA adapter loaded at run time (the server's /v1/load_lora_adapter)."""
        if name in self.runner.loras:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        self.runner.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unloads an adapter no request is running with; its cached blocks are never matched again."""
        if name not in self.runner.loras:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        busy = sum(1 for r in self.requests.values() if any(s.lora == name for s in r.seqs))
        if busy:
            raise ValueError(f"the lora adapter '{name}' is in use by {busy} request(s)")
        self.runner.remove_lora(name)

    def _compiler(self):
        if self._grammars is None:
            from cpuserve.structured.grammar import GrammarCompiler
            self._grammars = GrammarCompiler(self.runner.model_dir, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req else ():
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """Ends one sequence early (a stop string matched in the output text)."""
        req = self.requests.get(request_id)
        if req is None or index >= len(req.seqs) or req.seqs[index].is_finished:
            return
        self.scheduler.finish(req.seqs[index], FinishReason.STOP)
        self._forget_if_done(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (cache exhausted)")
            return []
        now = time.monotonic()
        first_seen: dict[int, float] = {}
        for seq in batch.seqs:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                first_seen[seq.seq_id] = now - seq.arrival
        samplers, tokens, logprobs = self.runner.execute(batch)
        prompt_tokens = decode_rows = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            else:
                decode_rows += 1
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
        outputs = []
        for seq, tok, lp in zip(samplers, tokens, logprobs):
            # the prompt's logprobs, complete once the first token is sampled, go out with it
            first = seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0 and seq.index == 0
            reason, stop_reason = self._append_token(seq, tok, lp)
            outputs.append(SeqOutput(seq.request_id, seq.index, tok, lp, reason, stop_reason, seq.num_prompt_tokens,
                                     seq.num_cached_tokens, first_seen.get(seq.seq_id),
                                     seq.prompt_logprobs if first else None, seq.prompt_ranks if first else None))
            if reason is not None:
                self._forget_if_done(seq.request_id)
        self.stats.count_step(prompt_tokens, decode_rows, sum(batch.num_tokens), time.perf_counter() - t0)
        return outputs

    def _append_token(self, seq: Sequence, tok: int, lp: dict | None) -> tuple[str | None, int | None]:
        seq.token_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
        self.stats.generation_tokens += 1
        p = seq.params
        may_stop = seq.num_output_tokens >= p.min_tokens
        reason, stop_reason = None, None
        if may_stop and not p.ignore_eos and tok in self.eos_token_ids:
            reason = FinishReason.STOP
        elif may_stop and tok in p.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, tok
        elif seq.matcher is not None and self._grammar_done(seq, tok, self.eos_token_ids):
            reason = FinishReason.STOP
        elif p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            reason = FinishReason.LENGTH
        elif len(seq) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return None, None
        self.scheduler.finish(seq, reason, stop_reason)
        return reason.value, stop_reason

    @staticmethod
    def _grammar_done(seq: Sequence, tok: int, eos: set[int]) -> bool:
        """Advances the sequence's parser. A complete constraint allows only EOS next, so the
        sequence ends on that EOS (ignore_eos cannot outlast its grammar), and the text holds
        every token of the document; a broken parse (the mask makes it impossible) ends it too."""
        return not seq.matcher.consume_token(tok) or (tok in eos and seq.matcher.is_stopped())

    def _forget_if_done(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and all(s.is_finished for s in req.seqs):
            del self.requests[request_id]

    def snapshot_stats(self) -> CoreStats:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.block_manager.usage
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        s.num_preemptions = self.scheduler.num_preemptions
        s.startup_work_pending = self.runner.idle_work.pending
        if self.runner.loras:
            s.running_loras = tuple(sorted({q.lora for q in self.scheduler.running if q.lora}))
            s.waiting_loras = tuple(sorted({q.lora for q in self.scheduler.waiting if q.lora}))
        return s
