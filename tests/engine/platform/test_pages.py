"""Pages of the long-lived allocations (platform/pages.py): the weights' huge-page arena (where
tensors land, that they stay valid once nothing but the tensor refers to the mapping, that the
model's weights are in mappings advised MADV_HUGEPAGE: the `hg` flag in /proc/self/smaps), and the
KV cache populated before use without a byte of it changed."""
from __future__ import annotations

import ctypes
import gc
import mmap

import pytest
import torch

from cpuserve.platform import pages


def mapping(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding address ptr."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and ":" not in head:
                if fields is not None:
                    return fields
                lo, hi = (int(x, 16) for x in head.split("-"))
                fields = {} if lo <= ptr < hi else None
            elif fields is not None:
                fields[head.rstrip(":")] = rest.strip()
    if fields is None:
        raise AssertionError(f"{ptr:#x} is in no mapping")
    return fields


def advised(ptr: int) -> bool:
    """Whether the mapping holding address ptr carries MADV_HUGEPAGE."""
    return "hg" in mapping(ptr)["VmFlags"].split()


def resident(ptr: int, nbytes: int) -> int:
    """Bytes of the pages overlapping [ptr, ptr + nbytes) that are in memory, by mincore(2): a
    mapping's Rss in smaps would count its neighbours too once the kernel merges them into one
    area (anonymous mappings side by side with the same flags are merged)."""
    lo = ptr - ptr % mmap.PAGESIZE
    pages_ = (ptr + nbytes - lo + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages_)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages_ * mmap.PAGESIZE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_huge_empty_starts_on_a_huge_page_and_outlives_its_names():
    t = pages.huge_empty(3 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 3 << 20
    assert t.data_ptr() % pages.HUGE == 0
    assert advised(t.data_ptr())
    v = t.view(torch.float32)
    del t
    gc.collect()
    v.fill_(2.0)  # the mapping is alive while a view of it is
    assert v.sum().item() == 2.0 * v.numel()


def test_not_advised_when_turned_off_or_left_for_idle_time():
    for mode in ("off", "idle"):
        arena = pages.HugeArena(mode=mode)
        assert not advised(arena.empty(1 << 20, torch.float32).data_ptr())
        assert (arena.collapser() is not None) == (mode == "idle")
    with pytest.raises(ValueError, match="huge-page mode must be start, idle or off, got 'on'"):
        pages.HugeArena(mode="on")


def test_arena_packs_tensors_on_cache_lines_and_opens_regions_as_needed():
    arena = pages.HugeArena(chunk=4 << 20, mode="start")
    a = arena.empty(10, torch.float32)   # 40 bytes -> the next starts a cache line later
    b = arena.empty(100, torch.bfloat16)
    assert b.data_ptr() - a.data_ptr() == 64 and a.data_ptr() % pages.HUGE == 0
    big = arena.empty(2 << 20, torch.uint8)  # over a quarter of a region: a mapping of its own
    c = arena.empty(16, torch.float32)
    assert c.data_ptr() == b.data_ptr() + 256 and big.data_ptr() % pages.HUGE == 0
    d = arena.empty((1 << 20) - 16, torch.uint8)
    e = arena.empty(1 << 20, torch.float32)  # does not fit what is left: a new region
    assert e.data_ptr() % pages.HUGE == 0 and e.data_ptr() != a.data_ptr()
    assert advised(a.data_ptr()) and advised(e.data_ptr()) and advised(big.data_ptr())
    del arena
    gc.collect()
    for t, x in ((a, 1), (b, 2), (c, 3), (d, 4), (e, 5), (big, 6)):
        t.fill_(x)
    assert a[0].item() == 1 and b[-1].item() == 2 and c[0].item() == 3 and d[-1].item() == 4 and e[-1].item() == 5


def test_the_models_weights_are_on_huge_pages_and_its_kv_cache_is_populated(llm_f32):
    runner = llm_f32.engine.runner
    layer = runner.model.layers[0]
    for packed in (layer.qkv.weight, layer.down.weight, runner.model.lm_head.weight):
        assert advised(packed.data.data_ptr())
    cache = runner.kv_cache
    nbytes = cache.numel() * cache.element_size()
    assert resident(cache.data_ptr(), nbytes) >= nbytes - 2 * mmap.PAGESIZE  # all but partial ends


def test_populating_commits_every_page_and_changes_no_byte():
    t = pages.huge_empty(96 << 20, advise=False)  # a fresh mapping of its own: nothing resident yet
    assert resident(t.data_ptr(), t.numel()) == 0
    written = torch.arange(0, t.numel(), 5 << 20)
    t[written] = 7  # a few pages already touched, with contents to keep
    assert pages.populate(t).startswith("populated in ")
    assert resident(t.data_ptr(), t.numel()) == t.numel()
    assert torch.all(t[written] == 7)


def test_populate_mode_from_the_environment_or_the_default():
    assert pages.populate_mode("idle", environ={}) == "idle"
    assert pages.populate_mode("start", environ={"CPUSERVE_KV_POPULATE": ""}) == "start"
    for raw, mode in (("1", "start"), ("0", "off"), ("Idle", "idle"), ("start", "start"), (" off ", "off")):
        assert pages.populate_mode("idle", environ={"CPUSERVE_KV_POPULATE": raw}) == mode
    with pytest.raises(ValueError, match="CPUSERVE_KV_POPULATE must be start, idle or off.*'later'"):
        pages.populate_mode("idle", environ={"CPUSERVE_KV_POPULATE": "later"})
    assert pages.hugepages_mode("idle", environ={"CPUSERVE_KV_POPULATE": "0"}) == "idle"
    for raw, mode in (("1", "start"), ("0", "off"), ("IDLE", "idle")):
        assert pages.hugepages_mode("start", environ={"CPUSERVE_HUGEPAGES": raw}) == mode
    with pytest.raises(ValueError, match="CPUSERVE_HUGEPAGES must be start, idle or off.*'yes'"):
        pages.hugepages_mode("idle", environ={"CPUSERVE_HUGEPAGES": "yes"})


def huge_bytes(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr, in bytes."""
    return int(mapping(ptr)["AnonHugePages"].split()[0]) * 1024


def idle_arena_tensors():
    """An `idle` arena with three 1 MiB tensors in a 4 MiB region (2 MiB pages: one full, one
    half used) and one of its own (5 MiB: three pages), written."""
    arena = pages.HugeArena(chunk=4 << 20, mode="idle")
    a, b = arena.empty(1 << 18, torch.float32), arena.empty(1 << 20, torch.uint8)
    big = arena.empty(5 << 18, torch.float32)
    c = arena.empty(1 << 18, torch.float32)
    for t, x in ((a, 1.5), (b, 7), (big, -2.0), (c, 3.0)):
        t.fill_(x)
    return arena.collapser(), (a, b, big, c)


def test_collapser_turns_weights_into_huge_pages_a_page_at_a_time_and_keeps_them():
    collapser, (a, b, big, c) = idle_arena_tensors()
    assert len(collapser.pages) == 2 + 3 and collapser.pending
    allowed = iter([True, True])
    collapser.run_while(lambda: next(allowed, False))  # two pages, then a request is waiting
    assert collapser.next == 2 and collapser.pending
    collapser.run_while(lambda: True)
    if collapser.error is None:  # Linux 6.1+: MADV_COLLAPSE
        assert not collapser.pending and collapser.spans == []
        assert huge_bytes(a.data_ptr()) >= 4 << 20 and huge_bytes(big.data_ptr()) >= 6 << 20
    else:
        assert advised(a.data_ptr()) and advised(big.data_ptr())
    assert torch.all(a == 1.5) and torch.all(b == 7) and torch.all(big == -2.0) and torch.all(c == 3.0)


def test_collapser_without_madv_collapse_leaves_the_weights_to_khugepaged(monkeypatch):
    import errno

    real = pages.madvise
    monkeypatch.setattr(pages, "madvise", lambda addr, n, advice: errno.EINVAL if advice == pages.MADV_COLLAPSE
                        else real(addr, n, advice))
    collapser, (a, b, big, c) = idle_arena_tensors()
    assert not advised(a.data_ptr()) and not advised(big.data_ptr())
    collapser.run_while(lambda: True)
    assert collapser.error == "Invalid argument" and not collapser.pending and collapser.next == 0
    assert advised(a.data_ptr()) and advised(big.data_ptr())
    assert torch.all(a == 1.5) and torch.all(b == 7) and torch.all(big == -2.0) and torch.all(c == 3.0)


def test_idle_work_runs_its_pieces_in_order_and_stops_for_a_request():
    from cpuserve.worker.idle import IdleWork

    class Piece:
        def __init__(self, name, slices, log):
            self.name, self.left, self.log = name, slices, log

        @property
        def pending(self):
            return self.left > 0

        def run_while(self, keep_going):
            while self.left and keep_going():
                self.left -= 1
                self.log.append(self.name)

    log: list[str] = []
    work = IdleWork(Piece("weights", 2, log), None, Piece("done", 0, log), Piece("kv", 3, log))
    assert len(work.pieces) == 2 and work.pending
    budget = iter([True] * 3)
    work.run_while(lambda: next(budget, False))
    assert log == ["weights", "weights", "kv"] and work.pending
    work.run_while(lambda: True)
    assert log == ["weights", "weights", "kv", "kv", "kv"] and not work.pending


def test_weight_bytes_count_each_arena_tensor_and_each_view_once():
    from cpuserve.worker.model_runner import tensor_bytes

    arena = pages.HugeArena()
    a, b = arena.empty(1000, torch.float32), arena.empty(10, torch.float32)  # 4,000 and 40 bytes
    plain = torch.empty(8, 16)
    model = {"a": a, "again": a[10:20], "b": [b, b.view(2, 5)], "plain": plain, "column": plain[:, 3]}
    assert tensor_bytes(model) == 4000 + 40 + 8 * 16 * 4
    assert tensor_bytes(plain[2:4]) == 2 * 16 * 4
