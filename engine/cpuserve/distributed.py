"""The tensor-parallel group of this process: its rank, the group size, and the
shared-memory all-reduce / all-gather the sharded layers call.

Shards are balanced, not required to divide evenly: SmolLM2-135M has 9 query
and 3 KV heads, so two ranks take 2 and 1 KV-head groups (6 and 3 query heads),
where Megatron-style code would refuse to run it on two ranks at all.
"""
from __future__ import annotations

import time

import torch


def split_sizes(total: int, parts: int, align: int = 1) -> list[int]:
    """Sizes of `parts` contiguous shards of `total` items, as equal as possible in
    units of `align` items (the last shard takes any remainder), larger first."""
    units, rest = divmod(total, align)
    base, extra = divmod(units, parts)
    sizes = [(base + (1 if r < extra else 0)) * align for r in range(parts)]
    sizes[-1] += rest
    return sizes


def balanced_split(total: int, fixed: list[float], unit: float, align: int = 1) -> list[int]:
    """Splits `total` items (each costing `unit`) between ranks that already carry
    `fixed` cost, so that fixed + items x unit comes out as even as possible, in
    multiples of `align` (any remainder to the least loaded rank). Equal `fixed`
    gives split_sizes. Used to give the MLP of a rank with fewer attention heads
    more features: per-rank weight bytes, hence decode time, stay equal."""
    n = len(fixed)
    if total < n * align:
        align = 1
    active = list(range(n))
    while True:  # water-filling: ranks already above the level get nothing
        level = (sum(fixed[r] for r in active) + total * unit) / len(active)
        over = [r for r in active if fixed[r] > level]
        if not over:
            break
        active = [r for r in active if r not in over]
    want = [(level - fixed[r]) / unit if r in active else 0.0 for r in range(n)]
    sizes = [int(w // align) * align for w in want]
    cost = lambda r: fixed[r] + sizes[r] * unit  # noqa: E731
    while total - sum(sizes) >= align:  # hand out the rounded-off units to the least loaded
        sizes[min(range(n), key=cost)] += align
    sizes[min(range(n), key=cost)] += total - sum(sizes)
    if min(sizes) == 0 and total >= n:  # never leave a rank without a shard
        return split_sizes(total, n, align)
    return sizes


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, comm=None):
        if size > 1 and comm is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a communicator")
        self.rank, self.size, self.comm = rank, size, comm
        self.comm_seconds = 0.0   # time inside all-reduce/all-gather, waiting for other ranks included
        self.comm_calls = 0

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    # -- sharding --------------------------------------------------------------------
    def sizes(self, total: int, align: int = 1) -> list[int]:
        if total < self.size:
            raise ValueError(f"cannot split {total} items across {self.size} ranks")
        return split_sizes(total, self.size, align if total >= align * self.size else 1)

    def balanced_shard(self, total: int, fixed: list[float], unit: float, align: int = 1) -> tuple[int, int]:
        sizes = balanced_split(total, fixed, unit, align) if self.size > 1 else [total]
        return sum(sizes[:self.rank]), sizes[self.rank]

    def shard(self, total: int, what: str, align: int = 1) -> tuple[int, int]:
        """(start, length) of this rank's part of `total` items."""
        try:
            sizes = self.sizes(total, align)
        except ValueError:
            raise ValueError(f"{what} ({total}) cannot be split across tensor_parallel_size={self.size} ranks") \
                from None
        return sum(sizes[:self.rank]), sizes[self.rank]

    # -- communication ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (float32 accumulation; identical result on every rank)."""
        if self.size == 1:
            return x
        if not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("all_reduce needs a contiguous float32 or bfloat16 tensor")
        t0 = time.perf_counter()
        self.comm.all_reduce(x.data_ptr(), x.numel(), 0 if x.dtype == torch.float32 else 1)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """x [rows, sizes[rank]] on every rank -> [rows, sum(sizes)] on every rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        rows = x.shape[0]
        t0 = time.perf_counter()
        flat = torch.empty(rows * sum(sizes), dtype=x.dtype)
        es = x.element_size()
        self.comm.all_gather(x.data_ptr(), flat.data_ptr(), [rows * n * es for n in sizes])
        parts, off = [], 0
        for n in sizes:
            parts.append(flat[off:off + rows * n].view(rows, n))
            off += rows * n
        out = torch.cat(parts, dim=1)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return out

    def barrier(self) -> None:
        if self.size > 1:
            self.comm.barrier()


SINGLE = TPGroup()
