"""How the model's two large, long-lived allocations get their pages.

Linux backs anonymous memory with 4 KiB pages, faulted in on first touch, unless a mapping
asks for more:
- **Packed GEMM weights on transparent huge pages** (MADV_HUGEPAGE; /sys/kernel/mm/
  transparent_hugepage/enabled is "madvise" on most distributions). A decode step streams every
  weight through the TLB; from 2 MiB pages the batch-1 float32 GEMVs over the default model
  read 2-3% faster (AMD EPYC, 2 CPUs). Weights are hundreds of tensors, most below 2 MiB, so
  they are placed one after another in 64 MiB regions (`HugeArena`). The cost is at load:
  the kernel zeroes (and may compact memory for) 2 MiB at a time, +0.5 s for float32's 540 MB.
- **The KV cache populated ahead of use** (MADV_POPULATE_WRITE, Linux 5.14+). Left to fault in
  as blocks fill, a 128-token float32 prefill took a page fault every 4 KiB of keys and values:
  1.7 ms of it, in every request until the whole cache had been through use once (the prefix
  cache's LRU order hands out every never-used block first). Populating all of it before the
  engine is ready (`start`: over the rank's OpenMP threads, 4 GiB in 0.66 s on one 2-CPU VM)
  cost another VM, whose host backs guest memory on first touch, 5.4-7.6 s of every start. So
  the server populates (`idle`, worker/kv_cache.py `Populator`) the cache's first 256 MiB before
  it is ready and the rest block by block, lowest block first (the order the block manager hands
  out never-used blocks), only after 50 ms without a request, a few MiB at a time, looking for a
  request between slices: work never waits on it for more than one slice. Populating from a
  background thread was tried before: on 2 CPUs it took one from the first seconds of work
  (offline bfloat16 throughput -20%). Huge pages for the cache were tried too: faulted in while
  serving, the kernel compacted memory for them in the request's time (11-14 ms a 128-token
  prefill), so the cache keeps 4 KiB pages.
CPUSERVE_HUGEPAGES=0 keeps the weights on 4 KiB pages; CPUSERVE_KV_POPULATE (start, idle, off)
overrides when the KV cache is populated: the offline `LLM` populates at start, the server when
idle.
"""
from __future__ import annotations

import mmap
import os
import time

import torch

HUGE = 2 << 20        # the x86-64 and arm64 (4 KiB granule) transparent huge page
CHUNK = 64 << 20      # an arena region
ALIGN = 64            # each tensor's start: a cache line, as torch.empty's


def enabled(environ=os.environ) -> bool:
    return environ.get("CPUSERVE_HUGEPAGES", "1") != "0"


def huge_empty(nbytes: int, advise: bool = True) -> torch.Tensor:
    """An uninitialized uint8 tensor of nbytes in its own anonymous mapping, starting on a 2 MiB
    boundary, the mapping advised MADV_HUGEPAGE. The tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if advise and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            pass
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes]


POPULATE_MODES = ("start", "idle", "off")


def populate_mode(default: str, environ=os.environ) -> str:
    """When the KV cache is populated: CPUSERVE_KV_POPULATE when set (start or 1, idle, off or
    0), else `default`."""
    raw = environ.get("CPUSERVE_KV_POPULATE", "").strip().lower()
    if not raw:
        return default
    mode = {"1": "start", "0": "off"}.get(raw, raw)
    if mode not in POPULATE_MODES:
        raise ValueError(f"CPUSERVE_KV_POPULATE must be start, idle or off (or 1 / 0), got {raw!r}")
    return mode


def populate_range(ptr: int, nbytes: int) -> str | None:
    """Faults in, for writing, the whole pages within [ptr, ptr + nbytes) (their contents
    untouched); None, or why the kernel refused (no MADV_POPULATE_WRITE before Linux 5.14)."""
    from cpuserve import _C

    err = _C.populate(ptr, nbytes)
    return os.strerror(err) if err else None


def populate(t: torch.Tensor) -> str:
    """Faults in every page of t's memory (their contents untouched) before it is used; says
    what was done, for the start-up log."""
    t0 = time.perf_counter()
    err = populate_range(t.data_ptr(), t.numel() * t.element_size())
    if err:
        return f"left to fault in as it is used (MADV_POPULATE_WRITE: {err})"
    return f"populated in {time.perf_counter() - t0:.2f} s"


class HugeArena:
    """Tensors placed one after another (each on a cache line) in 64 MiB huge-page regions; one
    larger than a quarter of a region gets a mapping of its own. A region is unmapped when the
    last tensor in it is freed."""

    def __init__(self, chunk: int = CHUNK, environ=os.environ):
        self.chunk, self.advise = chunk, enabled(environ)
        self.region: torch.Tensor | None = None
        self.used = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()  # (torch 1.13: no dtype.itemsize)
        if nbytes > self.chunk // 4:
            return huge_empty(nbytes, self.advise).view(dtype)
        if self.region is None or self.used + nbytes > self.chunk:
            self.region, self.used = huge_empty(self.chunk, self.advise), 0
        t = self.region[self.used:self.used + nbytes].view(dtype)
        self.used += -(-nbytes // ALIGN) * ALIGN
        return t
