"""`cpuserve-node-agent`: publishes this node's CPU topology on its Node object
(run as a DaemonSet with /sys and /proc of the host; the node name from the
downward API). Labels for selection, one annotation (JSON) with the detail the
operator places pods by."""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

from cpuserve_operator.placement import KUBELET_ANNOTATION, LABEL_PREFIX, TOPOLOGY_ANNOTATION

log = logging.getLogger("cpuserve_operator.agent")


def describe(root: str = "/", status: str | None = None) -> tuple[dict, dict]:
    """(labels, annotations) for the machine whose /sys and /proc are under root."""
    from cpuserve_topology import format_cpulist, read_topology

    topo = read_topology(root, status=status) if (root != "/" or status) else read_topology()
    tpc = max((len(c.siblings) for c in topo.cpus.values()), default=1)
    numa = [{"id": n.id, "cpus": format_cpulist(n.cpus), "cores": format_cpulist(topo.physical_cores(n.cpus)),
             "memory": n.mem_total} for n in topo.nodes]
    labels = {f"{LABEL_PREFIX}numa-nodes": str(len(topo.nodes)),
              f"{LABEL_PREFIX}smt": "true" if topo.smt else "false",
              f"{LABEL_PREFIX}cpus-per-numa-node": str(min(len(n.cpus) for n in topo.nodes)),
              **{f"{LABEL_PREFIX}isa.{flag}": "true" for flag in topo.isa}}
    ann = {TOPOLOGY_ANNOTATION: json.dumps({"numaNodes": numa, "threadsPerCore": tpc, "sockets": len(topo.packages),
                                            "isa": list(topo.isa), "arch": topo.arch}, sort_keys=True)}
    return labels, ann


def publish(node_name: str, labels: dict, annotations: dict) -> None:
    from kubernetes import client

    old = client.CoreV1Api().read_node(node_name).metadata.labels or {}
    stale = {k: None for k in old if k.startswith(LABEL_PREFIX + "isa.") and k not in labels}
    client.CoreV1Api().patch_node(node_name, {"metadata": {"labels": {**stale, **labels}, "annotations": annotations}})


def assignments(pods: list[dict], resources: list, container: str = "engine") -> dict[tuple[str, str], str]:
    """{(namespace, pod): annotation value} for the given pods: the CPUs and memory NUMA
    nodes the kubelet's managers gave their `container`, as JSON ("" where the kubelet
    reports nothing exclusive: pinning is not the kubelet's)."""
    from cpuserve_topology import format_cpulist

    by_pod = {(r.namespace, r.name): r for r in resources}
    out = {}
    for pod in pods:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        r = by_pod.get(key)
        c = next((c for c in (r.containers if r else []) if c.name == container), None)
        if c is None:
            continue
        mem = sorted({n for nodes in c.memory_numa.values() for n in nodes})
        out[key] = json.dumps({"cpus": format_cpulist(c.cpu_ids), "memoryNodes": mem}, sort_keys=True) \
            if c.cpu_ids or mem else ""
    return out


def kubelet_policies(alloc) -> dict:
    """The kubelet's CPU and memory manager policies, as its pod-resources API shows them: only
    the static CPU manager has CPUs to give exclusively, only the Static memory manager NUMA
    memory (the checkpoint files say the same, but need the kubelet's directory mounted)."""
    from cpuserve_topology import format_cpulist

    mem = sorted({n for nodes in alloc.memory_numa.values() for n in nodes})
    return {"cpuManagerPolicy": "static" if alloc.cpu_ids else "none",
            "memoryManagerPolicy": "Static" if mem else "None",
            "exclusiveCPUs": format_cpulist(alloc.cpu_ids), "memoryNodes": mem}


def topology_policy(paths: list[str]) -> dict:
    """The kubelet's topology manager policy and scope from its configuration as the kubelet
    reads it: a --config file, then a --config-dir's `*.conf` drop-ins in name order, later
    keys winning ({} when none of `paths` can be read; the kubelet's defaults where it is
    unset). The pod-resources API does not expose it."""
    import yaml

    merged, seen = {}, False
    for p in paths:
        files = sorted(f for f in os.listdir(p) if f.endswith(".conf")) if os.path.isdir(p) else [""]
        for f in files:
            try:
                with open(os.path.join(p, f) if f else p) as fh:
                    merged.update(yaml.safe_load(fh) or {})
                seen = True
            except OSError as e:
                log.warning("kubelet configuration %s: %s", os.path.join(p, f), e)
    if not seen:
        return {}
    return {"topologyManagerPolicy": merged.get("topologyManagerPolicy", "none"),
            "topologyManagerScope": merged.get("topologyManagerScope", "container")}


def report_kubelet(node_name: str, socket: str, config_paths: list[str] = ()) -> bool:
    """Publishes the kubelet's policies on the Node (cpuserve.dev/kubelet); True if they changed."""
    from kubernetes import client

    from cpuserve_operator.podresources import allocatable_resources

    policies = {**kubelet_policies(allocatable_resources(socket)), **topology_policy(list(config_paths))}
    value = json.dumps(policies, sort_keys=True)
    core = client.CoreV1Api()
    if (core.read_node(node_name).metadata.annotations or {}).get(KUBELET_ANNOTATION) == value:
        return False
    core.patch_node(node_name, {"metadata": {"annotations": {KUBELET_ANNOTATION: value}}})
    log.info("kubelet on %s: %s", node_name, value)
    return True


def bound(topology: dict) -> str:
    """The pod annotation for what an engine's GET /topology says: the CPUs its ranks' threads
    run on and the NUMA nodes their memory is bound to (none where the kernel refused)."""
    from cpuserve_topology import format_cpulist, parse_cpulist

    cpus = sorted({c for r in topology.get("ranks", []) for c in parse_cpulist(r.get("cpus") or "")})
    mem = sorted({r["memoryNode"] for r in topology.get("ranks", []) if r.get("memoryNode") is not None})
    return json.dumps({"cpus": format_cpulist(cpus), "memoryNodes": mem}, sort_keys=True)


def engine_topology(pod: dict, timeout: float = 3) -> dict | None:
    """GET /topology of a Ready engine pod (None when it does not answer)."""
    import urllib.request

    ip = (pod.get("status") or {}).get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or [])
    c = next((c for c in pod["spec"]["containers"] if c["name"] == "engine"), None)
    port = next((p["containerPort"] for p in (c or {}).get("ports") or [] if p.get("name") == "http"), None)
    if not (ip and ready and port):
        return None
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/topology", timeout=timeout) as r:
            return json.load(r)
    except (OSError, ValueError) as e:
        log.info("%s/%s: no /topology (%s)", pod["metadata"]["namespace"], pod["metadata"]["name"], e)
        return None


def report_assignments(node_name: str, socket: str) -> int:
    """Records on each cpuserve pod of this node what the kubelet assigned it and where its
    engine bound itself; returns how many pods changed."""
    from kubernetes import client

    from cpuserve_operator.builders import A_ASSIGNED, A_BOUND, L_SERVER
    from cpuserve_operator.podresources import list_pod_resources

    core = client.CoreV1Api()
    pods = core.list_pod_for_all_namespaces(label_selector=L_SERVER, field_selector=f"spec.nodeName={node_name}")
    pods = [client.ApiClient().sanitize_for_serialization(p) for p in pods.items]
    want = {k: {A_ASSIGNED: v} for k, v in assignments(pods, list_pod_resources(socket)).items()}
    for p in pods:
        topo = engine_topology(p)
        if topo is not None:
            want.setdefault((p["metadata"]["namespace"], p["metadata"]["name"]), {})[A_BOUND] = bound(topo)
    changed = 0
    by_key = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
    for (ns, name), values in want.items():
        have = by_key[ns, name]["metadata"].get("annotations") or {}
        patch = {k: v or None for k, v in values.items() if have.get(k, "") != v}
        if patch:
            core.patch_namespaced_pod(name, ns, {"metadata": {"annotations": patch}})
            changed += 1
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpuserve-node-agent")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node (downward API: NODE_NAME)")
    p.add_argument("--root", default=os.environ.get("HOST_ROOT", "/"),
                   help="where the host's /sys and /proc are mounted (default /)")
    p.add_argument("--interval", type=float, default=300, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="publish once and exit")
    p.add_argument("--kubelet-config", action="append", default=[], metavar="PATH",
                   help="with --report-assignments: the kubelet's --config file or --config-dir (repeatable), "
                        "to publish its topology manager policy too")
    p.add_argument("--print", action="store_true", help="print labels and annotation, publish nothing")
    p.add_argument("--report-assignments", metavar="SOCKET", nargs="?", const="/var/lib/kubelet/pod-resources/kubelet.sock",
                   help="instead: publish the kubelet's CPU and memory manager policies on the Node, and record "
                        "on this node's cpuserve pods the CPUs and memory nodes the kubelet gave them, from its "
                        "pod-resources socket (default %(const)s), every --interval seconds")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.print:
        labels, ann = describe(a.root)
        print(json.dumps({"labels": labels, "annotations": ann}, indent=2))
        return 0
    if not a.node_name:
        p.error("--node-name (or NODE_NAME) is required")
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    while a.report_assignments:
        try:
            report_kubelet(a.node_name, a.report_assignments, a.kubelet_config)
            n = report_assignments(a.node_name, a.report_assignments)
            if n:
                log.info("recorded the kubelet's assignment on %d pod(s)", n)
        except Exception as e:  # noqa: BLE001 - the kubelet restarting is no reason to exit
            log.warning("pod-resources: %s", e)
        if a.once:
            return 0
        time.sleep(a.interval)
    while True:
        labels, ann = describe(a.root)
        publish(a.node_name, labels, ann)
        log.info("published %s: %s", a.node_name, labels)
        if a.once:
            return 0
        time.sleep(a.interval)


if __name__ == "__main__":
    raise SystemExit(main())
