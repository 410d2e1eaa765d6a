"""Placement: which node and NUMA node(s) each replica of a CPUModelServer runs
on, and how large its pod is. Pure functions of the CR's spec and the nodes'
topology; the reconciler only carries the result out.

A *slot* is one NUMA node of a machine (PerNUMANode: one single-rank replica
each, data parallel) or `tensorParallelSize` NUMA nodes of one machine
(TensorParallel: one pod, one engine rank per NUMA node). A pod gets its slot's
logical CPUs minus `reservedCPUs` cores per NUMA node (left to the kubelet and
the node's daemons), and memory for weights + KV cache per rank + overhead.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

GiB = 1 << 30
LABEL_PREFIX = "cpuserve.dev/"
TOPOLOGY_ANNOTATION = "cpuserve.dev/topology"
# the node agent: the kubelet's CPU and memory manager policies, from its pod-resources API
KUBELET_ANNOTATION = "cpuserve.dev/kubelet"


# -- inputs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]          # logical CPU ids
    memory: int                    # bytes
    threads_per_core: int = 1
    cores: tuple[int, ...] = ()    # the first thread of each core, as the node agent read the siblings

    @property
    def physical_cores(self) -> tuple[int, ...]:
        """First thread of each core: what the agent published, else the common numbering's guess
        (all first threads, then all second threads) for topology published by older agents."""
        if self.cores:
            return self.cores
        n = max(1, len(self.cpus) // max(1, self.threads_per_core))
        return self.cpus[:n]


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"  # NoSchedule | PreferNoSchedule | NoExecute


def tolerates(tol: dict, taint: Taint) -> bool:
    """Whether a toleration (core/v1 Toleration) matches a taint, as the scheduler and the taint
    manager read it: an empty key with Exists matches every key, Exists any value, Equal (the
    default) the same value; an empty effect every effect."""
    if tol.get("effect") and tol["effect"] != taint.effect:
        return False
    if tol.get("operator", "Equal") == "Exists":
        return not tol.get("key") or tol["key"] == taint.key
    return tol.get("key", "") == taint.key and tol.get("value", "") == taint.value


# the taints of a node gone NotReady or unreachable, which every pod tolerates for the operator's
# node-lost grace (builders.tolerations)
NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
NODE_LOST_TOLERATIONS = tuple({"key": k, "operator": "Exists", "effect": "NoExecute"} for k in NODE_LOST_TAINTS)


# taints that mirror what the operator reads from the node itself: its Ready condition (with the
# node-lost grace) and spec.unschedulable (cordoned); the node lifecycle controller sets them
LIFECYCLE_TAINTS = NODE_LOST_TAINTS + ("node.kubernetes.io/unschedulable",)


def untolerated(taints: tuple[Taint, ...], tolerations: tuple[dict, ...]) -> list[Taint]:
    """The taints that keep a pod with these tolerations off a node: NoSchedule and NoExecute (the
    operator binds pods by nodeName, past the scheduler, so it must honour them itself; the taint
    manager would evict a pod on an untolerated NoExecute taint at once), but LIFECYCLE_TAINTS."""
    return [t for t in taints if t.effect in ("NoSchedule", "NoExecute") and t.key not in LIFECYCLE_TAINTS
            and not any(tolerates(x, t) for x in tolerations)]


def avoided(taints: tuple[Taint, ...], tolerations: tuple[dict, ...]) -> int:
    """How many of a node's PreferNoSchedule taints these tolerations leave untolerated: the
    scheduler's soft taints (its TaintToleration score counts them), which plan() honours by
    filling such nodes' slots only after every node with fewer."""
    return sum(1 for t in taints if t.effect == "PreferNoSchedule" and not any(tolerates(x, t) for x in tolerations))


@dataclass(frozen=True)
class Node:
    name: str
    arch: str
    numa: tuple[NumaNode, ...]
    isa: frozenset[str] = frozenset()
    labels: dict = field(default_factory=dict, hash=False, compare=False)
    ready: bool = True
    schedulable: bool = True
    known_topology: bool = True    # False: nothing published; seen as one NUMA node of its allocatable CPUs
    cpu_ids_known: bool = True     # False: counts only (NodeResourceTopology, nothing published)
    cpu_manager: str = ""          # the kubelet's CPU manager policy: static, none, or "" (not reported)
    topology_policy: str = ""      # its topology manager policy (single-numa-node, restricted, ...), "" unknown
    taints: tuple[Taint, ...] = ()

    @property
    def lists_possible(self) -> bool:
        """CPU lists can be given only where the node's real CPU ids are known."""
        return self.known_topology and self.cpu_ids_known


@dataclass(frozen=True)
class ServerSpec:
    name: str
    model_source: str
    served_name: str
    size_gib: float
    dtype: str
    kv_cache_gib: float | None     # None: the engine sizes its KV cache from the pod's memory limit
    overhead_gib: float
    max_num_seqs: int
    max_model_len: int | None
    extra_args: tuple[str, ...]
    strategy: str
    tp: int
    reserved_cpus: int
    pinning: str
    required_isa: tuple[str, ...]
    node_selector: dict
    seccomp_type: str
    seccomp_localhost: str | None
    replicas: int
    image: str
    pull_secrets: tuple[str, ...]
    pull_policy: str
    service_type: str
    port: int
    ingress: dict
    model_path: str = ""           # image://: the model's directory or file inside the image
    model_sha256: str = ""         # http(s)://, s3://: the file's checksum, verified when fetched
    memory_gib: float | None = None  # the pod's memory as given (None: computed, see pod_memory)
    tolerations: tuple[dict, ...] = ()  # placement.tolerations: the pods', and the tainted nodes they may use
    api_key_secret: tuple[str, str] | None = None  # service.apiKeySecret: (Secret name, key) of the API key
    service_monitor: dict | None = None  # monitoring.serviceMonitor where enabled: {interval, labels}
    lora_adapters: tuple[tuple[str, str, str], ...] = ()  # model.loraAdapters: (name, source, path)
    max_lora_rank: int = 16        # engine.maxLoRARank

    @property
    def ranks(self) -> int:
        return self.tp if self.strategy == "TensorParallel" else 1

    @property
    def root_path(self) -> str:
        """The prefix the Ingress routes to the server under ("" for /): the engine's --root-path,
        since an Ingress passes the path on as the client sent it."""
        return self.ingress.get("path", "/").rstrip("/") if self.ingress.get("enabled") else ""

    def hash(self) -> str:
        """What the pods are built from (not replicas, the Service's type, or the Ingress but for its
        path): a change rolls the pods."""
        keys = ("model_source", "model_path", "model_sha256", "served_name", "size_gib", "dtype", "kv_cache_gib",
                "overhead_gib", "memory_gib", "max_num_seqs", "max_model_len", "extra_args", "strategy", "tp", "reserved_cpus", "pinning", "required_isa",
                "node_selector", "seccomp_type", "seccomp_localhost", "image", "pull_secrets", "pull_policy", "port",
                "tolerations")
        made_of = {k: getattr(self, k) for k in keys}
        # newer fields only where set, so that an operator upgrade leaves the hashes of servers
        # without them, and so their pods, as they were
        made_of.update({k: getattr(self, k) for k in ("root_path", "api_key_secret") if getattr(self, k)})
        if self.lora_adapters:
            made_of.update(lora_adapters=self.lora_adapters, max_lora_rank=self.max_lora_rank)
        blob = json.dumps(made_of, sort_keys=True, default=list)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


DEFAULT_ENGINE_IMAGE = "ghcr.io/cpuserve/cpuserve-engine:0.1.0"


def engine_image(img: dict, default: str) -> str:
    """The CR's image.repository[:tag], else the operator's default (the chart sets it to
    the engine image of its appVersion). A tag without a repository retags the default."""
    repo, tag = img.get("repository"), img.get("tag")
    if not repo:
        base = default.rsplit(":", 1)[0] if ":" in default.rsplit("/", 1)[-1] else default
        return f"{base}:{tag}" if tag else default
    return f"{repo}:{tag}" if tag else repo


def _gib(value) -> float | None:
    return None if value is None else float(value)


def parse_spec(name: str, spec: dict, default_image: str = DEFAULT_ENGINE_IMAGE) -> ServerSpec:
    """The CR's spec with the CRD's defaults filled in (the API server applies them
    too; filling them here keeps the planner usable on partial objects in tests)."""
    m, e, p = spec.get("model", {}), spec.get("engine", {}), spec.get("placement", {})
    sec, img, svc = spec.get("seccompProfile", {}), spec.get("image", {}), spec.get("service", {})
    ing = {"enabled": False, "host": "", "className": "", "path": "/", "tls": False, **spec.get("ingress", {})}
    return ServerSpec(
        name=name, model_source=m.get("source", "packaged://smollm2"), served_name=m.get("servedName", "model"),
        size_gib=float(m.get("sizeGiB", 1)), dtype=e.get("dtype", "auto"), kv_cache_gib=_gib(e.get("kvCacheGiB")),
        overhead_gib=float(e.get("overheadGiB", 1)), memory_gib=_gib(e.get("memoryGiB")), max_num_seqs=int(e.get("maxNumSeqs", 128)),
        max_model_len=e.get("maxModelLen"), extra_args=tuple(e.get("extraArgs", [])),
        strategy=p.get("strategy", "PerNUMANode"), tp=int(p.get("tensorParallelSize", 1)),
        reserved_cpus=int(p.get("reservedCPUs", 1)), pinning=p.get("pinning", "Kubelet"),
        required_isa=tuple(p.get("requiredISA", [])), node_selector=dict(p.get("nodeSelector", {})),
        seccomp_type=sec.get("type", "RuntimeDefault"), seccomp_localhost=sec.get("localhostProfile"),
        replicas=int(spec.get("replicas", 1)),
        image=engine_image(img, default_image), pull_secrets=tuple(img.get("pullSecrets", [])),
        pull_policy=img.get("pullPolicy", "IfNotPresent"), service_type=svc.get("type", "ClusterIP"),
        port=int(svc.get("port", 8000)), ingress=ing, model_path=str(m.get("path", "")).strip("/"),
        model_sha256=str(m.get("sha256", "")).lower(), tolerations=tuple(p.get("tolerations", [])),
        api_key_secret=_secret_ref(svc.get("apiKeySecret")),
        service_monitor=_service_monitor(spec.get("monitoring", {}).get("serviceMonitor", {})),
        lora_adapters=tuple((a["name"], a["source"], str(a.get("path", "")).strip("/"))
                            for a in m.get("loraAdapters", [])),
        max_lora_rank=int(e.get("maxLoRARank", 16)))


def _service_monitor(sm: dict) -> dict | None:
    if not sm.get("enabled"):
        return None
    return {"interval": sm.get("interval", "30s"), "labels": dict(sm.get("labels", {}))}


def _secret_ref(ref: dict | None) -> tuple[str, str] | None:
    return None if not ref else (ref["name"], ref.get("key", "api-key"))


# -- node topology from the API ------------------------------------------------------------------
def _cpulist(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(out)))


def node_from_api(node: dict, nrt: dict | None = None) -> Node:
    """Node topology from, in order: our agent's annotation, a NodeResourceTopology
    object, or nothing (one NUMA node of the allocatable CPUs and memory). ISA flags
    from our labels and node-feature-discovery's."""
    meta, status = node.get("metadata", {}), node.get("status", {})
    labels, ann = meta.get("labels", {}) or {}, meta.get("annotations", {}) or {}
    arch = labels.get("kubernetes.io/arch", "amd64")
    isa = {k[len(LABEL_PREFIX) + 4:] for k, v in labels.items() if k.startswith(LABEL_PREFIX + "isa.") and v == "true"}
    for k, v in labels.items():  # node-feature-discovery: feature.node.kubernetes.io/cpu-cpuid.AVX512F=true
        if k.startswith("feature.node.kubernetes.io/cpu-cpuid.") and v == "true":
            isa.add(k.rsplit(".", 1)[1].lower())
    conds = {c.get("type"): c.get("status") for c in status.get("conditions", []) or []}
    ready = conds.get("Ready") == "True"
    schedulable = not (node.get("spec", {}) or {}).get("unschedulable", False)
    numa: list[NumaNode] = []
    known = True
    kubelet = json.loads(ann[KUBELET_ANNOTATION]) if ann.get(KUBELET_ANNOTATION) else {}
    if TOPOLOGY_ANNOTATION in ann:
        data = json.loads(ann[TOPOLOGY_ANNOTATION])
        tpc = int(data.get("threadsPerCore", 1))
        numa = [NumaNode(int(n["id"]), _cpulist(n["cpus"]), int(n["memory"]), tpc, _cpulist(n.get("cores", "")))
                for n in data["numaNodes"]]
    elif nrt is not None:  # topology.node.k8s.io NodeResourceTopology: zones of type Node
        for z in nrt.get("zones", []) or []:
            if z.get("type") != "Node":
                continue
            res = {r["name"]: r for r in z.get("resources", []) or []}
            cpus = int(_quantity(res.get("cpu", {}).get("capacity", "0")))
            mem = int(_quantity(res.get("memory", {}).get("capacity", "0")))
            nid = int(z["name"].rsplit("-", 1)[-1]) if z["name"].rsplit("-", 1)[-1].isdigit() else len(numa)
            numa.append(NumaNode(nid, tuple(range(cpus)), mem))  # ids unknown: counts only (cpu_ids_known)
    if not numa:
        known = False
        alloc = status.get("allocatable", {}) or {}
        numa = [NumaNode(0, tuple(range(int(_quantity(alloc.get("cpu", "0"))))), int(_quantity(alloc.get("memory", "0"))))]
    taints = tuple(Taint(t.get("key", ""), t.get("value", "") or "", t.get("effect", "NoSchedule"))
                   for t in (node.get("spec", {}) or {}).get("taints", []) or [])
    return Node(meta["name"], arch, tuple(sorted(numa, key=lambda n: n.id)), frozenset(isa), labels, ready,
                schedulable, known, cpu_ids_known=TOPOLOGY_ANNOTATION in ann, taints=taints,
                cpu_manager=str(kubelet.get("cpuManagerPolicy", "")),
                topology_policy=str(kubelet.get("topologyManagerPolicy", "")))


_SUFFIX = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9,
           "T": 10**12, "m": 1e-3}


def _quantity(q) -> float:
    q = str(q)
    for s in sorted(_SUFFIX, key=len, reverse=True):
        if q.endswith(s):
            return float(q[: -len(s)]) * _SUFFIX[s]
    return float(q)


# -- outputs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    node: str
    numa: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.node}/{','.join(map(str, self.numa))}"


@dataclass(frozen=True)
class Placement:
    index: int
    slot: Slot
    cpus: int                      # whole CPUs requested (= limit)
    memory: int                    # bytes requested (= limit)
    rank_cpus: tuple[tuple[int, ...], ...] = ()  # the engine binds itself: each rank's CPU list
    arch: str = "amd64"
    kubelet_pins: bool = False     # the kubelet's static CPU manager chooses the cpuset (whatever spec.pinning)
    isa_labels: tuple[tuple[str, str], ...] = ()  # the node's labels that show the required ISA


def _isa_key(flag: str) -> str:
    """One spelling for a flag: ours (/proc/cpuinfo's, avx512_vnni) and NFD's (AVX512VNNI) meet."""
    return flag.lower().replace("_", "")


def isa_labels(node: Node, required: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """For each required ISA flag, the label this node has for it: ours (the node agent's),
    else node-feature-discovery's (its flag spelled as NFD spells it, e.g. AVX512F)."""
    out = []
    for flag in required:
        ours = f"{LABEL_PREFIX}isa.{flag}"
        if node.labels.get(ours) == "true":
            out.append((ours, "true"))
            continue
        nfd = next((k for k, v in node.labels.items() if v == "true" and
                    k.startswith("feature.node.kubernetes.io/cpu-cpuid.") and
                    _isa_key(k.rsplit(".", 1)[1]) == _isa_key(flag)), None)
        out.append((nfd or ours, "true"))
    return tuple(out)


def engine_binds(spec: ServerSpec, node: Node) -> bool:
    """Who puts the engine on its slot. A static CPU manager gives the pod a cpuset nothing
    inside can widen: there the engine binds within it ("auto", memory on those CPUs' node),
    under either pinning. Elsewhere the pod may run on every CPU, so the engine is told its
    slot's CPU lists: always under pinning Engine, and under pinning Kubelet where the agent
    reports the CPU manager is `none` (where nothing is reported, "auto" is the safe choice:
    lists outside an unknown cpuset would stop the engine)."""
    if node.cpu_manager == "static" or not node.lists_possible:  # no lists without real CPU ids
        return False
    return spec.pinning == "Engine" or node.cpu_manager == "none"


@dataclass
class Plan:
    placements: list[Placement]
    unplaced: int = 0
    reason: str = ""               # why replicas are missing (a condition's message)
    reason_code: str = ""


DEFAULT_KV_GIB = 4.0  # per rank, for sizing a pod whose spec gives neither memoryGiB nor kvCacheGiB (vLLM's)


def pod_memory(spec: ServerSpec) -> int:
    """The pod's memory (request = limit): spec.engine.memoryGiB as given, passed through to the
    engine, which sizes its KV cache from it; else weights + KV per rank x ranks + overhead."""
    if spec.memory_gib is not None:
        return int(spec.memory_gib * GiB)
    kv = DEFAULT_KV_GIB if spec.kv_cache_gib is None else spec.kv_cache_gib
    return int((spec.size_gib + kv * spec.ranks + spec.overhead_gib) * GiB)


def rank_memory(spec: ServerSpec) -> float:
    """GiB one rank needs on its NUMA node: its share of the pod's memory."""
    return pod_memory(spec) / GiB / spec.ranks


def memory_breakdown(spec: ServerSpec) -> str:
    if spec.memory_gib is not None:
        return f"engine.memoryGiB {spec.memory_gib:g} / {spec.ranks} ranks"
    kv = DEFAULT_KV_GIB if spec.kv_cache_gib is None else spec.kv_cache_gib
    return f"weights {spec.size_gib:g} GiB / {spec.ranks} + KV {kv:g} GiB + overhead"


def eligible(node: Node, spec: ServerSpec) -> str | None:
    """None if the node may host this server, else why not."""
    if not node.ready:
        return "not Ready"
    if not node.schedulable:
        return "cordoned"
    bad = untolerated(node.taints, spec.tolerations)
    if bad:
        return "taint " + ", ".join(f"{t.key}{'=' + t.value if t.value else ''}:{t.effect}" for t in bad) + \
            " not tolerated (placement.tolerations)"
    have = {_isa_key(f) for f in node.isa}
    missing = [f for f in spec.required_isa if _isa_key(f) not in have]
    if missing:
        return f"lacks ISA {', '.join(missing)}"
    for k, v in spec.node_selector.items():
        if node.labels.get(k) != v:
            return f"label {k}!={v}"
    if spec.ranks > 1 and node.cpu_manager == "static" and node.topology_policy == "single-numa-node":
        return ("topologyManagerPolicy single-numa-node: the kubelet admits no pod over several NUMA nodes "
                "(serve TensorParallel from nodes with policy restricted)")
    if spec.pinning == "Engine" and not node.lists_possible and node.cpu_manager != "static":
        return "CPU ids unknown (no cpuserve.dev/topology: pinning Engine needs CPU lists)"
    return None


def node_slots(node: Node, spec: ServerSpec) -> list[Slot]:
    ids = [n.id for n in node.numa]
    k = spec.ranks
    return [Slot(node.name, tuple(ids[i:i + k])) for i in range(0, len(ids) - k + 1, k)]


def slot_resources(node: Node, slot: Slot, spec: ServerSpec) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(whole CPUs for the pod, per-rank CPU lists for pinning Engine)."""
    cpus, lists = 0, []
    for nid in slot.numa:
        n = next(x for x in node.numa if x.id == nid)
        keep = max(0, len(n.cpus) - spec.reserved_cpus * n.threads_per_core)
        cpus += keep
        cores = n.physical_cores
        lists.append(tuple(cores[:max(0, len(cores) - spec.reserved_cpus)]))
    return cpus, tuple(lists)


@dataclass
class _Survey:
    """The slots where a rank fits and no other server's pod runs, grouped by machine in name
    order, and why the rest were passed over (for the condition when replicas go unplaced)."""
    candidates: list[list[Slot]] = field(default_factory=list)
    avoided: dict[str, int] = field(default_factory=dict)  # node -> untolerated PreferNoSchedule taints
    ineligible: list[str] = field(default_factory=list)
    too_small: list[str] = field(default_factory=list)
    no_cpu: list[str] = field(default_factory=list)


def _slot_fits(node: Node, slot: Slot, spec: ServerSpec, survey: _Survey) -> bool:
    where = f"{node.name} NUMA {','.join(map(str, slot.numa))}"
    mem = min(next(x for x in node.numa if x.id == i).memory for i in slot.numa)
    if mem < rank_memory(spec) * GiB:
        survey.too_small.append(f"{where} has {mem / GiB:.1f} GiB")
        return False
    cpus, lists = slot_resources(node, slot, spec)
    if cpus < 1 or (engine_binds(spec, node) and min(len(x) for x in lists) < 1):
        survey.no_cpu.append(where)
        return False
    return True


def _survey(spec: ServerSpec, nodes: list[Node], taken: dict[str, str]) -> _Survey:
    survey = _Survey()
    for node in sorted(nodes, key=lambda n: n.name):
        why = eligible(node, spec)
        if why:
            survey.ineligible.append(f"{node.name}: {why}")
            continue
        # a pod takes its whole slot: never two pods on one NUMA slot
        ok = [s for s in node_slots(node, spec) if _slot_fits(node, s, spec, survey) and s.key not in taken]
        if ok:
            survey.candidates.append(ok)
            survey.avoided[node.name] = avoided(node.taints, spec.tolerations)
    return survey


def _assign(spec: ServerSpec, candidates: list[list[Slot]], current: dict[int, Slot], keep: set[str] | frozenset,
            known: set[str], soft: dict[str, int] | None = None) -> dict[int, Slot]:
    """Keeps each current placement that is still valid (or on a kept, known node), then fills the
    other replicas round-robin over machines: every machine's first slot, then every second; the
    machines with untolerated PreferNoSchedule taints (`soft`: how many) only after the others, fewest first."""
    valid = {s.key for group in candidates for s in group}
    placed = {i: s for i, s in current.items()
              if i < spec.replicas and (s.key in valid or (s.node in keep and s.node in known))}
    used = {s.key for s in placed.values()}
    soft = soft or {}
    order = []
    for tier in sorted({soft.get(g[0].node, 0) for g in candidates}):
        groups = [g for g in candidates if soft.get(g[0].node, 0) == tier]
        order += [g[depth] for depth in range(max(map(len, groups))) for g in groups if depth < len(g)]
    free = [s for s in order if s.key not in used]
    for i in range(spec.replicas):
        if i not in placed and free:
            placed[i] = free.pop(0)
    return placed


def _placement(i: int, slot: Slot, node: Node, spec: ServerSpec) -> Placement:
    cpus, lists = slot_resources(node, slot, spec)
    return Placement(i, slot, cpus, pod_memory(spec), lists if engine_binds(spec, node) else (), node.arch,
                     kubelet_pins=node.cpu_manager == "static", isa_labels=isa_labels(node, spec.required_isa))


def _shortfall(spec: ServerSpec, out: list[Placement], survey: _Survey) -> Plan:
    missing = spec.replicas - len(out)
    if survey.too_small and not survey.candidates:
        reason = (f"a rank needs {rank_memory(spec):.1f} GiB on its NUMA node ({memory_breakdown(spec)}), but "
                  + "; ".join(survey.too_small[:4]))
        return Plan(out, missing, reason, "DoesNotFitNUMANode")
    detail = []
    if survey.ineligible:
        detail.append("ineligible nodes: " + "; ".join(survey.ineligible[:4]))
    if survey.no_cpu:
        detail.append(f"no CPU left after reservedCPUs={spec.reserved_cpus} on " + "; ".join(survey.no_cpu[:4]))
    if survey.too_small:
        detail.append("too little memory: " + "; ".join(survey.too_small[:4]))
    return Plan(out, missing, f"{missing} of {spec.replicas} replicas have no free NUMA slot"
                + (f" ({'; '.join(detail)})" if detail else ""), "InsufficientNUMASlots")


def plan(spec: ServerSpec, nodes: list[Node], taken: dict[str, str] | None = None,
         current: dict[int, Slot] | None = None, keep: set[str] | frozenset = frozenset(),
         one_node: bool = False) -> Plan:
    """Places replicas 0..replicas-1. `current` keeps each existing replica's slot
    where it is still valid (no churn), and on the nodes in `keep` even when they are not
    eligible now (a NotReady node within its grace period); `taken` maps slot keys held by *other*
    servers' pods (pinning Engine never gives one NUMA slot to two pods).
    Slots are filled spreading over machines first, in name order; with `one_node` (a
    ReadWriteOnce model claim) every replica goes where one already runs, else to the machine
    with the most free slots."""
    current = current or {}
    by_name = {n.name: n for n in nodes}
    survey = _survey(spec, nodes, taken or {})
    candidates = survey.candidates
    if one_node and candidates:
        home = next((s.node for s in current.values() if any(s in g for g in candidates)), None)
        candidates = [next((g for g in candidates if g[0].node == home), max(candidates, key=len))]
    placed = _assign(spec, candidates, current, keep, set(by_name), survey.avoided)
    out = [_placement(i, slot, by_name[slot.node], spec) for i, slot in sorted(placed.items())]
    return Plan(out) if len(out) == spec.replicas else _shortfall(spec, out, survey)
