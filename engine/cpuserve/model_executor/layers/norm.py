"""RMSNorm (native, optionally fused with the residual add) and LayerNorm."""
from __future__ import annotations

import torch

from cpuserve.model_executor import ops


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        # Gemma stores w - 1 and scales by (1 + w): fold the offset in once.
        self.weight = (weight.float() + offset).contiguous()
        self.eps = eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Per-head norm (QK-norm) of x [T, H*D], in place when x is contiguous."""
        t = x.shape[0]
        flat = x.reshape(-1, head_dim)
        out = ops.rms_norm(flat, self.weight, self.eps, out=flat if flat.data_ptr() == x.data_ptr() and
                           x.is_contiguous() else None)
        return out.view(t, -1)


class LayerNorm:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        self.weight = weight.float().contiguous()
        self.bias = bias.float().contiguous() if bias is not None else None
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
