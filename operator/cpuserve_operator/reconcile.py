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
from cpuserve_operator import events
from cpuserve_operator.metrics import EVENTS, QUEUE_SECONDS, RECONCILE_SECONDS, RECONCILES, observe_server
from cpuserve_operator.placement import DEFAULT_ENGINE_IMAGE, Plan, Slot, node_from_api, parse_spec, plan
from cpuserve_operator.podstate import Problem, node_lost_for, pod_problem

log = logging.getLogger("cpuserve_operator")

# the engine image a CPUModelServer gets when it names none (the chart: its appVersion's image)
ENGINE_IMAGE = os.environ.get("CPUSERVE_ENGINE_IMAGE") or DEFAULT_ENGINE_IMAGE
BACKOFF_BASE_S, BACKOFF_MAX_S = 5.0, 300.0

# how long a node may be NotReady (or unreachable) before its pods count as lost: Kubernetes'
# own default for taint-based eviction (the pods also tolerate the taints exactly this long)
NODE_LOST_GRACE_S = float(os.environ.get("CPUSERVE_NODE_LOST_GRACE", "300"))

_locks: dict[tuple[str, str], threading.Lock] = {}
# servers reconcile concurrently (kopf's thread pool): reading which NUMA slots are taken and
# creating the pods that take more is one step, or two servers' pods land on one slot
_PLACEMENT = threading.Lock()
_locks_guard = threading.Lock()
# replica -> (failures, time of the last one): replacements wait BACKOFF_BASE_S * 2**(failures-1)
_backoff: dict[tuple[str, str, int], tuple[int, float]] = {}
# replica -> what happened to its last pod; reported until the replica is Ready again
_failures: dict[tuple[str, str], dict[int, str]] = {}
# server -> {(replica, reason)} already told as Events: a problem is an Event once, not every pass
_told: dict[tuple[str, str], set] = {}


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((ns, name), threading.Lock())


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_ready(pod) -> bool:
    if pod.metadata.deletion_timestamp is not None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def reconcile(namespace: str, name: str, api: client.ApiClient | None = None) -> None:
    queued = time.monotonic()
    with _lock(namespace, name):
        QUEUE_SECONDS.observe(time.monotonic() - queued)
        with RECONCILE_SECONDS.time():
            try:
                _reconcile(namespace, name, api or client.ApiClient())
            except Exception:
                RECONCILES.labels("error").inc()
                raise
        RECONCILES.labels("ok").inc()


class _Pass:
    """One reconcile pass of one server: the API clients, the CR, and what to tell."""

    def __init__(self, api: client.ApiClient, cr: dict):
        self.api, self.cr = api, cr
        self.core = client.CoreV1Api(api)
        self.ns, self.name = cr["metadata"]["namespace"], cr["metadata"]["name"]
        self.problems: dict[int, tuple[str, Problem]] = {}   # replica -> (pod, what keeps it from serving)
        self.told = _told.setdefault((self.ns, self.name), set())
        self.seen: set = set()

    def event(self, type_: str, reason: str, message: str, once: tuple | None = None) -> None:
        """Records an Event; with `once`, only the first time that key is seen in a row of passes."""
        if once is not None:
            self.seen.add(once)
            if once in self.told:
                return
            self.told.add(once)
        EVENTS.labels(type_, reason).inc()
        events.record(self.core, self.cr, type_, reason, message)

    def forget_resolved(self) -> None:
        self.told &= self.seen  # a problem that went away is told again if it comes back

    def triage(self, pods: list, nodes: dict[str, dict]) -> list:
        """Pods the kubelet rejected, or whose node has been lost for the grace period, go (and
        are replaced with backoff); problems of the others are reported. Returns the live pods."""
        alive, now = [], time.time()
        for p in pods:
            idx = int(p.metadata.labels.get(b.L_REPLICA, "-1"))
            lost = node_lost_for(nodes.get(p.spec.node_name), now) if p.spec.node_name else 0.0
            if p.metadata.deletion_timestamp is not None:
                self._finish_lost(p, lost, now)
                continue
            prob = pod_problem(self.api.sanitize_for_serialization(p))
            if prob is not None and prob.fatal:
                self._replace(p, idx, prob.reason, prob.message)
            elif lost >= NODE_LOST_GRACE_S:
                self._replace(p, idx, "NodeLost", f"node {p.spec.node_name} not Ready for {lost:.0f}s "
                              f"(grace {NODE_LOST_GRACE_S:.0f}s)")
            else:
                if lost > 0:
                    prob = Problem("NodeNotReady", f"node {p.spec.node_name} not Ready for {lost:.0f}s; the pod "
                                   f"is kept for the {NODE_LOST_GRACE_S:.0f}s grace period")
                if prob is not None:
                    self.problems[idx] = (p.metadata.name, prob)
                    self.event("Warning", prob.reason, f"replica {idx}: {prob.describe(p.metadata.name)}",
                               once=(idx, prob.reason))
                alive.append(p)
        return alive

    def _replace(self, p, idx: int, why: str, message: str) -> None:
        key = (self.ns, self.name, idx)
        count = _backoff.get(key, (0, 0.0))[0] + 1
        _backoff[key] = (count, time.monotonic())
        text = f"replica {idx} pod {p.metadata.name} on {p.spec.node_name}: {why} ({message}); replacing " \
               f"(failure {count})"
        _failures.setdefault((self.ns, self.name), {})[idx] = text
        self.event("Warning", "Replacing", text)
        _delete_pod(self.core, self.ns, p.metadata.name)  # graceful: the kubelet (or the taint manager) finishes it

    def _finish_lost(self, p, lost: float, now: float) -> None:
        """A pod deleted on a lost node never finishes terminating (no kubelet confirms it), and
        its name is its replica's: once its grace period has passed too, it is force-deleted."""
        if lost < NODE_LOST_GRACE_S:
            return
        grace = p.metadata.deletion_grace_period_seconds or 0
        if now - p.metadata.deletion_timestamp.timestamp() >= grace:
            self.event("Warning", "ForceDeleted", f"pod {p.metadata.name}: node {p.spec.node_name} lost for "
                       f"{lost:.0f}s and the pod's {grace}s termination grace is over")
            _delete_pod(self.core, self.ns, p.metadata.name, force=True)


def _reconcile(ns: str, name: str, api: client.ApiClient) -> None:
    core, custom, net = client.CoreV1Api(api), client.CustomObjectsApi(api), client.NetworkingV1Api(api)
    try:
        cr = custom.get_namespaced_custom_object(b.GROUP, b.VERSION, ns, b.PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            observe_server(ns, name, None, {})
            return
        raise
    if cr["metadata"].get("deletionTimestamp"):
        return
    spec = parse_spec(name, cr.get("spec", {}), ENGINE_IMAGE)
    want_hash = spec.hash()
    nodes_raw = {n.metadata.name: api.sanitize_for_serialization(n) for n in core.list_node().items}
    nrts = _node_resource_topologies(custom)
    nodes = [node_from_api(n, nrts.get(k)) for k, n in nodes_raw.items()]
    grace_nodes = {k for k, n in nodes_raw.items() if 0 < node_lost_for(n, time.time()) < NODE_LOST_GRACE_S}
    ps = _Pass(api, cr)
    with _PLACEMENT:  # the slots other servers' pods hold are read and taken in one step
        result, current = _place(ps, spec, want_hash, nodes, nodes_raw, grace_nodes)
    failures = _failures.setdefault((ns, name), {})
    cur_by_index = {int(p.metadata.labels[b.L_REPLICA]): p for p in current}
    for idx, p in cur_by_index.items():
        if _pod_ready(p):
            failures.pop(idx, None)
            _backoff.pop((ns, name, idx), None)
    for idx in [i for i in failures if i >= spec.replicas]:
        failures.pop(idx)
    _apply_service(core, ns, b.build_service(cr, spec))
    _apply_pdb(client.PolicyV1Api(api), ns, b.build_pdb(cr, spec))
    _apply_ingress(net, ns, spec.name, b.build_ingress(cr, spec))
    _apply_service_monitor(ps, custom, b.build_service_monitor(cr, spec))
    ps.forget_resolved()
    _write_status(custom, ns, name, cr, spec, core, result, [failures[i] for i in sorted(failures)], ps.problems)


def _place(ps: _Pass, spec, want_hash: str, nodes: list, nodes_raw: dict, grace_nodes: set) -> tuple[Plan, list]:
    """Triage of the server's pods, the plan against the slots every other server's pods hold,
    and the pods created or deleted by it (run under _PLACEMENT). Returns (plan, current pods)."""
    all_pods = ps.core.list_pod_for_all_namespaces(label_selector=b.L_SERVER).items
    taken = {p.metadata.annotations.get(b.A_SLOT): f"{p.metadata.namespace}/{p.metadata.labels[b.L_SERVER]}"
             for p in all_pods if p.metadata.annotations and p.metadata.deletion_timestamp is None
             and not (p.metadata.namespace == ps.ns and p.metadata.labels.get(b.L_SERVER) == ps.name)}
    taken = {k: v for k, v in taken.items() if k}
    pods = [p for p in all_pods if p.metadata.namespace == ps.ns and p.metadata.labels.get(b.L_SERVER) == ps.name]
    alive = ps.triage(pods, nodes_raw)
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
    one_node, refusal = _model_claim(ps, spec)
    # where every replica lives once rolled (an old pod's slot is reused when nothing else is free;
    # a replica on a node within its NotReady grace stays there) ...
    result = plan(spec, nodes, taken, {**old_slots, **new_slots}, keep=grace_nodes, one_node=one_node)
    # ... and where a replacement can start while the old pod still serves (surge by one)
    surge = plan(spec, nodes, {**taken, **{s.key: "rolling" for s in old_slots.values()}}, new_slots,
                 keep=grace_nodes, one_node=one_node)
    if refusal:
        result = surge = Plan([], spec.replicas, refusal, "ModelClaimUnusable")
    if result.unplaced:
        ps.event("Warning", result.reason_code, result.reason, once=(-1, result.reason_code))
    _roll(ps, spec, alive, current, old, result, surge)
    return result, current


def _model_claim(ps: _Pass, spec) -> tuple[bool, str | None]:
    """(replicas on one node, refusal) from a pvc:// model's claim: its access modes decide
    whether replicas may spread over nodes (builders.claim_rule)."""
    claim = b.model_claim(spec)
    if claim is None:
        return False, None
    try:
        modes = ps.core.read_namespaced_persistent_volume_claim(claim, ps.ns).spec.access_modes or []
    except ApiException as e:
        if e.status != 404:
            raise
        modes = None
    one_node, why = b.claim_rule(modes, spec.replicas)
    if one_node and spec.replicas > 1:
        ps.event("Normal", "ReadWriteOnceModel", f"claim {claim} is ReadWriteOnce: all {spec.replicas} replicas run "
                 "on one node (a ReadOnlyMany or ReadWriteMany claim lets them spread)", once=(-1, "RWO"))
    return one_node, f"model claim {claim} {why}" if why else None


def _roll(ps: _Pass, spec, alive, current, old, result, surge) -> None:
    """Creates missing replicas, scales down, and rolls old pods one at a time (surge by one
    where a slot is free, else the old pod makes room first)."""
    core, ns, name = ps.core, ps.ns, ps.name
    by_index = {pl.index: pl for pl in result.placements}
    surge_by_index = {pl.index: pl for pl in surge.placements}
    cur_by_index = {int(p.metadata.labels[b.L_REPLICA]): p for p in current}
    old_by_index: dict[int, list] = {}
    for p in old:
        old_by_index.setdefault(int(p.metadata.labels[b.L_REPLICA]), []).append(p)
    for p in alive:  # scale down: replicas beyond the count go, new and old
        if int(p.metadata.labels[b.L_REPLICA]) >= spec.replicas:
            ps.event("Normal", "ScaledDown", f"pod {p.metadata.name}: replica beyond spec.replicas={spec.replicas}")
            _delete_pod(core, ns, p.metadata.name)
    for idx, olds in old_by_index.items():  # a replica whose new pod is Ready no longer needs its old pod
        if idx in cur_by_index and _pod_ready(cur_by_index[idx]):
            for p in olds:
                ps.event("Normal", "Rolled", f"replica {idx}: {cur_by_index[idx].metadata.name} is Ready; "
                         f"deleting {p.metadata.name} of the previous spec")
                _delete_pod(core, ns, p.metadata.name)
    # one replacement in flight at a time: a new pod not Ready yet, or a replica with no pod
    # at all (its old pod went first to free the slot)
    rolling_busy = bool(old_by_index) and (any(not _pod_ready(p) for p in cur_by_index.values()) or any(
        i not in cur_by_index and i not in old_by_index for i in by_index))
    for idx in range(spec.replicas):
        pl = by_index.get(idx)
        if pl is None or idx in cur_by_index:
            continue
        count, last = _backoff.get((ns, name, idx), (0, 0.0))
        wait = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (count - 1)) if count else 0.0
        if count and time.monotonic() - last < wait:
            ps.event("Normal", "BackingOff", f"replica {idx}: replacing after {wait:.0f}s (failure {count})",
                     once=(idx, "BackingOff", count))
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
                    ps.event("Normal", "Rolling", f"replica {idx}: deleting {o.metadata.name} to free "
                             f"{o.metadata.annotations.get(b.A_SLOT)} for the new spec (no spare slot)")
                    _delete_pod(core, ns, o.metadata.name)
                continue  # its slot is free once it is gone; a later pass creates the new pod
        body = b.build_pod(ps.cr, spec, pl, NODE_LOST_GRACE_S)
        if _create(core.create_namespaced_pod, ns, body):
            who = ("the kubelet's static CPU manager chooses its CPUs, the engine binds inside them"
                   + ("; pinning Engine yields to it" if spec.pinning == "Engine" else "")) if pl.kubelet_pins else \
                ("the engine binds to CPUs " + "|".join(",".join(map(str, c)) for c in pl.rank_cpus)
                 if pl.rank_cpus else "the engine binds inside the CPUs the kubelet gives it")
            ps.event("Normal", "Placed", f"replica {idx}: pod {body['metadata']['name']} on {pl.slot.key} "
                     f"({pl.cpus} CPUs, {pl.memory / (1 << 30):.1f} GiB; {who})")


def _node_resource_topologies(custom) -> dict:
    try:
        items = custom.list_cluster_custom_object("topology.node.k8s.io", "v1alpha2", "noderesourcetopologies")
    except ApiException:
        return {}  # not installed
    return {i["metadata"]["name"]: i for i in items.get("items", [])}


def _create(fn, ns, body) -> bool:
    """True if created now (False: it was already there)."""
    try:
        fn(ns, body)
        log.info("created %s %s/%s", body["kind"], ns, body["metadata"]["name"])
        return True
    except ApiException as e:
        if e.status != 409:
            raise
        return False


def _delete_pod(core, ns, name, force=False) -> None:
    try:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0 if force else None)
        log.info("deleted pod %s/%s", ns, name)
    except ApiException as e:
        if e.status != 404:
            raise


def _apply(read, create, patch, ns, body, differs) -> None:
    """Creates the object, or patches its spec where differs(existing spec, wanted spec): an
    operator at rest writes nothing."""
    name = body["metadata"]["name"]
    try:
        existing = read(name, ns)
    except ApiException as e:
        if e.status != 404:
            raise
        _create(create, ns, body)
        return
    if differs(existing.spec, body["spec"]):
        patch(name, ns, {"spec": body["spec"]})


def _apply_service(core, ns, body) -> None:
    _apply(core.read_namespaced_service, core.create_namespaced_service, core.patch_namespaced_service, ns, body,
           lambda have, want: (have.type != want["type"] or have.ports[0].port != want["ports"][0]["port"]
                               or have.selector != want["selector"]))


def _apply_pdb(policy, ns, body) -> None:
    _apply(policy.read_namespaced_pod_disruption_budget, policy.create_namespaced_pod_disruption_budget,
           policy.patch_namespaced_pod_disruption_budget, ns, body,
           lambda have, want: (have.max_unavailable != want["maxUnavailable"]
                               or have.selector.match_labels != want["selector"]["matchLabels"]
                               or have.unhealthy_pod_eviction_policy != want["unhealthyPodEvictionPolicy"]))


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


def _apply_service_monitor(ps: _Pass, custom, body: dict | None) -> None:
    """The server's ServiceMonitor as the spec says, deleted when it says none. Without the
    Prometheus Operator's CRDs the resource is unknown (404 on create): a Warning event, once,
    and the next passes try again, so the monitor appears once the CRDs are installed."""
    group, version, plural = b.SERVICE_MONITOR
    try:
        have = custom.get_namespaced_custom_object(group, version, ps.ns, plural, ps.name)
    except ApiException as e:
        if e.status != 404:
            raise
        have = None
    if body is None:
        if have is not None:
            custom.delete_namespaced_custom_object(group, version, ps.ns, plural, ps.name)
        return
    if have is None:
        try:
            _create(lambda ns, obj: custom.create_namespaced_custom_object(group, version, ns, plural, obj),
                    ps.ns, body)
        except ApiException as e:
            if e.status != 404:
                raise
            ps.event("Warning", "ServiceMonitorUnavailable", "monitoring.serviceMonitor is enabled, but the "
                     "cluster has no ServiceMonitor resource (install the Prometheus Operator's CRDs)",
                     once=("servicemonitor",))
    elif have.get("spec") != body["spec"] or have["metadata"].get("labels") != body["metadata"]["labels"]:
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": have["metadata"]["resourceVersion"]}}
        custom.replace_namespaced_custom_object(group, version, ps.ns, plural, ps.name, body)


def _condition(old: list, type_: str, status: bool, reason: str, message: str, gen: int) -> dict:
    s = "True" if status else "False"
    prev = next((c for c in old if c.get("type") == type_), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == s else _now()
    return {"type": type_, "status": s, "reason": reason, "message": message[:1000], "lastTransitionTime": since,
            "observedGeneration": gen}


def _placement(pod) -> dict:
    """A pod's entry in status.placements: its NUMA slot, and the CPUs and memory nodes it
    really has, from the best witness there is: the engine's own GET /topology, else the
    kubelet's assignment (both recorded by the node agent), else the operator's plan."""
    ann = pod.metadata.annotations or {}
    out = {"pod": pod.metadata.name, "node": pod.spec.node_name or "",
           "numaNodes": [int(x) for x in ann.get(b.A_SLOT, "/").split("/")[1].split(",") if x != ""],
           "cpus": ann.get(b.A_CPUS, ""), "ready": _pod_ready(pod), "reportedBy": "operator"}
    for key, who in ((b.A_ASSIGNED, "kubelet"), (b.A_BOUND, "engine")):
        seen = json.loads(ann.get(key) or "{}")
        if seen.get("cpus"):
            out.update(cpus=seen["cpus"], reportedBy=who)
            if "memoryNodes" in seen:
                out["memoryNodes"] = seen["memoryNodes"]
    return out


def _write_status(custom, ns, name, cr, spec, core, result, failures, problems) -> None:
    """failures: replicas whose pods were replaced; problems: what keeps current pods from
    serving (image pulls, crash loops, OOM kills, a NotReady node), by replica."""
    pods = core.list_namespaced_pod(ns, label_selector=f"{b.L_SERVER}={name}").items
    pods = [p for p in pods if p.metadata.deletion_timestamp is None]
    want = spec.hash()
    current = [p for p in pods if p.metadata.labels.get(b.L_HASH) == want]
    ready = [p for p in current if _pod_ready(p)]
    ready_idx = {int(p.metadata.labels[b.L_REPLICA]) for p in ready}
    # a replica whose new pod serves has no problem an old pod of it had; a NotReady node is news either way
    problems = {i: t for i, t in problems.items() if i not in ready_idx or t[1].reason == "NodeNotReady"}
    desired = spec.replicas
    gen = cr["metadata"].get("generation", 0)
    outdated = len(pods) - len(current)
    trouble = failures + [f"replica {i}: {problems[i][1].describe(problems[i][0])}" for i in sorted(problems)]
    # the reason a user acts on: the kubelet's own word for the first problem
    first = problems[min(problems)][1].reason if problems else None
    if result.reason_code == "DoesNotFitNUMANode":
        phase = "Failed"
    elif len(ready) == desired and not outdated:
        phase = "Ready"
    elif problems or (ready and (result.unplaced or failures)):
        phase = "Degraded"
    elif not pods and result.unplaced:
        phase = "Pending"
    else:
        phase = "Loading"
    old = (cr.get("status") or {}).get("conditions", [])
    progressing = bool(outdated or len(current) < desired - result.unplaced or len(ready) < len(current))
    conds = [
        _condition(old, "Ready", phase == "Ready", "AllReplicasReady" if phase == "Ready" else
                   (first or result.reason_code or "ReplicasNotReady"),
                   f"{len(ready)}/{desired} replicas ready" + (f"; {result.reason}" if result.reason else "")
                   + (f"; {'; '.join(trouble)}" if trouble else ""), gen),
        _condition(old, "Progressing", progressing, "RollingUpdate" if outdated else
                   ("PodsStarting" if progressing else "Stable"),
                   f"{outdated} pod(s) of an older spec left" if outdated else
                   f"{len(current) - len(ready)} pod(s) starting" if progressing else "nothing to do", gen),
        _condition(old, "Degraded", bool(result.unplaced or trouble), first or result.reason_code or
                   ("PodRejected" if failures else "AsExpected"),
                   "; ".join(([result.reason] if result.reason else []) + trouble) or "no problem", gen),
    ]
    placements = [_placement(p) for p in sorted(current, key=lambda p: int(p.metadata.labels[b.L_REPLICA]))]
    status = {"phase": phase, "replicas": len(current), "readyReplicas": len(ready),
              "readyText": f"{len(ready)}/{desired}", "selector": f"{b.L_SERVER}={name}",
              "endpoint": b.endpoint(cr, spec), "observedGeneration": gen, "specHash": want,
              "placements": placements, "conditions": conds}
    observe_server(ns, name, phase, {"desired": desired, "current": len(current), "ready": len(ready),
                                     "failing": len(problems)})
    prev = dict(cr.get("status") or {})
    if {k: v for k, v in prev.items() if k in status} != status:
        custom.patch_namespaced_custom_object_status(b.GROUP, b.VERSION, ns, b.PLURAL, name, {"status": status})
