"""The paged KV cache of one rank: how many blocks it holds, whether they fit the
rank's NUMA node beside the weights, and the one allocation every attention
layer's keys and values are views of."""
from __future__ import annotations

import torch

from cpuserve.config import GiB, EngineConfig
from cpuserve.model_executor.parallel import TPGroup


def block_bytes(layers, kv_dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one block (keys and values of every layer) on this rank."""
    a = layers[0]
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * len(layers) * a.num_kv_heads * block_size * a.head_dim * elem


def largest_block_bytes(own: int, tp: TPGroup) -> int:
    """Every rank needs the same block count: size it by the largest shard."""
    if tp.size == 1:
        return own
    mine = torch.tensor([own], dtype=torch.int64)
    return int(tp.all_gather_last_dim(mine.view(1, 1), [1] * tp.size).max())


def num_blocks(config: EngineConfig, per_block: int) -> int:
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    else:
        n = int(config.kv_cache_space * GiB // per_block)
    if n < 1:
        raise ValueError(f"KV cache space of {config.kv_cache_space} GiB holds no block of "
                         f"{per_block / 2**20:.1f} MiB ({config.block_size} tokens); raise "
                         "VLLM_CPU_KVCACHE_SPACE / --kv-cache-space or lower --block-size")
    return n


def check_fits_node(rank: int, binding, weight_bytes: int, kv_bytes: int) -> None:
    """Refuses a rank whose weights and KV cache exceed its NUMA node's memory."""
    if binding is None or binding.mem_bytes is None:
        return
    total = weight_bytes + kv_bytes
    if total > binding.mem_bytes:
        raise ValueError(
            f"rank {rank} does not fit its NUMA node {binding.mem_node}: weights {weight_bytes / GiB:.2f} GiB + "
            f"KV cache {kv_bytes / GiB:.2f} GiB = {total / GiB:.2f} GiB, but the node has "
            f"{binding.mem_bytes / GiB:.2f} GiB. Lower VLLM_CPU_KVCACHE_SPACE (--kv-cache-space, GiB per rank), "
            "use a smaller dtype, or raise --tensor-parallel-size")


def allocate(layers, blocks: int, block_size: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """One tensor for every layer's keys and values, bound to the layers as views.
    Pages are touched as blocks fill, so memory is committed as it is used."""
    a = layers[0]
    cache = torch.empty((len(layers), 2, blocks, a.num_kv_heads, block_size, a.head_dim), dtype=kv_dtype)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
    return cache
