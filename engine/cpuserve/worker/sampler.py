"""Turns the logits of the sequences that sample this step into next tokens.

Order of operations (as vLLM): allowed_token_ids (every other token masked), logit
bias, min_tokens (EOS and stop ids masked),
repetition / presence / frequency penalties, then greedy argmax, or temperature,
top-k, top-p, min-p and a draw from the sequence's own generator. A sequence with
an output constraint has every token its grammar does not allow masked out last
(when a request's own settings leave no allowed token, the grammar wins: min_tokens
cannot keep a finished JSON document open). Logprobs are those of the raw model
distribution (vLLM's default), with the top-N listed.
"""
from __future__ import annotations

import torch

from cpuserve.core.sequence import Sequence
from cpuserve.model_executor import ops
from cpuserve.structured import grammar


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=logits.shape[0])
        logits -= p.frequency_penalty * counts[: logits.shape[0]].float()
        logits -= p.presence_penalty * (counts[: logits.shape[0]] > 0).float()


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Extreme but valid parameters (a penalty of 1e-200, say) can overflow a logit:
    +inf becomes the largest float, NaN impossible; no request may break sampling."""
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def _filtered_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor | None:
    """The sampling distribution, or None when nothing is left to sample from."""
    p = seq.params
    logits = _finite(logits / p.temperature)
    if p.top_k and p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > p.top_p   # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    total = probs.sum()
    if not torch.isfinite(total) or total <= 0:
        return None
    return probs / total


def top_entry(row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """A position's logprobs entry: the token's own logprob, then the top n of the row (log-softmax)."""
    entry = {token: float(row[token])}
    if n > 0:
        top = torch.topk(row, n)
        for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
            entry.setdefault(tid, lp)
    return entry


def record_prompt_logprobs(logits: torch.Tensor, rows) -> None:
    """Appends each prompt token's logprobs (the raw model distribution, as vLLM's) to its sequence,
    and the token's rank in it (1: the most likely; 1 + the tokens more likely than it, as vLLM
    counts), from the logits of input_batch.prompt_logprob_rows in order: a row at position p gives
    the entry of prompt token p + 1. Only positions not yet recorded: a preempted sequence's
    recomputation does not record them twice."""
    at = 0
    for r in rows:
        lps = torch.log_softmax(logits[at:at + r.count].float(), dim=-1)
        at += r.count
        seq, n = r.seq, r.seq.params.prompt_logprobs
        toks = torch.tensor(seq.token_ids[r.pos + 1:r.pos + 1 + r.count])
        ranks = ((lps > lps.gather(1, toks[:, None])).sum(-1) + 1).tolist()
        for i in range(r.count):
            pos = r.pos + i + 1
            if pos == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(top_entry(lps[i], seq.token_ids[pos], n))
                seq.prompt_ranks.append(ranks[i])


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids
        self._masks: grammar.Masks | None = None  # made at the first constrained batch

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        """logits [R, V] float32 for the R sampling sequences -> (token ids, logprobs dicts)."""
        if self._plain_argmax(logits, seqs):
            return ops.argmax(logits).tolist(), [None] * len(seqs)
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        needs_processing = [self._processes(s) for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        raw = logits
        if any(needs_processing) or constrained:
            logits = logits.clone()
        for i, seq in enumerate(seqs):
            if needs_processing[i]:
                self._process(logits[i], seq)
                logits[i] = _finite(logits[i])
        if constrained:
            self._constrain(logits, raw, [(i, seqs[i].matcher) for i in constrained])

        tokens = ops.argmax(logits.float().contiguous()).tolist()  # greedy rows keep this (torch.argmax's answer)
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                probs = _filtered_probs(logits[i], seq)
                if probs is not None:  # else: every token masked out; keep the argmax
                    tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator).item())

        logprobs: list[dict | None] = []
        for i, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is None:
                logprobs.append(None)
                continue
            logprobs.append(top_entry(raw_logprobs[i], tokens[i], n))
        return tokens, logprobs

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor, rows: list[tuple[int, object]]) -> None:
        if self._masks is None:
            self._masks = grammar.Masks(logits.shape[-1], torch.get_num_threads())
        allowed = self._masks.fill([m for _, m in rows])
        idx = torch.tensor([i for i, _ in rows])
        sub = logits.index_select(0, idx)
        grammar.apply(sub, allowed)
        for j in torch.nonzero(~torch.isfinite(sub.max(dim=-1).values)).flatten().tolist():
            sub[j] = raw[rows[j][0]]  # the request's own masks left nothing: the grammar wins
            grammar.apply(sub[j], allowed[j])
        logits.index_copy_(0, idx, sub)

    def _plain_argmax(self, logits: torch.Tensor, seqs: list[Sequence]) -> bool:
        """Whether every row is the argmax of its raw logits (`plain`): one kernel call then, without
        the general path's passes over the rows, which cost a batch-1 step tens of microseconds with
        Python's caches cold after the weights streamed through them."""
        return logits.dtype == torch.float32 and logits.stride(-1) == 1 and self.plain(seqs)

    def plain(self, seqs: list[Sequence]) -> bool:
        """Whether every sequence's token is the argmax of its raw logits, with no logprobs: greedy
        with nothing to process or constrain (the model runner then asks the LM head for the
        argmax alone, layers/embedding.py LMHead.greedy)."""
        for s in seqs:
            if s.matcher is not None or s.params.logprobs is not None or not s.params.greedy or self._processes(s):
                return False
        return True

    def _processes(self, seq: Sequence) -> bool:
        p = seq.params
        return bool(p.logit_bias or p.allowed_token_ids or (p.min_tokens and seq.num_output_tokens < p.min_tokens)
                    or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)

    def _process(self, row: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if p.allowed_token_ids:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.long)
            kept = row[keep]
            row.fill_(float("-inf"))
            row[keep] = kept
        if p.logit_bias:
            for tid, bias in p.logit_bias.items():
                if 0 <= int(tid) < row.shape[0]:
                    row[int(tid)] += float(bias)
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            for tid in banned:
                if 0 <= tid < row.shape[0]:
                    row[tid] = float("-inf")
        _apply_penalties(row, seq)
