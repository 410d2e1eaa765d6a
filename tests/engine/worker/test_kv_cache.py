"""Sizing and allocating the paged KV cache, without a model: block bytes, block
count from the configured space, the NUMA-node fit check and its message."""
from types import SimpleNamespace

import pytest
import torch

from cpuserve.config import GiB, EngineConfig
from cpuserve.model_executor.parallel import TPGroup
from cpuserve.platform.binding import RankBinding
from cpuserve.worker import kv_cache


def layers(n=3, kv_heads=2, head_dim=8):
    return [SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim) for _ in range(n)]


def test_block_bytes_counts_keys_and_values_of_every_layer():
    assert kv_cache.block_bytes(layers(), torch.float32, 16) == 2 * 3 * 2 * 16 * 8 * 4
    assert kv_cache.block_bytes(layers(), torch.bfloat16, 16) == 2 * 3 * 2 * 16 * 8 * 2
    assert kv_cache.largest_block_bytes(1234, TPGroup()) == 1234


def test_num_blocks_from_space_or_explicit():
    per = kv_cache.block_bytes(layers(), torch.float32, 16)
    assert kv_cache.num_blocks(EngineConfig(kv_cache_space=1.0, block_size=16), per) == GiB // per
    assert kv_cache.num_blocks(EngineConfig(num_kv_blocks=5, block_size=16), per) == 5
    with pytest.raises(ValueError, match="holds no block.*VLLM_CPU_KVCACHE_SPACE"):
        kv_cache.num_blocks(EngineConfig(kv_cache_space=1e-9, block_size=16), per)


def test_fit_check_names_the_node_and_the_numbers():
    node = RankBinding(rank=1, cpus=(4, 5), num_threads=2, mem_node=1, mem_bytes=2 * GiB)
    kv_cache.check_fits_node(1, node, GiB, GiB // 2)             # fits
    kv_cache.check_fits_node(1, None, 10 * GiB, 10 * GiB)        # unbound: nothing to check
    with pytest.raises(ValueError, match=r"rank 1 does not fit its NUMA node 1: weights 1.00 GiB \+ "
                                         r"KV cache 1.50 GiB = 2.50 GiB, but the node has 2.00 GiB"):
        kv_cache.check_fits_node(1, node, GiB, 3 * GiB // 2)


def test_allocate_binds_views_to_the_layers():
    ls = layers()
    cache = kv_cache.allocate(ls, 4, 16, torch.bfloat16)
    assert cache.shape == (3, 2, 4, 2, 16, 8) and cache.dtype == torch.bfloat16
    ls[2].v_cache.fill_(1.5)
    assert cache[2, 1].eq(1.5).all() and cache[2, 0].data_ptr() == ls[2].k_cache.data_ptr()
