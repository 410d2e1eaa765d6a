"""Paged attention layer: writes this step's keys/values into the cache, then
attends every query token to its sequence's cached context."""
from __future__ import annotations

import torch

from cpuserve.model_executor import ops
from cpuserve.model_executor.context import get_context


class PagedAttention:
    @classmethod
    def for_qkv(cls, qkv, head_dim: int, scale: float, sliding_window: int = 0, softcap: float = 0.0):
        """The attention over a QKVParallelLinear's (possibly partial-group) heads."""
        return cls(qkv.num_heads, qkv.num_kv_heads, head_dim, scale, sliding_window, softcap, qkv.group,
                   qkv.q_head_offset)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int = 0, softcap: float = 0.0, group: int | None = None, q_head_offset: int = 0):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group, self.q_head_offset = group, q_head_offset  # a TP rank's slice of GQA (see QKVParallelLinear)
        self.scale, self.sliding_window, self.softcap = scale, sliding_window or 0, softcap or 0.0
        # [blocks, kv_heads, head_dim, block_size] (keys transposed; bfloat16 paired, ops.cache_shapes), bound by the runner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # a float8 cache holds k / k_scale and v / v_scale (vLLM's per-tensor scales; 1 unless the
        # checkpoint gives them)
        self.k_scale = self.v_scale = 1.0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        return ops.paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                                   ctx.query_start_loc, self.num_heads, self.scale, self.sliding_window,
                                   self.softcap, group=self.group, q_head_offset=self.q_head_offset,
                                   k_scale=self.k_scale, v_scale=self.v_scale)
