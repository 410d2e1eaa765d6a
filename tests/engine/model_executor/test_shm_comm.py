"""The native shared-memory all-reduce / all-gather against torch references,
between real processes; and what happens when a rank dies."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from cpuserve import _C

sys.path.insert(0, str(Path(__file__).parent))
from comm_worker import cases, rank_input  # noqa: E402

WORKER = str(Path(__file__).parent / "comm_worker.py")


def run_group(tmp_path, world, slot, mode="ok"):
    name = f"/cpuserve-test-{uuid.uuid4().hex[:8]}"
    comm = _C.ShmComm(name, 0, world, slot)  # rank 0 creates; the children attach
    procs = [subprocess.Popen([sys.executable, WORKER, name, str(r), str(world), str(slot), mode,
                               str(tmp_path / f"r{r}.pt")]) for r in range(1, world)]
    return comm, procs


def reference(world, dtype, n):
    acc = rank_input(0, dtype, n).float()
    for r in range(1, world):
        acc = acc + rank_input(r, dtype, n).float()  # float32, rank order: what every rank must get
    return acc.to(dtype)


@pytest.mark.parametrize("world,slot", [(2, 4 << 20), (3, 64 << 10)])
def test_all_reduce_and_gather_match_torch(tmp_path, world, slot):
    comm, procs = run_group(tmp_path, world, slot)
    mine = {}
    for dtype, n in cases():
        x = rank_input(0, dtype, n)
        comm.all_reduce(x.data_ptr(), n, 0 if dtype == torch.float32 else 1)
        mine[f"reduce-{dtype}-{n}"] = x
    sizes = [(r + 1) * 1000 + 3 for r in range(world)]
    gathered = torch.empty(sum(sizes), dtype=torch.float32)
    own = torch.zeros(sizes[0])
    comm.all_gather(own.data_ptr(), gathered.data_ptr(), [4 * s for s in sizes])
    comm.barrier()
    for p in procs:
        assert p.wait(60) == 0
    others = [torch.load(tmp_path / f"r{r}.pt") for r in range(1, world)]
    for dtype, n in cases():
        key = f"reduce-{dtype}-{n}"
        want = reference(world, dtype, n)
        assert torch.equal(mine[key], want), key
        for o in others:  # bit-identical on every rank
            assert torch.equal(o[key], want), key
    want = torch.cat([torch.full((s,), float(r)) for r, s in enumerate(sizes)])
    assert torch.equal(gathered, want)
    for o in others:
        assert torch.equal(o["gather"], want)
    comm.unlink()


@pytest.mark.timeout(120)  # a hang fails the test instead of blocking the suite
def test_dead_rank_is_reported_not_waited_for(tmp_path):
    comm, procs = run_group(tmp_path, 2, 1 << 20, mode="die")
    assert procs[0].wait(60) == 3
    x = torch.ones(10)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) has died"):
        comm.all_reduce(x.data_ptr(), 10, 0)


def test_abort_releases_waiters():
    name = f"/cpuserve-test-{uuid.uuid4().hex[:8]}"
    a = _C.ShmComm(name, 0, 2, 1 << 20)
    b = _C.ShmComm(name, 1, 2, 1 << 20)  # same process: attach as rank 1, then abort from it
    b.abort()
    with pytest.raises(RuntimeError, match="aborted by rank 1"):
        a.barrier()
    del a, b


def test_bad_arguments():
    with pytest.raises(ValueError, match="world size"):
        _C.ShmComm("/cpuserve-x", 0, 0, 1 << 20)
    with pytest.raises(ValueError, match="slot_bytes"):
        _C.ShmComm("/cpuserve-x", 0, 2, 100)
    with pytest.raises(RuntimeError, match="shm_open"):
        _C.ShmComm(f"/cpuserve-missing-{os.getpid()}", 1, 2, 1 << 20)  # nothing to attach to
