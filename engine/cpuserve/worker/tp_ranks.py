"""Tensor-parallel rank processes, seen from rank 0.

Rank 0 is the engine's own process: it schedules, samples and drives the
others. Ranks 1..N-1 are `python -m cpuserve.worker.tp_worker` processes (plain
subprocesses: the served engine core is itself a daemon process, which
multiprocessing would not let have children). Each step, rank 0 sends the
batch's inputs over a local socket; the ranks then meet only in the native
shared-memory all-reduce / all-gather. Any rank that dies or fails stops the
whole engine with an error that names it; a rank notices rank 0 going away
(socket closed, parent-death signal, dead peer in the communicator) and exits.
"""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener

from cpuserve.model_executor.parallel import TPGroup, create_shm_comm
from cpuserve.platform.binding import BindingPlan

log = logging.getLogger("cpuserve.tp")

START_TIMEOUT_S = float(os.environ.get("CPUSERVE_TP_START_TIMEOUT", "600"))


class RankFailure(RuntimeError):
    pass


class RankConfigError(RankFailure, ValueError):
    """A rank refused the configuration (a ValueError there, such as a KV cache that does not
    fit its node): the same error as when rank 0 refuses it first, whichever rank wins the race."""


def rank_failure(message: str, detail: str) -> RankFailure:
    cls = RankConfigError if detail.startswith("ValueError: ") else RankFailure
    return cls(f"{message}: {detail}")


def start_rank0(config, model_dir: str):
    """Rank 0's start: plans the binding (unless the API process already did), starts
    ranks 1..N-1, then binds this process. Returns (its TPGroup, its binding report,
    the RankProcesses or None without tensor parallelism)."""
    import dataclasses

    from cpuserve.platform.binding import plan_from_env
    from cpuserve.platform.pinning import apply_rank_binding, log_plan, unpinned_cpus
    from cpuserve_topology import read_topology

    size = config.tensor_parallel_size
    topo = read_topology()
    topo = dataclasses.replace(topo, allowed_cpus=frozenset(c for c in unpinned_cpus() if c in topo.cpus))
    plan = config.binding or plan_from_env(topo, size)
    if len(plan.ranks) != size:
        raise ValueError(f"the binding plan has {len(plan.ranks)} ranks but tensor_parallel_size is {size}")
    log_plan(plan)
    allowed_mems = sorted(topo.allowed_mems)
    ranks = RankProcesses(config, plan, model_dir, allowed_mems) if size > 1 else None
    try:
        report = apply_rank_binding(plan.ranks[0], allowed_mems)
    except BaseException:
        if ranks is not None:
            ranks.shutdown()
        raise
    return (TPGroup(0, size, ranks.comm) if ranks else TPGroup()), report, ranks


class RankProcesses:
    """Ranks 1..N-1 seen from rank 0: starts them, sends them each step's work and
    control messages, notices when one fails, and stops them."""

    def __init__(self, config, plan: BindingPlan, model_dir: str, allowed_mems: list[int]):
        self.world = config.tensor_parallel_size
        self.comm_name, self.comm = create_shm_comm(self.world)
        self._tmp = tempfile.mkdtemp(prefix="cpuserve-tp-")
        addr = os.path.join(self._tmp, "ranks.sock")
        key = secrets.token_bytes(32)
        self._listener = Listener(addr, "AF_UNIX", authkey=key)
        env = dict(os.environ, CPUSERVE_TP_AUTHKEY=key.hex(), PYTHONUNBUFFERED="1")
        self.procs: list[subprocess.Popen | None] = [None]
        for r in range(1, self.world):
            self.procs.append(subprocess.Popen([sys.executable, "-m", "cpuserve.worker.tp_worker", addr, str(r)], env=env))
        self.conns = [None] * self.world
        self._closed = False
        try:
            self._accept_all()
            for r in range(1, self.world):
                self.conns[r].send_bytes(pickle.dumps(dict(config=config, binding=plan.ranks[r], comm_name=self.comm_name,
                                        world=self.world, model_dir=model_dir,
                                        allowed_mems=allowed_mems)))
        except BaseException:
            self.shutdown()
            raise

    def _accept_all(self) -> None:
        got: dict[int, object] = {}
        errors: list[BaseException] = []

        def accept():
            try:
                for _ in range(1, self.world):
                    conn = self._listener.accept()
                    got[conn.recv()] = conn
            except BaseException as e:  # listener closed on failure
                errors.append(e)

        t = threading.Thread(target=accept, daemon=True, name="cpuserve-tp-accept")
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive():
            t.join(0.1)
            self.check_alive()
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks did not connect within {START_TIMEOUT_S:.0f}s")
        if errors:
            raise RankFailure(f"tensor-parallel ranks could not connect: {errors[0]}")
        for r, conn in got.items():
            self.conns[r] = conn

    def check_alive(self) -> None:
        """Raises if a rank process has exited (its error message first, if it sent one)."""
        for r, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                detail = self._pending_error(r)
                raise RankFailure(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode}"
                                  + (f": {detail}" if detail else "") + "; stopping the engine")

    def _pending_error(self, r: int) -> str | None:
        conn = self.conns[r]
        try:
            while conn is not None and conn.poll(0):
                msg = conn.recv()
                if isinstance(msg, tuple) and msg and msg[0] == "error":
                    return msg[1]
        except (EOFError, OSError):
            pass
        return None

    def wait_ready(self) -> list[dict]:
        infos: list[dict | None] = [None] * self.world
        deadline = time.monotonic() + START_TIMEOUT_S
        for r in range(1, self.world):
            while infos[r] is None:
                if self.conns[r].poll(0.1):
                    try:
                        kind, payload = self.conns[r].recv()
                    except (EOFError, OSError):
                        self.check_alive()
                        raise RankFailure(f"tensor-parallel rank {r} closed its connection during startup")
                    if kind == "error":
                        raise rank_failure(f"tensor-parallel rank {r} failed to start", str(payload))
                    infos[r] = payload
                else:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise RankFailure(f"tensor-parallel rank {r} did not load within {START_TIMEOUT_S:.0f}s")
        return infos[1:]

    def broadcast(self, msg) -> None:
        # Plain pickle: Connection.send would use torch's multiprocessing reductions,
        # which pass tensors through a resource-sharing server instead of by value.
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for r in range(1, self.world):
            try:
                self.conns[r].send_bytes(data)
            except OSError:
                self.check_alive()
                raise RankFailure(f"tensor-parallel rank {r} is not listening; stopping the engine") from None

    def request(self, msg) -> list:
        """Sends msg to every rank and returns each one's reply."""
        self.broadcast(msg)
        out = []
        for r in range(1, self.world):
            try:
                reply = self.conns[r].recv()
            except (EOFError, OSError):
                self.check_alive()
                raise RankFailure(f"tensor-parallel rank {r} went away") from None
            if reply[0] == "error":
                raise RankFailure(f"tensor-parallel rank {r} failed: {reply[1]}")
            out.append(reply[1])
        return out

    def failure(self, exc: BaseException) -> RankFailure:
        """Turns an error seen by rank 0 during a step into one naming the failed rank."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # give a failing rank a moment to report or exit
            for r in range(1, self.world):
                detail = self._pending_error(r)
                if detail:
                    return rank_failure(f"tensor-parallel rank {r} failed", detail)
                p = self.procs[r]
                if p.poll() is not None:
                    return RankFailure(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode}; "
                                       "stopping the engine")
            time.sleep(0.05)
        return RankFailure(f"tensor-parallel step failed: {exc}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns[1:]:
            try:
                if conn is not None:
                    conn.send_bytes(pickle.dumps(("shutdown",)))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs[1:]:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self.conns[1:]:
            if conn is not None:
                conn.close()
        self._listener.close()
        self.comm.unlink()
        shutil.rmtree(self._tmp, ignore_errors=True)
