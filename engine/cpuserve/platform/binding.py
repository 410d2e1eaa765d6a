"""Thread and memory binding plans: which CPUs and which memory node each
tensor-parallel rank uses, and which CPUs are left for the API process.

`plan_binding` is a pure function of a Topology and the reference variables
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU,
CPU_VISIBLE_MEMORY_NODES, OMP_NUM_THREADS), so every shape of machine can be
tested from a recorded /sys tree. Applying a plan is in cpu_platform.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from cpuserve_topology import Topology, format_cpulist, parse_cpulist

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
VISIBLE_NODES_ENV = "CPU_VISIBLE_MEMORY_NODES"


class BindingError(ValueError):
    """A binding request that cannot be honoured; the message says why and what to change."""


@dataclass(frozen=True)
class RankBinding:
    rank: int
    cpus: tuple[int, ...] | None   # one OpenMP thread per CPU, in order; None = not bound (nobind)
    num_threads: int
    mem_node: int | None           # NUMA node the rank's memory is bound to; None = not bound
    mem_bytes: int | None = None   # that node's memory, for sizing checks


@dataclass(frozen=True)
class BindingPlan:
    mode: str                       # auto | list | nobind
    ranks: tuple[RankBinding, ...]
    reserved_cpus: tuple[int, ...]  # for the API process and other helpers; () = leave it unpinned
    warnings: tuple[str, ...] = field(default=())

    def describe(self) -> list[str]:
        lines = []
        for r in self.ranks:
            cpus = format_cpulist(r.cpus) if r.cpus is not None else "unbound"
            mem = f"node {r.mem_node}" if r.mem_node is not None else "unbound"
            lines.append(f"rank {r.rank}: {r.num_threads} threads on CPUs {cpus}, memory {mem}")
        lines.append("API process: " + (f"CPUs {format_cpulist(self.reserved_cpus)}" if self.reserved_cpus
                                        else "not pinned (no reserved CPUs)"))
        return lines


def env_settings(environ=os.environ) -> dict:
    """The binding variables from the environment, parsed and checked."""
    bind = (environ.get(BIND_ENV) or "auto").strip()
    reserved_raw = environ.get(RESERVED_ENV)
    reserved = None
    if reserved_raw not in (None, ""):
        try:
            reserved = int(reserved_raw)
        except ValueError:
            raise BindingError(f"{RESERVED_ENV}={reserved_raw!r} is not a whole number of CPUs") from None
        if reserved < 0:
            raise BindingError(f"{RESERVED_ENV} must be >= 0, got {reserved}")
    visible_raw = environ.get(VISIBLE_NODES_ENV)
    visible = None
    if visible_raw not in (None, ""):
        try:
            visible = [int(x) for x in visible_raw.split(",")]
        except ValueError:
            raise BindingError(f"{VISIBLE_NODES_ENV}={visible_raw!r} must be comma-separated node ids, e.g. 1,0") \
                from None
    omp_raw = environ.get("OMP_NUM_THREADS")
    omp = None
    if omp_raw not in (None, ""):
        try:
            omp = int(omp_raw.split(",")[0])
        except ValueError:
            raise BindingError(f"OMP_NUM_THREADS={omp_raw!r} is not a number") from None
    return dict(bind=bind, reserved=reserved, visible_nodes=visible, omp_num_threads=omp)


def plan_binding(topo: Topology, world_size: int = 1, bind: str = "auto", reserved: int | None = None,
                 visible_nodes: list[int] | None = None, omp_num_threads: int | None = None) -> BindingPlan:
    if world_size < 1:
        raise BindingError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if bind == "auto":
        plan = _plan_auto(topo, world_size, reserved, visible_nodes)
    elif bind == "nobind":
        plan = _plan_nobind(topo, world_size, omp_num_threads)
    else:
        plan = _plan_lists(topo, world_size, bind)
    return BindingPlan(plan.mode, plan.ranks, plan.reserved_cpus,
                       plan.warnings + tuple(_oversubscription(topo, plan)))


def _usable_nodes(topo: Topology, visible: list[int] | None) -> list[int]:
    ids = [n.id for n in topo.nodes]
    if visible is None:
        return [n for n in ids if topo.allowed_in(n)]
    out = []
    for n in visible:
        if n not in ids:
            raise BindingError(f"{VISIBLE_NODES_ENV} names NUMA node {n}, but this machine has nodes "
                               f"{format_cpulist(ids)}")
        if not topo.allowed_in(n):
            raise BindingError(f"{VISIBLE_NODES_ENV} names NUMA node {n}, but none of its CPUs "
                               f"({format_cpulist(topo.node(n).cpus)}) is in this process's allowed set "
                               f"({format_cpulist(topo.allowed_cpus)})")
        if n in out:
            raise BindingError(f"{VISIBLE_NODES_ENV} names NUMA node {n} twice")
        out.append(n)
    return out


def _mem_node(topo: Topology, node: int, warnings: list[str]) -> int | None:
    if node in topo.allowed_mems and topo.node(node).mem_total > 0:
        return node
    near = sorted(topo.allowed_mems)
    warnings.append(f"NUMA node {node} has no memory this process may use (allowed memory nodes: "
                    f"{format_cpulist(near) or 'none'}); its rank's memory is not bound")
    return None


def _rank(topo: Topology, r: int, cpus: list[int], node: int, warnings: list[str]) -> RankBinding:
    mem = _mem_node(topo, node, warnings)
    return RankBinding(r, tuple(cpus), len(cpus), mem, topo.node(mem).mem_total if mem is not None else None)


def _plan_auto(topo: Topology, world: int, reserved: int | None, visible: list[int] | None) -> BindingPlan:
    nodes = _usable_nodes(topo, visible)
    warnings: list[str] = []
    if not nodes:
        raise BindingError("no NUMA node has a CPU this process may use")
    # Which cores each rank gets: a node per rank, or a node's cores split between ranks.
    groups: list[tuple[int, list[int]]] = []
    if len(nodes) >= world:
        groups = [(n, topo.physical_cores(topo.allowed_in(n))) for n in nodes[:world]]
        if len(nodes) > world and visible is None:
            warnings.append(f"{len(nodes)} NUMA nodes, {world} rank(s): nodes "
                            f"{format_cpulist(nodes[world:])} stay unused (tensor_parallel_size={len(nodes)} "
                            "would use them)")
    elif world % len(nodes) == 0:
        share = world // len(nodes)
        for n in nodes:
            cores = topo.physical_cores(topo.allowed_in(n))
            if len(cores) < share:
                raise BindingError(f"NUMA node {n} has {len(cores)} usable physical core(s), too few for "
                                   f"{share} ranks")
            for i in range(share):
                groups.append((n, cores[len(cores) * i // share:len(cores) * (i + 1) // share]))
        warnings.append(f"{world} ranks on {len(nodes)} NUMA node(s): {share} ranks share each node")
    else:
        raise BindingError(f"tensor_parallel_size {world} does not fit {len(nodes)} usable NUMA node(s) "
                           f"({format_cpulist(nodes)}): use as many ranks as nodes, or a multiple of it, or "
                           f"give {BIND_ENV} explicit CPU lists")
    default = reserved is None
    per_rank = (0 if world == 1 else 1) if default else reserved
    ranks, spare = [], []
    for r, (node, cores) in enumerate(groups):
        keep = per_rank
        if len(cores) - keep < 1:
            if not default:
                raise BindingError(f"{RESERVED_ENV}={reserved} leaves rank {r} no core: NUMA node {node} gives "
                                   f"it {len(cores)} usable physical core(s)")
            keep = 0
            warnings.append(f"rank {r} has a single core; none is reserved from it for the API process")
        used, res = cores[:len(cores) - keep], cores[len(cores) - keep:]
        cap = quota_threads(topo, world)
        if cap is not None and cap < len(used):
            warnings.append(f"a CPU quota of {topo.cpu_quota:g} CPUs (cgroup): rank {r} runs {cap} thread(s), "
                            f"not {len(used)}, so that no thread waits out the quota period")
            used, res = used[:cap], used[cap:] + res
        for c in res:
            spare.extend(topo.threads_of(c))
        ranks.append(_rank(topo, r, used, node, warnings))
    return BindingPlan("auto", tuple(ranks), tuple(sorted(spare)), tuple(warnings))


def quota_threads(topo: Topology, world: int) -> int | None:
    """Threads per rank that a CFS quota pays for (whole CPUs, at least one), or None without
    a quota: OpenMP threads beyond it are throttled in turn, and every barrier waits for them."""
    if topo.cpu_quota is None:
        return None
    return max(1, int(topo.cpu_quota + 1e-9) // world)


def _plan_lists(topo: Topology, world: int, bind: str) -> BindingPlan:
    parts = bind.split("|")
    if len(parts) != world:
        raise BindingError(f"{BIND_ENV}={bind!r} gives {len(parts)} CPU list(s) but tensor_parallel_size is "
                           f"{world}: give one list per rank, separated by '|' (e.g. 0-31|32-63)")
    ranks, seen, warnings = [], {}, []
    for r, part in enumerate(parts):
        try:
            cpus = parse_cpulist(part)
        except ValueError as e:
            raise BindingError(f"{BIND_ENV}: {e}") from None
        if not cpus:
            raise BindingError(f"{BIND_ENV}: the CPU list of rank {r} is empty")
        outside = [c for c in cpus if c not in topo.allowed_cpus]
        if outside:
            raise BindingError(f"{BIND_ENV}: CPU(s) {format_cpulist(outside)} of rank {r} are not in this "
                               f"process's allowed CPUs ({format_cpulist(topo.allowed_cpus)}; a container's "
                               "cpuset or taskset limits them)")
        clash = [c for c in cpus if c in seen]
        if clash:
            raise BindingError(f"{BIND_ENV}: CPU(s) {format_cpulist(clash)} are given to rank {seen[clash[0]]} "
                               f"and rank {r}; ranks must not share CPUs")
        for c in cpus:
            seen[c] = r
        nodes = sorted({topo.node_of(c) for c in cpus})
        if len(nodes) > 1:
            by_node = "; ".join(f"node {n}: {format_cpulist(c for c in cpus if topo.node_of(c) == n)}" for n in nodes)
            raise BindingError(f"{BIND_ENV}: rank {r}'s CPUs span NUMA nodes ({by_node}); keep each rank on one "
                               "node, and use one rank per node (tensor parallel) to use several")
        if len(topo.physical_cores(cpus)) < len(cpus):
            warnings.append(f"rank {r} puts threads on SMT siblings of the same core; one thread per physical "
                            "core is usually faster")
        ranks.append(_rank(topo, r, cpus, nodes[0], warnings))
    spare = sorted(c for c in topo.allowed_cpus if c not in seen)
    return BindingPlan("list", tuple(ranks), tuple(spare), tuple(warnings))


def _plan_nobind(topo: Topology, world: int, omp: int | None) -> BindingPlan:
    threads = omp if omp else max(1, len(topo.physical_cores(topo.allowed_cpus)) // world)
    if not omp and quota_threads(topo, world) is not None:
        threads = min(threads, quota_threads(topo, world))
    ranks = tuple(RankBinding(r, None, threads, None) for r in range(world))
    return BindingPlan("nobind", ranks, ())


def _oversubscription(topo: Topology, plan: BindingPlan) -> list[str]:
    total = sum(r.num_threads for r in plan.ranks)
    out = []
    if total > len(topo.allowed_cpus):
        out.append(f"{total} engine threads on {len(topo.allowed_cpus)} allowed CPU(s): threads oversubscribe "
                   "the cores and will be much slower; lower OMP_NUM_THREADS or the tensor-parallel size")
    elif topo.cpu_quota is not None and total > topo.cpu_quota + 1e-9:
        out.append(f"{total} engine threads but a CPU quota of {topo.cpu_quota:g} CPUs (cgroup cpu.max): "
                   "threads will be throttled; give the container whole CPUs (a static CPU manager cpuset) or "
                   "fewer threads")
    return out


def plan_from_env(topo: Topology, world_size: int, environ=os.environ) -> BindingPlan:
    return plan_binding(topo, world_size, **env_settings(environ))
