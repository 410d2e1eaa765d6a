"""Tensor-parallel group of this process. A single rank until the TP issue adds
rank processes; layers already shard by (rank, size) and call all_reduce."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        raise NotImplementedError("multi-rank all-reduce arrives with the tensor-parallel backend")

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        raise NotImplementedError("multi-rank all-gather arrives with the tensor-parallel backend")

    def shard(self, total: int, what: str) -> tuple[int, int]:
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        per = total // self.size
        return self.rank * per, per


SINGLE = TPGroup()
