"""Linear layers, Megatron-style sharded: column-parallel (output features split
across ranks), row-parallel (input features split, partial sums all-reduced),
and the fused QKV and gate/up projections. Weights are packed once for the
native GEMM; biases stay float32."""
from __future__ import annotations

import torch

from cpuserve.loading.quant_tensor import cat_rows
from cpuserve.model_executor import ops
from cpuserve.model_executor.parallel import TPGroup, split_sizes


class Linear:
    """y = x @ W^T + b with W [N, K] stored packed in the model's weight dtype, or in
    its GGUF blocks when the checkpoint is quantized."""

    def __init__(self, weight, bias: torch.Tensor | None, dtype: torch.dtype):
        # GPTQ act-order: the weight's input features are stored permuted, and so must x be
        parts = weight if isinstance(weight, list) else [weight]
        self.in_perm = next((p.input_perm for p in parts if getattr(p, "input_perm", None) is not None), None)
        self.weight = ops.pack(weight, dtype)
        self.bias = bias.float().contiguous() if bias is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.n

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.in_perm is None else x.index_select(1, self.in_perm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(self.inputs(x), self.weight, self.bias)


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
        y = self.tp.all_reduce(ops.linear(self.inputs(x), self.weight))
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
        super().__init__(cat_rows(parts), torch.cat(bparts) if bparts else None, dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] projection of x, fused where the weight allows."""
        return ops.linear_silu(self.inputs(x), self.weight, self.bias)


def qkv_head_split(hq: int, hk: int, size: int) -> list[tuple[int, int, int, int]]:
    """(first q head, q heads, first kv head, kv heads) of every rank: query heads
    split as evenly as possible, each rank holding the kv heads its query heads
    use. A kv head whose group straddles two ranks is held by both (SmolLM2's 9
    query / 3 kv heads on two ranks: q 0-4 with kv 0-1, q 5-8 with kv 1-2)."""
    if hq % hk:
        raise ValueError(f"attention heads ({hq}) must be a multiple of kv heads ({hk})")
    if hq < size:
        raise ValueError(f"attention heads ({hq}) cannot be split across tensor_parallel_size={size} ranks")
    g = hq // hk
    out, q0 = [], 0
    for nq in split_sizes(hq, size):
        k0, k1 = q0 // g, (q0 + nq - 1) // g + 1
        out.append((q0, nq, k0, k1 - k0))
        q0 += nq
    return out


class QKVParallelLinear(Linear):
    """Fused q, k, v projections, split by qkv_head_split. `o_range` is the
    matching (start, length) of the output projection's input; `group` and
    `q_head_offset` tell the attention kernel which local kv head each local
    query head uses."""

    def __init__(self, q, k, v, biases, head_dim: int, dtype, tp: TPGroup):
        hq, hk = q.shape[0] // head_dim, k.shape[0] // head_dim
        self.heads_per_rank = qkv_head_split(hq, hk, tp.size)
        q0, nq, k0, nk = self.heads_per_rank[tp.rank]
        self.group, self.q_head_offset = hq // hk, q0 - k0 * (hq // hk)
        self.num_heads, self.num_kv_heads = nq, nk
        sel = [(q, q0, nq), (k, k0, nk), (v, k0, nk)]
        w = cat_rows([t[s * head_dim:(s + n) * head_dim] for t, s, n in sel])
        b = None
        if biases is not None:
            b = torch.cat([bb[s * head_dim:(s + n) * head_dim] for bb, (_, s, n) in zip(biases, sel)])
        super().__init__(w, b, dtype)
        self.q_size, self.kv_size = nq * head_dim, nk * head_dim
        self.o_range = (q0 * head_dim, nq * head_dim)

    def split(self, qkv: torch.Tensor):
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size:self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size:]
        return q, k, v
