"""The paged KV cache of one rank: how many blocks it holds, whether they fit the
rank's NUMA node beside the weights, and the one allocation every attention
layer's keys and values are views of."""
from __future__ import annotations

import logging
import mmap
import time

import torch

from cpuserve.config import DEFAULT_KV_CACHE_GIB, GiB, EngineConfig
from cpuserve.model_executor import ops
from cpuserve.model_executor.parallel import TPGroup
from cpuserve.platform import pages

log = logging.getLogger("cpuserve.worker")
PAGE = mmap.PAGESIZE


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


UNLIMITED = 1 << 60
TOO_LARGE = "ModelTooLarge"  # how the operator recognizes this refusal in a container's last words


def _own_memory_files(root: str) -> list[tuple[object, object]]:
    """(limit file, memory.stat) of this process's own memory cgroup (v2 or v1, through
    /proc/self/cgroup), then of the cgroup mount's root (a container sees its own there)."""
    from pathlib import Path

    base = Path(root) / "sys/fs/cgroup"
    out = []
    try:
        for line in (Path(root) / "proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                d = base / path.lstrip("/")
                out.append((d / "memory.max", d / "memory.stat"))
            elif "memory" in controllers.split(","):
                d = base / "memory" / path.lstrip("/")
                out.append((d / "memory.limit_in_bytes", d / "memory.stat"))
    except (OSError, ValueError):
        pass
    return out + [(base / "memory.max", base / "memory.stat"),
                  (base / "memory/memory.limit_in_bytes", base / "memory/memory.stat")]


def memory_budget(root: str = "/") -> tuple[int | None, int]:
    """(this process's cgroup memory limit in bytes or None when unlimited, the cgroup's anonymous
    memory now)."""
    for limit_f, usage_f in _own_memory_files(root):
        try:
            raw = limit_f.read_text().strip()
        except OSError:
            continue
        try:  # anonymous memory only: page cache (libraries, model files) is reclaimed before an OOM kill
            stat = dict(ln.split() for ln in usage_f.read_text().splitlines() if len(ln.split()) == 2)
            used = int(stat.get("anon", stat.get("total_rss", stat.get("rss", 0))))
        except (OSError, ValueError):
            used = 0
        return (int(raw) if raw.isdigit() and int(raw) < UNLIMITED else None), used
    return None, 0


def memory_limit(root: str = "/") -> int | None:
    return memory_budget(root)[0]


def check_fits_container(what: str, need: int, limit: int | None) -> None:
    """Refuses, before the kernel OOM-kills the engine, what cannot fit the container's memory
    limit: `need` bytes of `what` (model files before loading, weights + KV cache after)."""
    if limit is not None and need > limit:
        raise MemoryError(
            f"{TOO_LARGE}: {what} need {need / GiB:.2f} GiB, more than this container's memory limit of "
            f"{limit / GiB:.2f} GiB. Raise the limit (a CPUModelServer's is spec.engine.memoryGiB, else spec.model."
            "sizeGiB + engine.kvCacheGiB x ranks + engine.overheadGiB), or lower VLLM_CPU_KVCACHE_SPACE")


def runtime_reserve(hidden: int, intermediate: int, vocab: int, batched_tokens: int, max_seqs: int) -> int:
    """Memory a step needs beyond weights and KV cache: float32 activations of the largest
    step, three [rows, vocab] logit tensors for the sampler (logits, the processed copy,
    logprobs), and 256 MiB for allocator slack. Measured on SmolLM2 (2,048-token prefill,
    then 128 sequences sampling with logprobs): 180 MiB of growth after load; this gives 482."""
    activations = batched_tokens * (8 * hidden + 3 * intermediate) * 4
    logits = 3 * min(max_seqs, batched_tokens) * vocab * 4
    return activations + logits + (256 << 20)


def default_kv_bytes(limit: int | None, used: int, weights: int, reserve: int,
                     cap: float = DEFAULT_KV_CACHE_GIB, ranks: int = 1) -> tuple[int, str]:
    """The KV cache per rank when none was asked for: what the container's memory limit leaves
    after the memory in use, the weights and the runtime reserve (of every rank), shared by
    the ranks, at most `cap` GiB each (vLLM's 4). Returns (bytes, how it was computed, for
    the start-up log)."""
    top = int(cap * GiB)
    if limit is None:
        return top, f"{cap:g} GiB (the default; no container memory limit)"
    left = limit - used - weights - reserve
    how = (f"memory limit {limit / GiB:.2f} GiB - in use {used / GiB:.2f} - weights {weights / GiB:.2f} - "
           f"runtime reserve {reserve / GiB:.2f} = {left / GiB:.2f} GiB")
    if ranks > 1:
        how += f", / {ranks} ranks = {left / ranks / GiB:.2f} GiB each"
    if left <= 0:
        raise MemoryError(f"{TOO_LARGE}: no memory is left for a KV cache under this container's limit: {how}. "
                          "Raise the memory limit, or use a smaller dtype")
    return min(left // ranks, top), how + (f", capped at {cap:g} GiB" if left // ranks > top else "")


def process_baseline() -> int:
    """This process's own anonymous memory (interpreter, torch, runtime): what each further
    tensor-parallel rank, the same program, costs before its weights."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def allocate(layers, blocks: int, block_size: int, kv_dtype: torch.dtype, populate: str = "start",
             hugepages: bool = True) -> tuple[torch.Tensor, tuple]:
    """One tensor for every layer's keys and values, bound to the layers as views, and the work
    left for the engine's idle time (platform/pages.py): its pages populated all now (`start`),
    the first 256 MiB now and the rest while idle (`idle`: a Populator, then, with `hugepages`, a
    Collapser turning the whole cache into huge pages), or none (`off`: faulted in as blocks fill)."""
    a = layers[0]
    shape = (len(layers), 2, blocks, a.num_kv_heads, block_size, a.head_dim)
    collapse = populate == "idle" and hugepages
    if collapse:  # starting on a 2 MiB boundary, on 4 KiB pages until collapsed
        numel = torch.Size(shape).numel()
        raw = pages.huge_empty(numel * torch.empty((), dtype=kv_dtype).element_size(), advise=False)
        cache = raw.view(kv_dtype).view(shape)
    else:
        cache = torch.empty(shape, dtype=kv_dtype)
    size, populator = cache.numel() * cache.element_size(), None
    if populate == "start":
        how = pages.populate(cache)
    elif populate == "idle":
        populator = Populator(cache)
        t0 = time.perf_counter()
        populator.advance(populator.blocks_in(HEAD_BYTES))
        how = (f"{min(HEAD_BYTES, size) / 2**20:.0f} MiB populated in {time.perf_counter() - t0:.2f} s, "
               "the rest to be while the engine is idle")
    else:
        how = "left to fault in as it is used (CPUSERVE_KV_POPULATE=off)"
    log.info("KV cache of %.2f GiB: %s", size / GiB, how)
    k_shape, _ = ops.cache_shapes(blocks, a.num_kv_heads, block_size, a.head_dim)
    for i, layer in enumerate(layers):  # keys transposed in each block, bfloat16 paired (ops.cache_shapes)
        layer.k_cache, layer.v_cache = cache[i, 0].view(k_shape), cache[i, 1]
    idle = (populator,) if populator is not None and populator.pending else ()
    return cache, idle + ((pages.Collapser([(raw, size)], "KV cache"),) if collapse else ())


HEAD_BYTES = 256 << 20  # populated before an idle-populated cache is ready: the first requests' blocks
SLICE_BYTES = 8 << 20   # populated at a time while idle: what a request arriving meanwhile may wait for


class Populator:
    """Faults in a KV cache's pages a block range at a time, lowest block first: the order in
    which the block manager hands out blocks never used (its free queue starts in id order), so
    the blocks requests reach first are those populated first. Blocks already in use when their
    turn comes cost only a walk of their page tables."""

    def __init__(self, cache: torch.Tensor):
        elem = cache.element_size()
        self.cache = cache  # (its memory must outlive the pointers below)
        self.slices = [cache[i, j].data_ptr() for i in range(cache.shape[0]) for j in range(cache.shape[1])]
        self.num_blocks = cache.shape[2]
        self.block_slice = cache[0, 0, 0].numel() * elem  # one block of one layer's keys (or values)
        self.next, self.seconds, self.error = 0, 0.0, None

    @property
    def pending(self) -> bool:
        return self.error is None and self.next < self.num_blocks

    def blocks_in(self, nbytes: int) -> int:
        return max(1, nbytes // (self.block_slice * len(self.slices)))

    def advance(self, blocks: int) -> None:
        """Populates the next `blocks` blocks (fewer at the end) of every layer's keys and values."""
        t0 = time.perf_counter()
        lo, hi = self.next, min(self.num_blocks, self.next + blocks)
        for base in self.slices:
            # every page the range touches: one it shares with a neighbour (even one outside the
            # cache: mapped, since the cache has bytes on it) is populated by both, unchanged
            a, b = base + lo * self.block_slice, base + hi * self.block_slice
            a, b = a - a % PAGE, b + -b % PAGE
            self.error = pages.populate_range(a, b - a)
            if self.error:
                log.warning("KV cache: populating stopped at block %d (MADV_POPULATE_WRITE: %s); the rest "
                            "faults in as it is used", lo, self.error)
                return
        self.next = hi
        self.seconds += time.perf_counter() - t0

    def run_while(self, keep_going) -> None:
        """Populates a slice at a time while there is more and keep_going() says so."""
        step, did = self.blocks_in(SLICE_BYTES), False
        while self.pending and keep_going():
            self.advance(step)
            did = True
        if did and not self.pending and self.error is None:
            log.info("KV cache: every block populated (%.2f s of idle time)", self.seconds)
