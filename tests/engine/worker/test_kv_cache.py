"""Sizing and allocating the paged KV cache, without a model: block bytes, block
count from the configured space, the NUMA-node fit check and its message."""
import mmap
from types import SimpleNamespace

import pytest
import torch

from cpuserve.config import GiB, EngineConfig
from cpuserve.model_executor.parallel import TPGroup
from cpuserve.platform import pages
from cpuserve.platform.binding import RankBinding
from cpuserve.worker import kv_cache
from tests.engine.platform.test_pages import resident


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
    cache, idle = kv_cache.allocate(ls, 4, 16, torch.bfloat16)
    assert cache.shape == (3, 2, 4, 2, 16, 8) and cache.dtype == torch.bfloat16 and idle == ()
    ls[2].v_cache.fill_(1.5)
    assert cache[2, 1].eq(1.5).all() and cache[2, 0].data_ptr() == ls[2].k_cache.data_ptr()


def fresh_cache(num_layers=2, blocks=64, kv_heads=3, block_size=16, head_dim=64, dtype=torch.bfloat16):
    """A KV-cache-shaped tensor in a mapping of its own, nothing resident, starting 64 bytes into
    a page: one block of one layer's keys is 6 KiB (bfloat16), so blocks share pages."""
    shape = (num_layers, 2, blocks, kv_heads, block_size, head_dim)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return pages.huge_empty(nbytes + 2 * mmap.PAGESIZE, advise=False)[64:64 + nbytes].view(dtype).view(shape)


def test_populator_goes_block_by_block_in_every_layer_and_changes_no_byte():
    cache = fresh_cache()
    cache[1, 1, 40].fill_(2.5)  # a block in use before its turn: kept as it is
    p = kv_cache.Populator(cache)
    assert p.block_slice == 3 * 16 * 64 * 2 and p.pending and p.blocks_in(1) == 1
    assert p.blocks_in(4 * p.block_slice * 10) == 10  # 4 slices: 2 layers' keys and values
    p.advance(10)
    assert p.next == 10 and p.pending
    for layer in range(2):
        for kv in range(2):
            s = cache[layer, kv]
            head, rest = s[:10], s[11:]
            assert resident(head.data_ptr(), head.numel() * 2) >= head.numel() * 2  # every page it touches
            lo = rest.data_ptr() + -rest.data_ptr() % mmap.PAGESIZE
            hi = (rest.data_ptr() + rest.numel() * 2) // mmap.PAGESIZE * mmap.PAGESIZE
            if (layer, kv) != (1, 1):  # (block 40 of layer 1's values was written)
                assert resident(lo, hi - lo) == 0  # no page beyond block 10's
    p.run_while(lambda: True)
    assert not p.pending and p.next == 64 and p.error is None
    assert resident(cache.data_ptr(), cache.numel() * 2) >= cache.numel() * 2
    assert cache[1, 1, 40].eq(2.5).all()


def test_populator_stops_when_told_and_when_the_kernel_refuses(monkeypatch):
    p = kv_cache.Populator(fresh_cache())
    monkeypatch.setattr(kv_cache, "SLICE_BYTES", 3 * p.block_slice * 4)  # 3 blocks' worth of 4 slices
    answers = iter([True, True, False])
    p.run_while(lambda: next(answers))
    assert p.next == 6 and p.pending
    monkeypatch.setattr(pages, "populate_range", lambda ptr, n: "Invalid argument")
    p.run_while(lambda: True)  # (an old kernel: no MADV_POPULATE_WRITE) the rest is left to fault in
    assert p.next == 6 and p.error == "Invalid argument" and not p.pending


@pytest.mark.parametrize("mode", ["start", "idle", "off"])
def test_allocate_populates_all_a_head_or_nothing(monkeypatch, mode):
    ls = layers(n=2, kv_heads=3, head_dim=64)
    block = 2 * 2 * 3 * 16 * 64 * 4  # every layer's keys and values of one float32 block
    monkeypatch.setattr(kv_cache, "HEAD_BYTES", 5 * block)
    cache, idle = kv_cache.allocate(ls, 300, 16, torch.float32, mode)  # 28 MiB
    assert cache.shape == (2, 2, 300, 3, 16, 64)
    if mode == "idle":  # the rest populated, then the whole cache collapsed into huge pages
        p, c = idle
        assert isinstance(p, kv_cache.Populator) and p.next == 5 and p.pending
        assert isinstance(c, pages.Collapser) and c.what == "KV cache" and cache.data_ptr() % pages.HUGE == 0
        assert c.pages == [cache.data_ptr() + i * pages.HUGE for i in range(-(-cache.numel() * 4 // pages.HUGE))]
    else:
        assert idle == ()
    if mode == "start":
        assert resident(cache.data_ptr(), cache.numel() * 4) >= cache.numel() * 4 - 2 * mmap.PAGESIZE


def test_idle_time_populates_the_cache_then_turns_it_into_huge_pages_and_keeps_every_byte(monkeypatch):
    from cpuserve.worker.idle import IdleWork
    from tests.engine.platform.test_pages import advised, huge_bytes

    monkeypatch.setattr(kv_cache, "HEAD_BYTES", 1 << 20)
    ls = layers(n=2, kv_heads=3, head_dim=64)
    cache, idle = kv_cache.allocate(ls, 700, 16, torch.bfloat16, "idle")  # 33 MiB: 17 huge pages
    nbytes = cache.numel() * 2
    assert [type(p) for p in idle] == [kv_cache.Populator, pages.Collapser]
    assert not advised(cache.data_ptr())
    ls[1].v_cache[650].fill_(-3.25)  # blocks in use before their turn
    ls[0].k_cache[3].fill_(0.5)
    work = IdleWork(*idle)
    budget = iter([True] * 2)
    work.run_while(lambda: next(budget, False))  # a request comes: the rest waits
    assert work.pending and idle[1].next == 0
    work.run_while(lambda: True)
    assert not work.pending and resident(cache.data_ptr(), nbytes) == nbytes
    if idle[1].error is None:  # Linux 6.1+: MADV_COLLAPSE
        assert huge_bytes(cache.data_ptr()) >= nbytes // pages.HUGE * pages.HUGE
    else:
        assert advised(cache.data_ptr())
    assert ls[1].v_cache[650].eq(-3.25).all() and ls[0].k_cache[3].eq(0.5).all()
    assert cache[0, 0, 4:].count_nonzero() == 0


def test_no_huge_pages_for_the_cache_when_they_are_turned_off():
    cache, idle = kv_cache.allocate(layers(n=2, kv_heads=3, head_dim=64), 700, 16, torch.bfloat16, "idle",
                                    hugepages=False)
    assert idle == ()  # (all 33 MiB populated before ready: no populator left either)
    cache, idle = kv_cache.allocate(layers(n=2, kv_heads=3, head_dim=64), 700, 16, torch.bfloat16, "idle")
    assert [type(p) for p in idle] == [pages.Collapser]
