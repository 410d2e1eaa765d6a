"""Continuous batching with a token budget, chunked prefill and preemption.

Each step: running sequences first, in arrival order (decodes take one token,
unfinished prefills take the next chunk), then waiting sequences in arrival
order while the token budget, the sequence cap and the free blocks allow. When
a running sequence cannot get a block, the most recently arrived running
sequence is preempted: its blocks are freed and it goes back to the front of
the queue, to be recomputed later (its finished prefix blocks usually come back
from the prefix cache). Waiting sequences are never overtaken (FCFS).

With chunked prefill, a step that decodes may be held to fewer prompt tokens
than its budget (max_prefill_tokens_while_decoding, as Sarathi-Serve's
stall-free batching): the decoding sequences then wait out one short step, not
one long one, for the prompts that join them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cpuserve.core.block_manager import BlockManager
from cpuserve.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # tokens computed for each seq this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


def admission_error(prompt_len: int, max_tokens: int | None, max_model_len: int, num_blocks: int, block_size: int,
                    chunked_prefill: bool, max_num_batched_tokens: int) -> str | None:
    """Why a request could never be served, or None. Pure: the API process asks it
    before sending a request, the engine core again on arrival."""
    if prompt_len >= max_model_len:
        return (f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                f"the model's maximum context length of {max_model_len} tokens")
    if not chunked_prefill and prompt_len > max_num_batched_tokens:
        return (f"the prompt has {prompt_len} tokens, more than max_num_batched_tokens "
                f"({max_num_batched_tokens}) with chunked prefill off")
    total = min(max_model_len, prompt_len + (max_tokens or max_model_len))
    need = (total + block_size - 1) // block_size
    if need > num_blocks:
        return (f"the request needs up to {total} tokens of KV cache ({need} blocks of {block_size}) but the whole "
                f"cache holds {num_blocks} blocks; raise the KV cache space (VLLM_CPU_KVCACHE_SPACE / "
                "--kv-cache-space) or lower max_tokens")
    return None


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 max_prefill_tokens_while_decoding: int | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.max_model_len = max_model_len
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission ------------------------------------------------------------------
    def check_admissible(self, prompt_len: int, max_tokens: int | None) -> None:
        """Raises ValueError for a request that could never be served."""
        err = admission_error(prompt_len, max_tokens, self.max_model_len, self.bm.num_blocks, self.bm.block_size,
                              self.chunked_prefill, self.max_num_batched_tokens)
        if err:
            raise ValueError(err)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------
    def prefill_budget(self) -> int:
        """Prompt tokens (new prompts, next chunks) this step may take: the whole token budget,
        or with chunked prefill max_prefill_tokens_while_decoding when a running sequence has
        one token to compute (it decodes)."""
        cap = self.max_prefill_tokens_while_decoding
        if cap and self.chunked_prefill and any(s.num_uncomputed == 1 for s in self.running):
            return min(cap, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget, prefill = self.max_num_batched_tokens, self.prefill_budget()

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            chunk = seq.num_uncomputed > 1  # the rest of a prompt (or of a recomputation)
            n = min(seq.num_uncomputed, budget, prefill if chunk else 1)
            if n == 0:  # no prompt tokens left this step: it waits, the decodes after it go on
                i += 1
                continue
            while not self.bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.bm.allocate_slots(seq, n)
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
                prefill -= n if chunk else 0
                i += 1
                continue
            break  # seq itself was preempted: nothing after it remains

        # 2. waiting sequences, in arrival order
        while self.waiting and min(budget, prefill) > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.bm.match_prefix(seq)
            uncomputed = len(seq) - len(prefix) * self.bm.block_size
            if uncomputed > budget and not self.chunked_prefill:
                break
            n = min(uncomputed, budget, prefill)
            if not self.bm.can_allocate(seq, n, prefix):
                break
            self.waiting.popleft()
            self.bm.allocate_prefix(seq, prefix)
            self.bm.allocate_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            prefill -= n
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.seqs:  # already given work this step: take it back
            j = batch.seqs.index(seq)
            del batch.seqs[j], batch.num_tokens[j]
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    # -- after the model ran --------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free_seq(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.bm.free_seq(seq)
