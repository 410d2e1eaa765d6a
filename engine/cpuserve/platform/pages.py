"""How the model's two large, long-lived allocations get their pages.

Linux backs anonymous memory with 4 KiB pages, faulted in on first touch, unless a mapping
asks for more:
- **Packed GEMM weights on transparent huge pages** (/sys/kernel/mm/transparent_hugepage/
  enabled is "madvise" on most distributions). A decode step streams every weight through the
  TLB; from 2 MiB pages the batch-1 float32 GEMVs over the default model read 2-3% faster (AMD
  EPYC, 2 CPUs). Weights are hundreds of tensors, most below 2 MiB, so they are placed one after
  another in 64 MiB regions (`HugeArena`). The cost is the kernel finding (compacting memory
  for) and zeroing 2 MiB at a time: faulted in as huge pages during the load (`start`, MADV_
  HUGEPAGE before the weights are written: the offline `LLM`'s default) it took +0.5 s of
  float32's load on one VM, +1.1-1.3 s (2.2-2.5 s against 1.0-1.2 s) on the Zen 3 VM CI runs on.
  So the server loads them on 4 KiB pages and turns them into huge pages 2 MiB at a time while
  the engine is idle (`idle`: MADV_COLLAPSE, Linux 6.1+, 9-14 ms a 2 MiB page there, `Collapser`);
  a kernel without MADV_COLLAPSE gets the regions advised MADV_HUGEPAGE instead, for khugepaged
  to collapse in its own time.
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
  (offline bfloat16 throughput -20%).
- **The KV cache on huge pages, collapsed while idle** once every block is populated, as the
  weights are (`Collapser`). Attention reads every sequence's blocks from memory in each decode
  step, scattered over the cache: from 2 MiB pages a 16-row step's attention took 0.89x the time
  in float32 and 0.91x in bfloat16, the step 0.99x / 0.96x (AMD EPYC Zen 4, 2 CPUs). Faulted in as
  huge pages while serving, the kernel compacted memory for them in the request's time (11-14 ms
  a 128-token prefill), and faulted in at start a 1 GiB cache took 1.7-2.0 s instead of 0.2-0.4:
  so the offline `LLM`, which populates at start, keeps 4 KiB pages for it.
CPUSERVE_HUGEPAGES (start, idle, off) overrides when the weights get huge pages (off: the KV
cache gets none either) and CPUSERVE_KV_POPULATE (start, idle, off) when the KV cache is
populated: the offline `LLM` does both at start, the server while idle.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import time

import torch

log = logging.getLogger("cpuserve.platform")

HUGE = 2 << 20        # the x86-64 and arm64 (4 KiB granule) transparent huge page
CHUNK = 64 << 20      # an arena region
ALIGN = 64            # each tensor's start: a cache line, as torch.empty's


MADV_HUGEPAGE = 14    # (<asm-generic/mman-common.h>)
MADV_COLLAPSE = 25    # Linux 6.1+


def huge_empty(nbytes: int, advise: bool = True) -> torch.Tensor:
    """An uninitialized uint8 tensor of nbytes in its own anonymous mapping, starting on a 2 MiB
    boundary, the mapping advised MADV_HUGEPAGE (unless `advise` is false). The mapping holds
    every 2 MiB page the tensor touches whole. The tensor keeps the mapping alive."""
    whole_pages = -(-nbytes // HUGE) * HUGE
    m = mmap.mmap(-1, whole_pages + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    if advise:  # (an error: a kernel built without transparent huge pages; 4 KiB pages then)
        madvise(whole.data_ptr() + start, whole_pages, MADV_HUGEPAGE)
    return whole[start:start + nbytes]


POPULATE_MODES = ("start", "idle", "off")


def env_mode(name: str, default: str, environ=os.environ) -> str:
    """start, idle or off: the variable `name` when set (start or 1, idle, off or 0), else `default`."""
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    mode = {"1": "start", "0": "off"}.get(raw, raw)
    if mode not in POPULATE_MODES:
        raise ValueError(f"{name} must be start, idle or off (or 1 / 0), got {raw!r}")
    return mode


def populate_mode(default: str, environ=os.environ) -> str:
    """When the KV cache is populated: CPUSERVE_KV_POPULATE when set, else `default`."""
    return env_mode("CPUSERVE_KV_POPULATE", default, environ)


def hugepages_mode(default: str, environ=os.environ) -> str:
    """When the packed weights get huge pages: CPUSERVE_HUGEPAGES when set, else `default`."""
    return env_mode("CPUSERVE_HUGEPAGES", default, environ)


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
    """Tensors placed one after another (each on a cache line) in 64 MiB regions; one larger than
    a quarter of a region gets a mapping of its own. A region is unmapped when the last tensor in
    it is freed. `mode`: `start` advises each mapping MADV_HUGEPAGE before anything is written
    (faulted in as huge pages), `idle` leaves them on 4 KiB pages for `collapser()`, `off` too."""

    def __init__(self, chunk: int = CHUNK, mode: str = "start"):
        if mode not in POPULATE_MODES:
            raise ValueError(f"huge-page mode must be start, idle or off, got {mode!r}")
        self.chunk, self.mode = chunk, mode
        self.region: torch.Tensor | None = None
        self.used = 0
        self.spans: list[tuple[torch.Tensor, int]] = []  # `idle`: (2 MiB-aligned tensor, bytes used)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()  # (torch 1.13: no dtype.itemsize)
        advise = self.mode == "start"
        if nbytes > self.chunk // 4:
            t = huge_empty(nbytes, advise)
            self._keep(t, nbytes)
            return t.view(dtype)
        if self.region is None or self.used + nbytes > self.chunk:
            if self.region is not None:
                self._keep(self.region, self.used)
            self.region, self.used = huge_empty(self.chunk, advise), 0
        t = self.region[self.used:self.used + nbytes].view(dtype)
        self.used += -(-nbytes // ALIGN) * ALIGN
        return t

    def _keep(self, t: torch.Tensor, nbytes: int) -> None:
        if self.mode == "idle" and nbytes > 0:
            self.spans.append((t, nbytes))

    def collapser(self) -> Collapser | None:
        """`idle`: what turns every tensor placed so far into huge pages while the engine is idle."""
        if self.region is not None:
            self._keep(self.region, self.used)
            self.region = None
        spans, self.spans = self.spans, []
        return Collapser(spans) if spans else None


class Collapser:
    """Turns memory on 4 KiB pages (the weights as loaded, the KV cache as populated) into 2 MiB
    pages while the engine is idle, a huge page at a time in the order they were placed
    (MADV_COLLAPSE: the kernel copies each 2 MiB into a huge page it finds; the contents stay).
    The last, partly used page of a region is collapsed too: at most 2 MiB of zeros a region,
    as faulting huge pages in at load would have taken. A
    kernel without MADV_COLLAPSE (before 6.1) gets every span advised MADV_HUGEPAGE instead, for
    khugepaged to collapse in its own time; one out of huge pages, the same. `spans`: (tensor
    starting on a 2 MiB boundary, bytes of it to collapse); `what` names them in the log."""

    def __init__(self, spans: list[tuple[torch.Tensor, int]], what: str = "weights"):
        self.spans, self.what = spans, what  # (the spans keep the mappings alive until collapsed)
        self.pages = [t.data_ptr() + off for t, nbytes in spans for off in range(0, nbytes, HUGE)]
        self.next, self.seconds, self.error = 0, 0.0, None

    @property
    def pending(self) -> bool:
        return self.error is None and self.next < len(self.pages)

    def advance(self, count: int = 1) -> None:
        """Collapses the next `count` 2 MiB pages (fewer at the end)."""
        t0 = time.perf_counter()
        for addr in self.pages[self.next:self.next + count]:
            err = madvise(addr, HUGE, MADV_COLLAPSE)
            # EAGAIN: transient (a page busy, lock contention); EINVAL after a first success: a
            # page with nothing in it. Either way that page stays as it is. EINVAL on the first:
            # a kernel without MADV_COLLAPSE.
            if err == errno.EAGAIN or (err == errno.EINVAL and self.next > 0):
                err = 0
            if err:
                self._stop(err)
                return
            self.next += 1
        self.seconds += time.perf_counter() - t0

    def _stop(self, err: int) -> None:
        self.error = os.strerror(err)
        for t, nbytes in self.spans:
            madvise(t.data_ptr(), -(-nbytes // HUGE) * HUGE, MADV_HUGEPAGE)
        self.spans = []
        log.warning("%s: MADV_COLLAPSE stopped after %d of %d huge pages (%s); the rest are advised "
                    "MADV_HUGEPAGE for khugepaged", self.what, self.next, len(self.pages), self.error)

    def run_while(self, keep_going) -> None:
        """Collapses a huge page at a time while there are more and keep_going() says so."""
        did = False
        while self.pending and keep_going():
            self.advance()
            did = True
        if did and not self.pending and self.error is None:
            self.spans = []
            log.info("%s: %d MiB on huge pages (%.2f s of idle time)", self.what, len(self.pages) * HUGE >> 20,
                     self.seconds)



def madvise(addr: int, nbytes: int, advice: int) -> int:
    """madvise(2) on [addr, addr + nbytes): 0, or the errno."""
    libc = _libc()
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _LIBC
