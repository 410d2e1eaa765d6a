"""The tensor-parallel group of this process: its rank, the group size, and the
shared-memory all-reduce / all-gather the sharded layers call.

Shards are balanced, not required to divide evenly: SmolLM2-135M has 9 query
and 3 KV heads, so two ranks take 5 and 4 query heads (the kv head whose group
straddles them is held by both), where Megatron-style code would refuse to run
it on two ranks at all.
"""
from __future__ import annotations

import os
import secrets
import time

import torch


SLOT_BYTES = 4 << 20  # per rank and parity: 2 x N x 4 MiB of /dev/shm in all


def create_shm_comm(world: int):
    """Rank 0's end of a new shared-memory communicator: (its name, the communicator).
    The other ranks attach by name; rank 0 unlinks it once all have attached."""
    from cpuserve import _C

    name = f"/cpuserve-{os.getpid()}-{secrets.token_hex(4)}"
    return name, _C.ShmComm(name, 0, world, SLOT_BYTES)


def attach_shm_comm(name: str, rank: int, world: int):
    from cpuserve import _C

    return _C.ShmComm(name, rank, world, SLOT_BYTES)


def split_sizes(total: int, parts: int, align: int = 1) -> list[int]:
    """Sizes of `parts` contiguous shards of `total` items, as equal as possible in
    units of `align` items (the last shard takes any remainder), larger first."""
    units, rest = divmod(total, align)
    base, extra = divmod(units, parts)
    sizes = [(base + (1 if r < extra else 0)) * align for r in range(parts)]
    sizes[-1] += rest
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

    def stats(self) -> tuple[float, int, float]:
        """(seconds in collectives, calls, seconds of those waiting for other ranks)."""
        return self.comm_seconds, self.comm_calls, self.comm.wait_seconds if self.comm is not None else 0.0

    def reset_stats(self) -> None:
        self.comm_seconds, self.comm_calls = 0.0, 0
        if self.comm is not None:
            self.comm.reset_wait()

    def barrier(self) -> None:
        if self.size > 1:
            self.comm.barrier()


SINGLE = TPGroup()
