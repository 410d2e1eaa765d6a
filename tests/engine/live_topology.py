"""What the tests expect of binding on *this* machine, read straight from the kernel (sysfs
and the affinity mask), never from the engine's own topology code: which NUMA node each
allowed CPU is on, which CPUs share a core, and whether the host lets a process bind its
memory (a container without CAP_SYS_NICE under Docker's default profile does not)."""
from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

SYS = Path("/sys/devices/system")


def _cpulist(text: str) -> list[int]:
    out = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def allowed() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@lru_cache
def node_of(cpu: int) -> int:
    for d in SYS.glob("node/node[0-9]*"):
        if cpu in _cpulist((d / "cpulist").read_text()):
            return int(d.name[4:])
    return 0  # no NUMA support in the kernel: one node


@lru_cache
def core_of(cpu: int) -> int:
    """A core's id: its first thread (SMT siblings share it)."""
    p = SYS / f"cpu/cpu{cpu}/topology/thread_siblings_list"
    return min(_cpulist(p.read_text())) if p.exists() else cpu


def allowed_nodes() -> list[int]:
    return sorted({node_of(c) for c in allowed()})


def node_cpus(node: int) -> list[int]:
    return [c for c in allowed() if node_of(c) == node]


def threads_of_core(cpu: int) -> list[int]:
    return [c for c in allowed() if core_of(c) == core_of(cpu)]


PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 238, "aarch64": 237, "s390x": 270, "ppc64le": 261}.get(os.uname().machine)
if nr is None:
    sys.exit(3)
rc = libc.syscall(nr, 0, None, 0)  # set_mempolicy(MPOL_DEFAULT): harmless where allowed
sys.exit(0 if rc == 0 else 1)
"""


@lru_cache
def numa_calls_allowed() -> bool:
    """Whether set_mempolicy works here (probed in a child, so this process keeps its policy)."""
    return subprocess.run([sys.executable, "-c", PROBE], timeout=60).returncode == 0


NUMA_FORBIDDEN = ("this host forbids set_mempolicy (a container without CAP_SYS_NICE under the runtime's default "
                  "seccomp profile): memory binding cannot be checked here")

