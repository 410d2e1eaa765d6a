"""The per-step forward context: what attention layers need besides their inputs.

Set by the model runner before a forward pass, read by the attention layers,
so that model forward() signatures stay (positions, hidden states).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    positions: torch.Tensor        # int64 [T]
    slot_mapping: torch.Tensor     # int64 [T]: cache slot of each token
    block_tables: torch.Tensor     # int32 [S, max_blocks]
    seq_lens: torch.Tensor         # int32 [S]: context length after this step
    query_start_loc: torch.Tensor  # int32 [S+1]: token offsets of each sequence
    logits_indices: torch.Tensor   # int64 [R]: tokens whose logits are sampled
    every_token_samples: bool = False  # R == T, every token's row in order: no gather of the rows
    lora: object | None = None     # model_executor.lora.LoRABatch: the adapters' rows; None: none adapted


_CONTEXT: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: attention layers run only inside ModelRunner.execute")
    return _CONTEXT
