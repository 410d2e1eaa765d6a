"""Child-process side of the shared-memory communicator tests (run with
`python comm_worker.py NAME RANK WORLD SLOT MODE`); writes its results as .pt."""
import sys

import torch


def cases():
    """(dtype, numel) pairs: 1 element to several MB, odd sizes, several slot-sized chunks."""
    sizes = [1, 7, 1000, 4096, (1 << 16) + 3, 1 << 20, 3 * (1 << 20) + 5]
    return [(torch.float32, n) for n in sizes] + [(torch.bfloat16, n) for n in (1, 999, (1 << 16) + 1, 1 << 20)]


def rank_input(rank, dtype, n):
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def main(name, rank, world, slot, mode, out):
    from cpuserve import _C

    comm = _C.ShmComm(name, rank, world, slot)
    if mode == "die" and rank == world - 1:
        sys.exit(3)  # attached, then gone without taking part
    results = {}
    for dtype, n in cases():
        x = rank_input(rank, dtype, n)
        comm.all_reduce(x.data_ptr(), n, 0 if dtype == torch.float32 else 1)
        results[f"reduce-{dtype}-{n}"] = x
    sizes = [(r + 1) * 1000 + 3 for r in range(world)]  # uneven shards, bytes of float32 rows
    mine = torch.full((sizes[rank],), float(rank), dtype=torch.float32)
    gathered = torch.empty(sum(sizes), dtype=torch.float32)
    comm.all_gather(mine.data_ptr(), gathered.data_ptr(), [4 * s for s in sizes])
    results["gather"] = gathered
    comm.barrier()
    torch.save(results, out)


if __name__ == "__main__":
    name, rank, world, slot, mode, out = sys.argv[1:]
    main(name, int(rank), int(world), int(slot), mode, out)
