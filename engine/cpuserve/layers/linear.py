"""Linear layers, Megatron-style sharded: column-parallel (output features split
across ranks), row-parallel (input features split, partial sums all-reduced),
and the fused QKV and gate/up projections. Weights are packed once for the
native GEMM; biases stay float32."""
from __future__ import annotations

import torch

from cpuserve import ops
from cpuserve.distributed import TPGroup


class Linear:
    """y = x @ W^T + b with W [N, K] stored packed in the model's weight dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.weight = ops.PackedWeight(weight.to(dtype))
        self.bias = bias.float().contiguous() if bias is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    def __init__(self, weight, bias, dtype, tp: TPGroup):
        start, n = tp.shard(weight.shape[0], "output features")
        super().__init__(weight[start:start + n], None if bias is None else bias[start:start + n], dtype)


class RowParallelLinear(Linear):
    """Input features sharded; the bias is added once, after the all-reduce."""

    def __init__(self, weight, bias, dtype, tp: TPGroup):
        start, k = tp.shard(weight.shape[1], "input features")
        super().__init__(weight[:, start:start + k], None, dtype)
        self.tp = tp
        self.full_bias = bias.float().contiguous() if bias is not None else None

    def __call__(self, x):
        y = self.tp.all_reduce(ops.linear(x, self.weight))
        if self.full_bias is not None:
            y += self.full_bias
        return y


class MergedColumnParallelLinear(Linear):
    """Several column-parallel projections of the same input in one GEMM (gate and up)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None, dtype, tp: TPGroup):
        parts, bparts = [], []
        for i, w in enumerate(weights):
            start, n = tp.shard(w.shape[0], "output features")
            parts.append(w[start:start + n])
            if biases is not None and biases[i] is not None:
                bparts.append(biases[i][start:start + n])
        super().__init__(torch.cat(parts), torch.cat(bparts) if bparts else None, dtype)


class QKVParallelLinear(Linear):
    """Fused q, k, v projections; query heads split across ranks, kv heads split
    (or replicated when there are fewer kv heads than ranks)."""

    def __init__(self, q, k, v, biases, head_dim: int, dtype, tp: TPGroup):
        hq, hk = q.shape[0] // head_dim, k.shape[0] // head_dim
        q0, nq = tp.shard(hq, "attention heads")
        if hk >= tp.size:
            k0, nk = tp.shard(hk, "kv heads")
        else:
            if tp.size % hk:
                raise ValueError(f"tensor_parallel_size ({tp.size}) must be a multiple of kv heads ({hk})")
            k0, nk = tp.rank * hk // tp.size, 1
        self.num_heads, self.num_kv_heads = nq, nk
        sel = [(q, q0, nq), (k, k0, nk), (v, k0, nk)]
        w = torch.cat([t[s * head_dim:(s + n) * head_dim] for t, s, n in sel])
        b = None
        if biases is not None:
            b = torch.cat([bb[s * head_dim:(s + n) * head_dim] for bb, (_, s, n) in zip(biases, sel)])
        super().__init__(w, b, dtype)
        self.q_size, self.kv_size = nq * head_dim, nk * head_dim

    def split(self, qkv: torch.Tensor):
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size:self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size:]
        return q, k, v
