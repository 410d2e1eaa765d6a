"""Linear layers, Megatron-style sharded: column-parallel (output features split
across ranks), row-parallel (input features split, partial sums all-reduced),
and the fused QKV and gate/up projections. Weights are packed once for the
native GEMM; biases stay float32."""
from __future__ import annotations

import torch

from cpuserve import ops
from cpuserve.distributed import TPGroup, split_sizes


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
    def __init__(self, weight, bias, dtype, tp: TPGroup, shard: tuple[int, int] | None = None):
        start, n = shard if shard is not None else tp.shard(weight.shape[0], "output features")
        super().__init__(weight[start:start + n], None if bias is None else bias[start:start + n], dtype)


class RowParallelLinear(Linear):
    """Input features sharded; the bias is added once, after the all-reduce.
    `shard` (start, length) must match the sharding of what feeds it when that is
    not the default one (the attention output follows the heads' split)."""

    def __init__(self, weight, bias, dtype, tp: TPGroup, shard: tuple[int, int] | None = None):
        start, k = shard if shard is not None else tp.shard(weight.shape[1], "input features")
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

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None, dtype, tp: TPGroup,
                 shard: tuple[int, int] | None = None):
        parts, bparts = [], []
        for i, w in enumerate(weights):
            start, n = shard if shard is not None else tp.shard(w.shape[0], "output features")
            parts.append(w[start:start + n])
            if biases is not None and biases[i] is not None:
                bparts.append(biases[i][start:start + n])
        super().__init__(torch.cat(parts), torch.cat(bparts) if bparts else None, dtype)


def qkv_head_split(hq: int, hk: int, size: int) -> list[tuple[int, int, int, int]]:
    """(first q head, q heads, first kv head, kv heads) of every rank."""
    if hq % hk:
        raise ValueError(f"attention heads ({hq}) must be a multiple of kv heads ({hk})")
    g = hq // hk
    if hk >= size:
        out, k0 = [], 0
        for nk in split_sizes(hk, size):
            out.append((k0 * g, nk * g, k0, nk))
            k0 += nk
        return out
    if size % hk or hq % size:
        raise ValueError(f"tensor_parallel_size ({size}) must be a multiple of the kv heads ({hk}) "
                         f"and divide the attention heads ({hq})")
    nq = hq // size
    return [(r * nq, nq, r * hk // size, 1) for r in range(size)]


class QKVParallelLinear(Linear):
    """Fused q, k, v projections, split by whole GQA groups: each rank takes a
    balanced share of the kv heads and the query heads that attend to them (2 and
    1 groups of 3 query heads for 3 kv heads on two ranks). With fewer kv heads
    than ranks, each kv head is replicated on the ranks sharing its group.
    `o_range` is the matching (start, length) of the output projection's input."""

    def __init__(self, q, k, v, biases, head_dim: int, dtype, tp: TPGroup):
        hq, hk = q.shape[0] // head_dim, k.shape[0] // head_dim
        self.heads_per_rank = qkv_head_split(hq, hk, tp.size)
        q0, nq, k0, nk = self.heads_per_rank[tp.rank]
        self.head_dim, self.in_features = head_dim, q.shape[1]
        self.num_heads, self.num_kv_heads = nq, nk
        sel = [(q, q0, nq), (k, k0, nk), (v, k0, nk)]
        w = torch.cat([t[s * head_dim:(s + n) * head_dim] for t, s, n in sel])
        b = None
        if biases is not None:
            b = torch.cat([bb[s * head_dim:(s + n) * head_dim] for bb, (_, s, n) in zip(biases, sel)])
        super().__init__(w, b, dtype)
        self.q_size, self.kv_size = nq * head_dim, nk * head_dim
        self.o_range = (q0 * head_dim, nq * head_dim)

    def attention_weights_per_rank(self, out_features: int) -> list[int]:
        """Weights of q/k/v and of the output projection (out_features rows) on each rank."""
        return [(nq + 2 * nk) * self.head_dim * self.in_features + out_features * nq * self.head_dim
                for _, nq, _, nk in self.heads_per_rank]

    def split(self, qkv: torch.Tensor):
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size:self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size:]
        return q, k, v
