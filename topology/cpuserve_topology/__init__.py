"""CPU and memory topology, read from /sys and /proc without importing torch.

Everything takes a `root` so that tests can point it at recorded trees; the
live machine is root "/". What the process may use comes from its own status
(`Cpus_allowed_list`, `Mems_allowed_list`), so inside a container with a cpuset
only the cpuset's CPUs and memory nodes count as usable.
"""
from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

# ISA flags worth reporting (and matching against an operator's node selector).
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
              "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile",  # x86
              "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm",  # arm64 (Features)
              "vx", "vxe", "vxe2", "vxp", "nnpa")  # s390x (features)


def parse_cpulist(text: str) -> list[int]:
    """Kernel cpulist syntax: "0-3,8,10-15" (and "0-15:2" strides). Empty means none."""
    out: list[int] = []
    text = text.strip()
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise ValueError(f"bad CPU list element {part!r} in {text!r} (expected e.g. 0-3,8,10-15)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        step = int(m.group(3)) if m.group(3) else 1
        if hi < lo or step < 1:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        out.extend(range(lo, hi + 1, step))
    return sorted(set(out))


def format_cpulist(cpus) -> str:
    """Inverse of parse_cpulist, compressing runs: [0,1,2,3,8] -> "0-3,8"."""
    cpus = sorted(set(cpus))
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class CpuInfo:
    id: int
    node: int
    package: int
    core: int            # core_id: unique only within its package
    siblings: tuple[int, ...]  # SMT threads of the same physical core, itself included

    @property
    def core_key(self) -> tuple[int, int]:
        return self.package, self.core


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]        # online CPUs of the node
    mem_total: int               # bytes (0: a memory-less node)
    mem_free: int


@dataclass(frozen=True)
class Topology:
    arch: str
    nodes: tuple[NumaNode, ...]
    cpus: dict[int, CpuInfo]
    allowed_cpus: frozenset[int]
    allowed_mems: frozenset[int]
    isa: tuple[str, ...] = ()
    cpu_quota: float | None = None    # cgroup cpu.max quota in CPUs, if any
    warnings: tuple[str, ...] = field(default=())

    @property
    def smt(self) -> bool:
        return any(len(c.siblings) > 1 for c in self.cpus.values())

    @property
    def packages(self) -> list[int]:
        return sorted({c.package for c in self.cpus.values()})

    def node(self, node_id: int) -> NumaNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def allowed_in(self, node_id: int) -> list[int]:
        return [c for c in self.node(node_id).cpus if c in self.allowed_cpus]

    def physical_cores(self, cpus) -> list[int]:
        """One CPU per physical core among `cpus` (its lowest-numbered thread), in CPU order."""
        seen: dict[tuple[int, int], int] = {}
        for c in sorted(cpus):
            key = self.cpus[c].core_key if c in self.cpus else (-1, c)
            seen.setdefault(key, c)
        return sorted(seen.values())

    def threads_of(self, cpu: int) -> list[int]:
        """The SMT siblings of `cpu` that this process may use."""
        info = self.cpus.get(cpu)
        return [s for s in (info.siblings if info else (cpu,)) if s in self.allowed_cpus]

    def node_of(self, cpu: int) -> int:
        return self.cpus[cpu].node if cpu in self.cpus else 0

    def to_dict(self) -> dict:
        return {
            "arch": self.arch,
            "packages": len(self.packages),
            "smt": self.smt,
            "isa": list(self.isa),
            "allowed_cpus": format_cpulist(self.allowed_cpus),
            "allowed_mems": format_cpulist(self.allowed_mems),
            "cpu_quota": self.cpu_quota,
            "nodes": [dict(id=n.id, cpus=format_cpulist(n.cpus), allowed_cpus=format_cpulist(self.allowed_in(n.id)),
                           physical_cores=len(self.physical_cores(n.cpus)),
                           allowed_physical_cores=len(self.physical_cores(self.allowed_in(n.id))),
                           mem_total=n.mem_total, mem_free=n.mem_free, mem_allowed=n.id in self.allowed_mems)
                      for n in self.nodes],
            "warnings": list(self.warnings),
        }


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _node_meminfo(text: str | None) -> tuple[int, int]:
    total = free = 0
    for line in (text or "").splitlines():
        m = re.match(r"Node \d+ (MemTotal|MemFree):\s+(\d+) kB", line)
        if m:
            value = int(m.group(2)) * 1024
            if m.group(1) == "MemTotal":
                total = value
            else:
                free = value
    return total, free


def _proc_meminfo(text: str | None) -> tuple[int, int]:
    total = free = 0
    for line in (text or "").splitlines():
        m = re.match(r"(MemTotal|MemAvailable):\s+(\d+) kB", line)
        if m:
            if m.group(1) == "MemTotal":
                total = int(m.group(2)) * 1024
            else:
                free = int(m.group(2)) * 1024
    return total, free


def _isa_flags(cpuinfo: str | None) -> tuple[str, ...]:
    for line in (cpuinfo or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            have = set(value.split())
            return tuple(f for f in _ISA_FLAGS if f in have)
    return ()


def _status_lists(status: str | None) -> tuple[list[int] | None, list[int] | None]:
    cpus = mems = None
    for line in (status or "").splitlines():
        key, _, value = line.partition(":")
        if key == "Cpus_allowed_list":
            cpus = parse_cpulist(value)
        elif key == "Mems_allowed_list":
            mems = parse_cpulist(value)
    return cpus, mems


def _cpu_cgroup_dirs(root: Path) -> list[tuple[Path, int]]:
    """(directory, cgroup version) of this process's own CPU cgroup, read through
    /proc/self/cgroup, then of the mount's root (a container sees its own cgroup there)."""
    base, out = root / "sys/fs/cgroup", []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            out.append((base / rel, 2))
        elif "cpu" in controllers.split(","):
            out += [(base / controllers / rel, 1), (base / "cpu" / rel, 1)]
    return out + [(base, 2), (base / "cpu", 1), (base / "cpu,cpuacct", 1)]


def _quota_in(d: Path, version: int) -> float | None:
    if version == 2:
        fields = (_read(d / "cpu.max") or "").split()
        ok = len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0
        return int(fields[0]) / int(fields[1]) if ok else None
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, per = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return q / per if q > 0 and per > 0 else None  # -1: no quota


def _cpu_quota(root: Path) -> float | None:
    """The tightest CFS quota over this process's own CPU cgroup and the mount's root, in CPUs
    (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us); None without one."""
    found = [q for d, v in _cpu_cgroup_dirs(root) if (q := _quota_in(d, v)) is not None]
    return min(found) if found else None


def read_topology(root: str | os.PathLike = "/", status: str | None = None, arch: str | None = None) -> Topology:
    """Reads the topology under `root`. `status` overrides `<root>/proc/self/status`
    (the allowed CPUs and memory nodes); on the live machine the affinity mask is
    asked from the kernel directly."""
    root = Path(root)
    live = root == Path("/") and status is None
    sysdev = root / "sys/devices/system"
    warnings: list[str] = []

    online_text = _read(sysdev / "cpu/online")
    online = parse_cpulist(online_text) if online_text else sorted(
        int(p.name[3:]) for p in (sysdev / "cpu").glob("cpu[0-9]*"))
    if not online:
        online = sorted(os.sched_getaffinity(0)) if live else [0]
        warnings.append("no CPU list under /sys; using the process affinity")

    nodes: list[NumaNode] = []
    cpu_node: dict[int, int] = {}
    node_dirs = sorted((sysdev / "node").glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    for d in node_dirs:
        nid = int(d.name[4:])
        cpus = [c for c in parse_cpulist(_read(d / "cpulist") or "") if c in online]
        total, free = _node_meminfo(_read(d / "meminfo"))
        nodes.append(NumaNode(nid, tuple(cpus), total, free))
        for c in cpus:
            cpu_node[c] = nid
    if not nodes:  # kernel without NUMA, or /sys/devices/system/node hidden: one node
        total, free = _proc_meminfo(_read(root / "proc/meminfo"))
        nodes.append(NumaNode(0, tuple(online), total, free))
        cpu_node = {c: 0 for c in online}
        warnings.append("no NUMA information under /sys; treating the machine as one node")

    cpus: dict[int, CpuInfo] = {}
    for c in online:
        t = sysdev / f"cpu/cpu{c}/topology"
        pkg = _read(t / "physical_package_id")
        core = _read(t / "core_id")
        sib = _read(t / "thread_siblings_list")
        cpus[c] = CpuInfo(
            id=c, node=cpu_node.get(c, 0),
            package=int(pkg) if pkg is not None else 0,
            core=int(core) if core is not None else c,
            siblings=tuple(s for s in parse_cpulist(sib) if s in online) if sib else (c,))

    if live:
        allowed = sorted(os.sched_getaffinity(0))
        _, mems = _status_lists(_read(root / "proc/self/status"))
    else:
        allowed, mems = _status_lists(status if status is not None else _read(root / "proc/self/status"))
    allowed_cpus = frozenset(c for c in (allowed if allowed is not None else online) if c in cpus)
    allowed_mems = frozenset(mems if mems is not None else [n.id for n in nodes])

    return Topology(arch=arch or _arch_from(root, live), nodes=tuple(nodes), cpus=cpus,
                    allowed_cpus=allowed_cpus, allowed_mems=allowed_mems,
                    isa=_isa_flags(_read(root / "proc/cpuinfo")), cpu_quota=_cpu_quota(root),
                    warnings=tuple(warnings))


def _arch_from(root: Path, live: bool) -> str:
    if live:
        return platform.machine()
    recorded = _read(root / "arch")
    return recorded.strip() if recorded else platform.machine()


def topology_json(topo: Topology) -> str:
    return json.dumps(topo.to_dict(), indent=2)

