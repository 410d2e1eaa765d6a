"""A scheduled batch turned into the flat tensors of one forward pass: token ids,
positions, cache slots, block tables and which tokens' logits are sampled."""
from __future__ import annotations

import array
from typing import NamedTuple

import torch

from cpuserve.core.scheduler import ScheduledBatch
from cpuserve.core.sequence import Sequence
from cpuserve.model_executor.context import ForwardContext


class PromptRows(NamedTuple):
    """Rows of a step whose logits give prompt logprobs: `count` rows of `seq` from flat row `row`
    on, at positions `pos`.. (each row's logits are the distribution of the prompt token after it)."""
    seq: Sequence
    row: int
    pos: int
    count: int


def prompt_logprob_rows(batch: ScheduledBatch) -> list[PromptRows]:
    """The rows of a step's sequences that ask for prompt logprobs (SamplingParams.prompt_logprobs)
    and run prompt tokens with a prompt token after them; their logits follow the samplers'."""
    rows, row = [], 0
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        count = min(start + n, seq.num_prompt_tokens - 1) - start
        if seq.params.prompt_logprobs is not None and count > 0:
            rows.append(PromptRows(seq, row, start, count))
        row += n
    return rows


def prepare_inputs(batch: ScheduledBatch, block_size: int) -> tuple[torch.Tensor, ForwardContext, list[Sequence]]:
    """(input ids, forward context, the sequences that sample this step). Each
    sequence contributes the `n` tokens scheduled after its computed ones; it
    samples when those reach the end of what it knows. The logits rows are the samplers' in
    order, then prompt_logprob_rows'."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    logits_idx: list[int] = []
    samplers: list[Sequence] = []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        end = start + n
        ids.extend(seq.token_ids[start:end])
        table = seq.block_table
        for pos in range(start, end):
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
        seq_lens.append(end)
        qsl.append(qsl[-1] + n)
        if end == len(seq):
            logits_idx.append(qsl[-1] - 1)
            samplers.append(seq)
    in_order = len(logits_idx) == len(ids)  # every row samples: the logits are every row's, in order
    for r in prompt_logprob_rows(batch):
        logits_idx.extend(range(r.row, r.row + r.count))
    t = len(ids)
    # two tensors made from lists and sliced (each torch.tensor of a list costs several
    # microseconds a decode step, its Python and torch state cold after the weights streamed)
    longs = torch.tensor(ids + positions + slots + logits_idx, dtype=torch.int64)
    ints = torch.tensor(seq_lens + qsl, dtype=torch.int32)
    n_seqs = len(seq_lens)
    ctx = ForwardContext(
        positions=longs[t:2 * t],
        slot_mapping=longs[2 * t:3 * t],
        block_tables=block_tables([s.block_table for s in batch.seqs]),
        seq_lens=ints[:n_seqs],
        query_start_loc=ints[n_seqs:],
        logits_indices=longs[3 * t:],
        every_token_samples=in_order,
    )
    return longs[:t], ctx, samplers


class DecodeInputs:
    """The inputs of decode-only steps kept from one step to the next (vLLM's persistent batch).

    While the same sequences decode one token each, a step rewrites a few numbers in place (token,
    position, slot, context length, and a block table row where it changed) through memoryviews
    of the buffers, instead of building tensors from lists: a step's first torch calls meet
    caches the weights have just streamed through, and prepare_inputs took about 100 us of a
    bfloat16 batch-1 step (7.7 ms; this, 15). Anything else (a prompt chunk, a sequence joining or
    leaving) goes through prepare_inputs and lays the buffers out anew at the next decode step.
    The tensors returned are reused: a step's inputs are read before the next step writes them.
    """

    HEADROOM = 16  # block table columns beyond the longest table, so that growing tables seldom re-lay out

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seqs: list[Sequence] = []  # the sequences the buffers are laid out for, in order
        self.tables: list[list[int] | None] = []  # each row's block table as last written

    def __call__(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardContext, list[Sequence]] | None:
        """prepare_inputs' answer for a batch of decode rows only (each sequence one token, its
        last), else None."""
        seqs = batch.seqs
        if batch.total_tokens != len(seqs) or not seqs:
            return None
        if len(seqs) != len(self.seqs) or any(a is not b for a, b in zip(seqs, self.seqs)):
            self._lay_out(seqs)
        bs, n, width = self.block_size, len(seqs), self.width
        longs, ints, bt = self.longs_mv, self.ints_mv, self.bt_mv
        for i, seq in enumerate(seqs):
            start = seq.num_computed_tokens
            if start + 1 != len(seq):
                return None  # a one-token prompt chunk: it does not sample
            table = seq.block_table
            if table != self.tables[i]:
                if len(table) > width:
                    self.seqs = []  # lay out wider at the next step
                    return None
                row = i * width
                bt[row:row + width] = array.array("i", table + [0] * (width - len(table)))
                self.tables[i] = list(table)
            longs[i] = seq.token_ids[start]
            longs[n + i] = start
            longs[2 * n + i] = table[start // bs] * bs + start % bs
            ints[i] = start + 1
        return self.ids, self.ctx, list(seqs)

    def _lay_out(self, seqs: list[Sequence]) -> None:
        n = len(seqs)
        self.width = max(len(s.block_table) for s in seqs) + self.HEADROOM
        longs = torch.zeros(4 * n, dtype=torch.int64)  # ids, positions, slots, logits rows
        ints = torch.zeros(2 * n + 1, dtype=torch.int32)  # context lengths, query starts
        longs[3 * n:] = torch.arange(n)
        ints[n:] = torch.arange(n + 1)
        bt = torch.zeros((n, self.width), dtype=torch.int32)
        self.longs_mv, self.ints_mv = memoryview(longs.numpy()), memoryview(ints.numpy())
        self.bt_mv = memoryview(bt.numpy().reshape(-1))
        self.seqs, self.tables = list(seqs), [None] * n
        self.ids = longs[:n]
        self.ctx = ForwardContext(positions=longs[n:2 * n], slot_mapping=longs[2 * n:3 * n], block_tables=bt,
                                  seq_lens=ints[:n], query_start_loc=ints[n:], logits_indices=longs[3 * n:],
                                  every_token_samples=True)


def block_tables(tables: list[list[int]]) -> torch.Tensor:
    """int32 [sequences, longest table], zero-padded."""
    width = max(len(t) for t in tables)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def scoring_inputs(token_ids: list[int], table: list[int], block_size: int) -> tuple[torch.Tensor, ForwardContext]:
    """One whole sequence in the given blocks, with logits at every position."""
    n = len(token_ids)
    ctx = ForwardContext(
        positions=torch.arange(n, dtype=torch.int64),
        slot_mapping=_slots(table, n, block_size),
        block_tables=torch.tensor([table], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        logits_indices=torch.arange(n, dtype=torch.int64),
        every_token_samples=True,
    )
    return torch.tensor(token_ids, dtype=torch.int64), ctx


def blocks_for(lengths: list[int], block_size: int) -> int:
    """Blocks that whole sequences of these lengths occupy, each starting on a block of its own."""
    return sum(-(-n // block_size) for n in lengths)


def packed_inputs(batch: list[list[int]], block_size: int) -> tuple[torch.Tensor, ForwardContext]:
    """Whole sequences prefilled together into consecutive blocks from block 0 (a scratch
    cache), with the logits index of each one's last token."""
    tables, start = [], 0
    for ids in batch:
        n = blocks_for([len(ids)], block_size)
        tables.append(list(range(start, start + n)))
        start += n
    lens = [len(ids) for ids in batch]
    qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ctx = ForwardContext(
        positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]),
        slot_mapping=torch.cat([_slots(t, n, block_size) for t, n in zip(tables, lens)]),
        block_tables=block_tables(tables),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=qsl,
        logits_indices=qsl[1:].to(torch.int64) - 1,
        every_token_samples=all(n == 1 for n in lens),
    )
    return torch.tensor([t for ids in batch for t in ids], dtype=torch.int64), ctx


def _slots(table: list[int], n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.int64)
    return torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
