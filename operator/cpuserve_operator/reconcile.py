"""Level-based reconcile of one CPUModelServer: read the world, plan, make the
difference, write status. Called from kopf handlers (CR changes, its pods'
events, node events, a periodic resync); safe to run twice (deterministic names,
409 on create means already there)."""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

from cpuserve_operator import builders as b
from cpuserve_operator.placement import DEFAULT_ENGINE_IMAGE, Slot, node_from_api, parse_spec, plan

log = logging.getLogger("cpuserve_operator")

# the engine image a CPUModelServer gets when it names none (the chart: its appVersion's image)
ENGINE_IMAGE = os.environ.get("CPUSERVE_ENGINE_IMAGE") or DEFAULT_ENGINE_IMAGE
REJECTED_REASONS = ("OutOfcpu", "OutOfmemory", "TopologyAffinityError", "Evicted", "NodeAffinity", "UnexpectedAdmissionError")
BACKOFF_BASE_S, BACKOFF_MAX_S = 5.0, 300.0

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
# replica -> (failures, time of the last one): replacements wait BACKOFF_BASE_S * 2**(failures-1)
_backoff: dict[tuple[str, str, int], tuple[int, float]] = {}
# replica -> what happened to its last pod; reported until the replica is Ready again
_failures: dict[tuple[str, str], dict[int, str]] = {}


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((ns, name), threading.Lock())


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_ready(pod) -> bool:
    if pod.metadata.deletion_timestamp is not None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _rejected(pod) -> str | None:
    """The kubelet's reason when it refused or evicted the pod."""
    st = pod.status
    if st is not None and st.phase == "Failed":
        return st.reason or "Failed"
    return None


def reconcile(namespace: str, name: str, api: client.ApiClient | None = None) -> None:
    with _lock(namespace, name):
        _reconcile(namespace, name, api or client.ApiClient())


def _reconcile(ns: str, name: str, api: client.ApiClient) -> None:
    core, custom, net = client.CoreV1Api(api), client.CustomObjectsApi(api), client.NetworkingV1Api(api)
    try:
        cr = custom.get_namespaced_custom_object(b.GROUP, b.VERSION, ns, b.PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return
        raise
    if cr["metadata"].get("deletionTimestamp"):
        return
    spec = parse_spec(name, cr.get("spec", {}), ENGINE_IMAGE)
    want_hash = spec.hash()
    nodes_raw = core.list_node().items
    nrts = _node_resource_topologies(custom)
    nodes = [node_from_api(api.sanitize_for_serialization(n), nrts.get(n.metadata.name)) for n in nodes_raw]
    node_names = {n.name for n in nodes if n.ready}
    all_pods = core.list_pod_for_all_namespaces(label_selector=b.L_SERVER).items
    taken = {p.metadata.annotations.get(b.A_SLOT): f"{p.metadata.namespace}/{p.metadata.labels[b.L_SERVER]}"
             for p in all_pods if p.metadata.annotations and p.metadata.deletion_timestamp is None
             and not (p.metadata.namespace == ns and p.metadata.labels.get(b.L_SERVER) == name)}
    taken = {k: v for k, v in taken.items() if k}
    pods = [p for p in all_pods if p.metadata.namespace == ns and p.metadata.labels.get(b.L_SERVER) == name]
    events: list[str] = []

    # pods the kubelet rejected or that lost their node: report, delete, replace with backoff
    alive = []
    for p in pods:
        idx = int(p.metadata.labels.get(b.L_REPLICA, "-1"))
        why = _rejected(p)
        if why is None and p.spec.node_name not in node_names and p.metadata.deletion_timestamp is None:
            why = "NodeLost"
        if why is not None:
            key = (ns, name, idx)
            count = _backoff.get(key, (0, 0.0))[0] + 1
            _backoff[key] = (count, time.monotonic())
            events.append(f"replica {idx} pod {p.metadata.name} on {p.spec.node_name}: {why} "
                          f"({(p.status.message or '').strip() if p.status else ''}); replacing (failure {count})")
            _failures.setdefault((ns, name), {})[idx] = events[-1]
            _delete_pod(core, ns, p.metadata.name, force=why == "NodeLost")
            continue
        if p.metadata.deletion_timestamp is None:
            alive.append(p)
    current = [p for p in alive if p.metadata.labels.get(b.L_HASH) == want_hash]
    old = [p for p in alive if p.metadata.labels.get(b.L_HASH) != want_hash]
    def slots_of(group) -> dict[int, Slot]:
        out: dict[int, Slot] = {}
        for p in group:
            node, _, numa = (p.metadata.annotations or {}).get(b.A_SLOT, "").partition("/")
            if node and numa:
                out.setdefault(int(p.metadata.labels[b.L_REPLICA]), Slot(node, tuple(int(x) for x in numa.split(","))))
        return out

    new_slots, old_slots = slots_of(current), slots_of(old)
    # where every replica lives once rolled (an old pod's slot is reused when nothing else is free) ...
    result = plan(spec, nodes, taken, {**old_slots, **new_slots})
    # ... and where a replacement can start while the old pod still serves (surge by one)
    surge = plan(spec, nodes, {**taken, **{s.key: "rolling" for s in old_slots.values()}}, new_slots)
    by_index = {pl.index: pl for pl in result.placements}
    surge_by_index = {pl.index: pl for pl in surge.placements}
    cur_by_index = {int(p.metadata.labels[b.L_REPLICA]): p for p in current}
    old_by_index: dict[int, list] = {}
    for p in old:
        old_by_index.setdefault(int(p.metadata.labels[b.L_REPLICA]), []).append(p)

    # scale down: replicas beyond the count go, new and old
    for p in alive:
        if int(p.metadata.labels[b.L_REPLICA]) >= spec.replicas:
            _delete_pod(core, ns, p.metadata.name)
    # a replica whose new pod is Ready no longer needs its old pod
    for idx, olds in old_by_index.items():
        if idx in cur_by_index and _pod_ready(cur_by_index[idx]):
            for p in olds:
                _delete_pod(core, ns, p.metadata.name)
    # rolling: one replacement in flight at a time. In flight: a new pod not Ready yet, or a
    # replica with no pod at all (its old pod went first to free the slot).
    rolling_busy = bool(old_by_index) and (any(not _pod_ready(p) for p in cur_by_index.values()) or any(
        i not in cur_by_index and i not in old_by_index for i in by_index))
    for idx in range(spec.replicas):
        pl = by_index.get(idx)
        if pl is None or idx in cur_by_index:
            continue
        count, last = _backoff.get((ns, name, idx), (0, 0.0))
        if count and time.monotonic() - last < min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (count - 1)):
            continue  # replaced after a rejection: wait out the backoff, never a hot loop
        olds = old_by_index.get(idx, [])
        if olds:
            if rolling_busy:
                continue
            rolling_busy = True
            if idx in surge_by_index:
                pl = surge_by_index[idx]  # a free slot: start the new pod beside the old one
            else:
                for o in olds:  # no spare slot: the old pod makes room first
                    _delete_pod(core, ns, o.metadata.name)
                continue  # its slot is free once it is gone; a later pass creates the new pod
        _create(core.create_namespaced_pod, ns, b.build_pod(cr, spec, pl))
    failures = _failures.setdefault((ns, name), {})
    for idx, p in cur_by_index.items():
        if _pod_ready(p):
            failures.pop(idx, None)
            _backoff.pop((ns, name, idx), None)
    for idx in [i for i in failures if i >= spec.replicas]:
        failures.pop(idx)
    _apply_service(core, ns, b.build_service(cr, spec))
    _apply_ingress(net, ns, spec.name, b.build_ingress(cr, spec))
    _write_status(custom, ns, name, cr, spec, core, result, [failures[i] for i in sorted(failures)])
    for e in events:
        log.warning("%s/%s: %s", ns, name, e)


def _node_resource_topologies(custom) -> dict:
    try:
        items = custom.list_cluster_custom_object("topology.node.k8s.io", "v1alpha2", "noderesourcetopologies")
    except ApiException:
        return {}  # not installed
    return {i["metadata"]["name"]: i for i in items.get("items", [])}


def _create(fn, ns, body) -> None:
    try:
        fn(ns, body)
        log.info("created %s %s/%s", body["kind"], ns, body["metadata"]["name"])
    except ApiException as e:
        if e.status != 409:
            raise


def _delete_pod(core, ns, name, force=False) -> None:
    try:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0 if force else None)
        log.info("deleted pod %s/%s", ns, name)
    except ApiException as e:
        if e.status != 404:
            raise


def _apply_service(core, ns, body) -> None:
    try:
        existing = core.read_namespaced_service(body["metadata"]["name"], ns)
    except ApiException as e:
        if e.status != 404:
            raise
        _create(core.create_namespaced_service, ns, body)
        return
    if (existing.spec.type != body["spec"]["type"] or existing.spec.ports[0].port != body["spec"]["ports"][0]["port"]
            or existing.spec.selector != body["spec"]["selector"]):
        core.patch_namespaced_service(body["metadata"]["name"], ns, {"spec": body["spec"]})


def _apply_ingress(net, ns, name, body) -> None:
    try:
        net.read_namespaced_ingress(name, ns)
        exists = True
    except ApiException as e:
        if e.status != 404:
            raise
        exists = False
    if body is None:
        if exists:
            net.delete_namespaced_ingress(name, ns)
    elif exists:
        net.patch_namespaced_ingress(name, ns, {"spec": body["spec"]})
    else:
        _create(net.create_namespaced_ingress, ns, body)


def _condition(old: list, type_: str, status: bool, reason: str, message: str, gen: int) -> dict:
    s = "True" if status else "False"
    prev = next((c for c in old if c.get("type") == type_), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == s else _now()
    return {"type": type_, "status": s, "reason": reason, "message": message[:1000], "lastTransitionTime": since,
            "observedGeneration": gen}


def _placement(pod) -> dict:
    """A pod's entry in status.placements: its NUMA slot, and its CPUs: the operator's lists
    under pinning Engine, else what the kubelet gave the engine (the node agent records it)."""
    ann = pod.metadata.annotations or {}
    assigned = json.loads(ann.get(b.A_ASSIGNED) or "{}")
    out = {"pod": pod.metadata.name, "node": pod.spec.node_name or "",
           "numaNodes": [int(x) for x in ann.get(b.A_SLOT, "/").split("/")[1].split(",") if x != ""],
           "cpus": ann.get(b.A_CPUS) or assigned.get("cpus", ""), "ready": _pod_ready(pod)}
    if "memoryNodes" in assigned:
        out["memoryNodes"] = assigned["memoryNodes"]
    return out


def _write_status(custom, ns, name, cr, spec, core, result, events) -> None:
    pods = core.list_namespaced_pod(ns, label_selector=f"{b.L_SERVER}={name}").items
    pods = [p for p in pods if p.metadata.deletion_timestamp is None]
    want = spec.hash()
    current = [p for p in pods if p.metadata.labels.get(b.L_HASH) == want]
    ready = [p for p in current if _pod_ready(p)]
    desired = spec.replicas
    gen = cr["metadata"].get("generation", 0)
    outdated = len(pods) - len(current)
    if result.reason_code == "DoesNotFitNUMANode":
        phase = "Failed"
    elif len(ready) == desired and not outdated:
        phase = "Ready"
    elif ready and (result.unplaced or events):
        phase = "Degraded"
    elif not pods and result.unplaced:
        phase = "Pending"
    else:
        phase = "Loading"
    old = (cr.get("status") or {}).get("conditions", [])
    progressing = bool(outdated or len(current) < desired - result.unplaced or len(ready) < len(current))
    conds = [
        _condition(old, "Ready", phase == "Ready", "AllReplicasReady" if phase == "Ready" else
                   (result.reason_code or "ReplicasNotReady"),
                   f"{len(ready)}/{desired} replicas ready" + (f"; {result.reason}" if result.reason else ""), gen),
        _condition(old, "Progressing", progressing, "RollingUpdate" if outdated else
                   ("PodsStarting" if progressing else "Stable"),
                   f"{outdated} pod(s) of an older spec left" if outdated else
                   f"{len(current) - len(ready)} pod(s) starting" if progressing else "nothing to do", gen),
        _condition(old, "Degraded", bool(result.unplaced or events), result.reason_code or
                   ("PodRejected" if events else "AsExpected"),
                   "; ".join(([result.reason] if result.reason else []) + events) or "no problem", gen),
    ]
    placements = [_placement(p) for p in sorted(current, key=lambda p: int(p.metadata.labels[b.L_REPLICA]))]
    status = {"phase": phase, "replicas": len(current), "readyReplicas": len(ready),
              "readyText": f"{len(ready)}/{desired}", "selector": f"{b.L_SERVER}={name}",
              "endpoint": b.endpoint(cr, spec), "observedGeneration": gen, "specHash": want,
              "placements": placements, "conditions": conds}
    prev = dict(cr.get("status") or {})
    if {k: v for k, v in prev.items() if k in status} != status:
        custom.patch_namespaced_custom_object_status(b.GROUP, b.VERSION, ns, b.PLURAL, name, {"status": status})
