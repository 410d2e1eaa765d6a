"""Tensor-parallel benchmarks: `python benchmarks/tensor_parallel.py`.

1. All-reduce latency between two processes, one core each: cpuserve's native
   shared-memory all-reduce against torch.distributed with gloo, float32, from
   4 KB to 8 MB (median of repeated timed loops).
2. A TP=2 decode step on the real model (SmolLM2-135M, float32, default `auto`
   binding): the share of each rank's decode time spent inside all-reduce and
   all-gather (waiting for the other rank included), next to TP=1.

Writes docs/bench/tensor_parallel.{md,json,png} and the README table.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import readme_tables

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench"
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]


# -- 1. all-reduce ------------------------------------------------------------------------
def _iters(nbytes: int) -> int:
    return max(20, min(2000, (64 << 20) // nbytes))


def allreduce_worker(kind: str, rank: int, addr: str, out: str) -> None:
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    if kind == "cpuserve":
        from cpuserve import _C

        deadline = time.monotonic() + 30
        while True:
            try:
                comm = _C.ShmComm(addr, rank, 2, 4 << 20)
                break
            except RuntimeError:  # rank 1 may come before rank 0 has created the segment
                if rank == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        op = lambda t: comm.all_reduce(t.data_ptr(), t.numel(), 0)  # noqa: E731
        sync = comm.barrier
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=2)
        op = lambda t: dist.all_reduce(t)  # noqa: E731
        sync = dist.barrier
    results = {}
    for nbytes in SIZES:
        x = torch.randn(nbytes // 4)
        n = _iters(nbytes)
        for _ in range(3):
            op(x)
        samples = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                op(x)
            samples.append((time.perf_counter() - t0) / n)
        results[nbytes] = statistics.median(samples)
    sync()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    if kind == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


def run_allreduce(kind: str) -> dict[int, float]:
    if kind == "cpuserve":
        addr = f"/cpuserve-bench-{uuid.uuid4().hex[:8]}"  # rank 0 creates the segment, rank 1 attaches
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    out = f"/tmp/cpuserve-allreduce-{kind}-{os.getpid()}.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--allreduce-worker", kind, str(r), addr, out])
             for r in (0, 1)]
    for p in procs:
        if p.wait(600) != 0:
            raise RuntimeError(f"{kind} all-reduce worker failed")
    return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


# -- 2. TP=2 decode step -------------------------------------------------------------------------
DECODE_SCRIPT = r"""
import json, os, sys, time
os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
from cpuserve import LLM, SamplingParams
tp, batch, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(dtype="float32", tensor_parallel_size=tp, enable_prefix_caching=False, kv_cache_space=2)
prompts = [{"prompt_token_ids": [(i * 7 + j) % 1000 + 100 for j in range(128)]} for i in range(batch)]
runner = llm.engine.runner
def run(n):
    runner.reset_comm_stats()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t0, runner.comm_stats()
run(4)  # warm up
best = None
for _ in range(3):
    t1, c1 = run(1)           # prefill + one token
    t2, c2 = run(steps + 1)   # the same + `steps` decode steps
    decode = t2 - t1
    comm = [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(c1, c2)]
    if best is None or decode < best["decode_s"]:
        best = dict(decode_s=decode, ms_per_step=1000 * decode / steps,
                    comm_s=[c[0] for c in comm], wait_s=[c[2] for c in comm],
                    calls_per_step=[c[1] / steps for c in comm])
best["comm_share"] = [c / best["decode_s"] for c in best["comm_s"]]
best["wait_share"] = [w / best["decode_s"] for w in best["wait_s"]]
best["work_share"] = [(c - w) / best["decode_s"] for c, w in zip(best["comm_s"], best["wait_s"])]
print("RESULT", json.dumps(best))
"""


def run_decode(tp: int, batch: int, steps: int = 64) -> dict:
    r = subprocess.run([sys.executable, "-c", DECODE_SCRIPT, str(tp), str(batch), str(steps)], capture_output=True,
                       text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])


# -- report ---------------------------------------------------------------------------------------
def fmt_size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ours, gloo = run_allreduce("cpuserve"), run_allreduce("gloo")
    decode = {f"tp{tp}-b{b}": run_decode(tp, b) for tp in (1, 2) for b in (1, 16)}
    rows = ["| size (float32) | cpuserve shm | gloo | speed-up |", "|---:|---:|---:|---:|"]
    for n in SIZES:
        rows.append(f"| {fmt_size(n)} | {ours[n] * 1e6:.1f} µs | {gloo[n] * 1e6:.1f} µs | {gloo[n] / ours[n]:.1f}x |")
    drows = ["| decode step, SmolLM2-135M f32 | TP=1 | TP=2 | TP=2 step share in all-reduce (rank 0 / rank 1) | "
             "of which moving and summing data | of which waiting for the other rank |", "|---|---:|---:|---:|---:|---:|"]
    pct = lambda xs: " / ".join(f"{x * 100:.1f}%" for x in xs)  # noqa: E731
    for b in (1, 16):
        one, two = decode[f"tp1-b{b}"], decode[f"tp2-b{b}"]
        drows.append(f"| batch {b} | {one['ms_per_step']:.1f} ms | {two['ms_per_step']:.1f} ms | "
                     f"{pct(two['comm_share'])} ({two['calls_per_step'][0]:.0f} calls/step) | "
                     f"{pct(two['work_share'])} | {pct(two['wait_share'])} |")
    machine = (f"{readme_tables.cpu_name()}, {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} allowed; "
               f"{readme_tables.run_stamp()}")
    md = [f"Two processes, one core each ({machine}); all-reduce latency, median of 5 timed loops.", "",
          *rows, "", "TP=2 here means one core per rank (this machine has one NUMA node and two cores).", "",
          *drows]
    (OUT / "tensor_parallel.md").write_text("\n".join(md) + "\n")
    (OUT / "tensor_parallel.json").write_text(json.dumps(dict(allreduce=dict(cpuserve=ours, gloo=gloo),
                                                              decode=decode), indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    kb = [n / 1024 for n in SIZES]
    ax.loglog(kb, [ours[n] * 1e6 for n in SIZES], "o-", label="cpuserve shared-memory all-reduce")
    ax.loglog(kb, [gloo[n] * 1e6 for n in SIZES], "s-", label="torch.distributed gloo")
    ax.set_xlabel("message size (KiB, float32)")
    ax.set_ylabel("latency (µs)")
    ax.set_title("2-rank all-reduce, one core per rank")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "tensor_parallel.png", dpi=110)
    readme_tables.update("tensor-parallel", md)
    print("\n".join(md))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--allreduce-worker"]:
        allreduce_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
