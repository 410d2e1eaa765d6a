"""A tensor-parallel rank > 0: `python -m cpuserve.worker.tp_worker ADDRESS RANK`.

It binds its threads and memory to its NUMA node before loading anything, loads
its shard of the model, and then runs the forward pass of every batch rank 0
sends it, meeting the other ranks in the shared-memory all-reduce.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Client

log = logging.getLogger("cpuserve.tp")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    address, rank = argv[0], int(argv[1])
    ppid = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 stops the ranks; they die with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != ppid:  # the parent died before the signal was armed
        return 1
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    conn = Client(address, "AF_UNIX", authkey=bytes.fromhex(os.environ.pop("CPUSERVE_TP_AUTHKEY")))
    conn.send(rank)
    started = start(conn, rank, pickle.loads(conn.recv_bytes()))
    return 1 if started is None else serve(conn, rank, *started)


def start(conn, rank: int, init: dict):
    """Binds this process, attaches to the communicator and loads this rank's shard;
    tells rank 0 "ready" or the error. Returns (runner, tp, comm), or None on failure."""
    comm = None
    try:
        from cpuserve.platform.pinning import apply_rank_binding

        report = apply_rank_binding(init["binding"], init["allowed_mems"])
        from cpuserve.model_executor.parallel import TPGroup, attach_shm_comm
        from cpuserve.worker.model_runner import ModelRunner

        comm = attach_shm_comm(init["comm_name"], rank, init["world"])
        tp = TPGroup(rank, init["world"], comm)
        runner = ModelRunner(init["config"], tp=tp, model_dir=init["model_dir"], binding_report=report)
        conn.send(("ready", dict(pid=os.getpid(), num_blocks=runner.num_blocks, binding=report.__dict__)))
        return runner, tp, comm
    except Exception as e:
        log.error("rank %d failed to start: %s", rank, e)
        if comm is not None:
            comm.abort()
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return None


def serve(conn, rank: int, runner, tp, comm) -> int:
    """Runs what rank 0 sends until it says shutdown or goes away; after a quiet spell, does its
    start-up work left for then (worker/idle.py), as rank 0 does."""
    from cpuserve.worker.idle import QUIET_S

    idle = runner.idle_work
    try:
        while True:
            if idle.pending and not conn.poll(QUIET_S):
                idle.run_while(lambda: not conn.poll())
                continue
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return 0  # rank 0 is gone
            kind = msg[0]
            if kind == "forward":
                runner.forward(*msg[1:])
            elif kind == "comm_stats":
                conn.send(("comm_stats", tp.stats()))
            elif kind == "reset_comm_stats":
                tp.reset_stats()
            elif kind == "shutdown":
                return 0
            else:
                raise ValueError(f"unknown message {kind!r}")
    except Exception:
        comm.abort()  # releases the other ranks from any all-reduce they are waiting in
        text = traceback.format_exc()
        log.error("rank %d failed:\n%s", rank, text)
        try:
            conn.send(("error", text.strip().splitlines()[-1]))
        except OSError:
            pass
        return 1

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
