"""Applies a binding plan to the running process: pins threads, binds memory,
and reports (once, clearly) what the container did not allow. Also finds
tcmalloc for the engine processes."""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from cpuserve.platform.binding import BindingPlan, RankBinding
from cpuserve_topology import format_cpulist

log = logging.getLogger("cpuserve.platform")

NUMA_HINT = ("the container needs CAP_SYS_NICE and a seccomp profile that allows get_mempolicy, set_mempolicy, "
             "mbind and migrate_pages (Kubernetes: securityContext.capabilities.add: [SYS_NICE] with seccompProfile "
             "Unconfined or the chart's Localhost profile; Docker: --cap-add SYS_NICE --security-opt "
             "seccomp=unconfined). Inference still works; memory may sit on a remote node")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _err(code: int) -> str:
    return f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"


@dataclass
class BindingReport:
    rank: int
    threads: int
    thread_cpus: list[int] = field(default_factory=list)
    mem_node: int | None = None
    mem_bytes: int | None = None      # the memory node's size
    membind: str = "not requested"    # "bound to node N" | "not requested" | "refused: ..."
    migrated_from: list[int] = field(default_factory=list)

    @property
    def membind_effective(self) -> bool:
        return self.membind.startswith("bound")


def describe_binding(report: dict) -> dict:
    """A rank's binding as reported outside (a BindingReport's fields): its threads' CPUs and,
    only where the kernel accepted the policy, its memory node."""
    bound = str(report.get("membind", "")).startswith("bound")
    return {"rank": report["rank"], "cpus": format_cpulist(report.get("thread_cpus") or []),
            "memoryNode": report.get("mem_node") if bound else None, "membind": report.get("membind", "")}


_UNPINNED: list[frozenset[int]] = []  # this process's CPUs before pin_process first ran


def unpinned_cpus() -> frozenset[int]:
    """The CPUs this process had before its first binding. A binding leaves the main thread on one
    CPU (OpenMP thread 0's), so a second engine in the same process (tests, `cpuserve bench`)
    that planned over the live affinity would get one CPU for all its threads."""
    return _UNPINNED[0] if _UNPINNED else frozenset(os.sched_getaffinity(0))


def pin_process(cpus) -> None:
    """Pins every thread of this process (os.sched_setaffinity only moves the caller)."""
    if not _UNPINNED:
        _UNPINNED.append(frozenset(os.sched_getaffinity(0)))
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile


def apply_rank_binding(rb: RankBinding, allowed_mems=()) -> BindingReport:
    """Thread and memory binding for this rank's process: call before loading weights."""
    import torch

    from cpuserve import _C

    report = BindingReport(rb.rank, rb.num_threads, mem_node=rb.mem_node, mem_bytes=rb.mem_bytes)
    if rb.cpus is None:  # nobind: OMP_NUM_THREADS (or the default) decides
        torch.set_num_threads(rb.num_threads)
        _C.omp_set_num_threads(rb.num_threads)
        report.thread_cpus = []
        return report
    cpus = list(rb.cpus)
    pin_process(cpus)               # helper threads float over the rank's CPUs...
    torch.set_num_threads(len(cpus))
    torch.ones(1 << 16).sum()       # ...created now, while the main thread may still use all of them
    node = rb.mem_node if rb.mem_node is not None else -1
    aff_err, mem_err = _C.bind_omp_threads(cpus, node)  # then OpenMP thread i on cpus[i]
    if aff_err:
        raise OSError(aff_err, f"cannot pin rank {rb.rank}'s threads to CPUs {format_cpulist(cpus)}: "
                               f"{_err(aff_err)}")
    report.thread_cpus = _C.omp_thread_cpus()
    if rb.mem_node is not None:
        err = _C.set_membind([rb.mem_node]) or mem_err
        if err:
            report.membind = f"refused: set_mempolicy {_err(err)}"
            warn_once("membind", f"NUMA memory binding is not in effect (set_mempolicy: {_err(err)}): {NUMA_HINT}")
        else:
            report.membind = f"bound to node {rb.mem_node}"
            others = sorted(set(allowed_mems) - {rb.mem_node})
            if others:  # pages touched before the binding (interpreter, imports) move to the rank's node
                merr, _ = _C.migrate_pages(0, others, [rb.mem_node])
                if merr:
                    warn_once("migrate", f"already-touched pages stay where they are (migrate_pages: {_err(merr)}): "
                                         f"{NUMA_HINT}")
                else:
                    report.migrated_from = others
    return report


def probe_membind() -> tuple[bool, str]:
    """Whether NUMA memory binding works in this process, without changing its policy."""
    from cpuserve import _C

    err, mode, nodes = _C.get_mempolicy()
    if err:
        return False, f"get_mempolicy: {_err(err)}"
    err = _C.set_membind(nodes or [0]) if mode == 2 else _C.set_mempolicy_default()
    if err:
        return False, f"set_mempolicy: {_err(err)}"
    merr, _ = _C.migrate_pages(0, nodes or [0], nodes or [0])
    if merr:
        return False, f"migrate_pages: {_err(merr)}"
    return True, "set_mempolicy and migrate_pages allowed"


def log_plan(plan: BindingPlan) -> None:
    for line in plan.describe():
        log.info("binding (%s): %s", plan.mode, line)
    for w in plan.warnings:
        warn_once(w, w)


TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib/s390x-linux-gnu", "/usr/lib64",
            "/usr/lib", "/usr/local/lib")


def find_tcmalloc(dirs=LIB_DIRS) -> str | None:
    for d in dirs:
        for name in TCMALLOC_NAMES:
            p = Path(d) / name
            if p.exists():
                return str(p)
    return None


def preload_tcmalloc_for_children(environ=os.environ, dirs=LIB_DIRS) -> str | None:
    """Adds tcmalloc to LD_PRELOAD for the engine processes started after this call
    (the engine core and its ranks are new interpreters, so they load it from the
    start). CPUSERVE_TCMALLOC=0 turns it off. Returns the library, or None."""
    if environ.get("CPUSERVE_TCMALLOC", "1") == "0":
        return None
    current = environ.get("LD_PRELOAD", "")
    if "tcmalloc" in current:
        return next(p for p in current.replace(":", " ").split() if "tcmalloc" in p)
    lib = find_tcmalloc(dirs)
    if lib:
        environ["LD_PRELOAD"] = f"{lib}:{current}" if current else lib
    return lib
