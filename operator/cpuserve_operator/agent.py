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

from cpuserve_operator.placement import LABEL_PREFIX, TOPOLOGY_ANNOTATION

log = logging.getLogger("cpuserve_operator.agent")


def describe(root: str = "/", status: str | None = None) -> tuple[dict, dict]:
    """(labels, annotations) for the machine whose /sys and /proc are under root."""
    from cpuserve_topology import format_cpulist, read_topology

    topo = read_topology(root, status=status) if (root != "/" or status) else read_topology()
    tpc = max((len(c.siblings) for c in topo.cpus.values()), default=1)
    numa = [{"id": n.id, "cpus": format_cpulist(n.cpus), "memory": n.mem_total} for n in topo.nodes]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpuserve-node-agent")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node (downward API: NODE_NAME)")
    p.add_argument("--root", default=os.environ.get("HOST_ROOT", "/"),
                   help="where the host's /sys and /proc are mounted (default /)")
    p.add_argument("--interval", type=float, default=300, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="publish once and exit")
    p.add_argument("--print", action="store_true", help="print labels and annotation, publish nothing")
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
    while True:
        labels, ann = describe(a.root)
        publish(a.node_name, labels, ann)
        log.info("published %s: %s", a.node_name, labels)
        if a.once:
            return 0
        time.sleep(a.interval)


if __name__ == "__main__":
    raise SystemExit(main())
