"""Token embedding and the LM head (which may share its table)."""
from __future__ import annotations

import torch

from cpuserve.model_executor import ops
from cpuserve.model_executor.parallel import TPGroup


class Embedding:
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, scale: float | None = None):
        self.weight = weight.to(dtype).contiguous()
        # Gemma multiplies by sqrt(hidden) in the model dtype; keep that rounding.
        self.scale = scale

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.weight[input_ids]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x.float()


class LMHead:
    """Column-parallel over the vocabulary; logits gathered across ranks. (The
    embedding itself is replicated: a lookup is cheap, and a vocab-parallel one
    would cost an all-reduce per step.)"""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, tp: TPGroup, bias: torch.Tensor | None = None,
                 final_softcap: float | None = None):
        self.sizes = tp.sizes(weight.shape[0], align=64) if tp.size > 1 else [weight.shape[0]]
        start, n = sum(self.sizes[:tp.rank]), self.sizes[tp.rank]
        self.vocab_size = weight.shape[0]
        self.weight = ops.PackedWeight(weight[start:start + n].to(dtype))
        self.bias = bias[start:start + n].float().contiguous() if bias is not None else None
        self.tp = tp
        self.final_softcap = final_softcap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(ops.linear(x, self.weight, self.bias), self.sizes)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
