"""Token embedding and the LM head (which may share its table)."""
from __future__ import annotations

import torch

from cpuserve.model_executor import ops
from cpuserve.model_executor.parallel import TPGroup


class Embedding:
    """A lookup table, dense in the model dtype, or in its GGUF blocks (rows dequantized
    per lookup; the same packed blocks can serve a tied LM head, see `shared_head`)."""

    def __init__(self, weight, dtype: torch.dtype, scale: float | None = None):
        if isinstance(weight, torch.Tensor):
            self.weight = weight.to(dtype).contiguous()
        else:  # in its blocks, on the int8-dot GEMM's panels within ops.quantized_activations("int8")
            self.weight = ops.pack(weight, dtype)
        # Gemma multiplies by sqrt(hidden) in the model dtype; keep that rounding.
        self.scale = scale

    def shared_head(self, tp: TPGroup):
        """The packed table for a tied LM head when the head can use it as is (quantized,
        one rank), else None (the head packs its own)."""
        return self.weight if ops.is_quantized(self.weight) and tp.size == 1 else None

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if ops.is_quantized(self.weight):
            x = ops.dequantized_rows(self.weight, input_ids.reshape(-1)).reshape(*input_ids.shape, -1)
            return x * torch.tensor(self.scale, dtype=x.dtype) if self.scale is not None else x
        x = self.weight[input_ids]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x.float()


class LMHead:
    """Column-parallel over the vocabulary; logits gathered across ranks. (The
    embedding itself is replicated: a lookup is cheap, and a vocab-parallel one
    would cost an all-reduce per step.)"""

    def __init__(self, weight, dtype: torch.dtype, tp: TPGroup, bias: torch.Tensor | None = None,
                 final_softcap: float | None = None, packed=None):
        self.sizes = tp.sizes(weight.shape[0], align=64) if tp.size > 1 else [weight.shape[0]]
        start, n = sum(self.sizes[:tp.rank]), self.sizes[tp.rank]
        self.vocab_size = weight.shape[0]
        self.weight = packed if packed is not None else ops.pack(weight[start:start + n], dtype)
        self.bias = bias[start:start + n].float().contiguous() if bias is not None else None
        self.tp = tp
        self.final_softcap = final_softcap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(ops.linear(x, self.weight, self.bias), self.sizes)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
