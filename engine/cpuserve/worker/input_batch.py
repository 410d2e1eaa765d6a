"""A scheduled batch turned into the flat tensors of one forward pass: token ids,
positions, cache slots, block tables and which tokens' logits are sampled."""
from __future__ import annotations

import torch

from cpuserve.core.scheduler import ScheduledBatch
from cpuserve.core.sequence import Sequence
from cpuserve.model_executor.context import ForwardContext


def prepare_inputs(batch: ScheduledBatch, block_size: int) -> tuple[torch.Tensor, ForwardContext, list[Sequence]]:
    """(input ids, forward context, the sequences that sample this step). Each
    sequence contributes the `n` tokens scheduled after its computed ones; it
    samples when those reach the end of what it knows."""
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
    )
    return longs[:t], ctx, samplers


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
    )
    return torch.tensor([t for ids in batch for t in ids], dtype=torch.int64), ctx


def _slots(table: list[int], n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.int64)
    return torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
