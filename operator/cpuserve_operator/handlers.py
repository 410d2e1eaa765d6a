"""kopf wiring: every trigger ends in reconcile(namespace, name)."""
from __future__ import annotations

import logging
import os

import kopf
from kubernetes import client, config

from cpuserve_operator import builders as b
from cpuserve_operator.reconcile import reconcile

RESYNC_S = float(os.environ.get("CPUSERVE_OPERATOR_RESYNC", "10"))
# a namespaced install (cpuserve-operator --namespace ...): None is the whole cluster
WATCHED = set(filter(None, os.environ.get("CPUSERVE_OPERATOR_NAMESPACES", "").split(","))) or None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = int(os.environ.get("CPUSERVE_OPERATOR_WATCH_TIMEOUT", "300"))
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    settings.watching.connect_timeout = 30
    # one replica acts, elected by a Lease before kopf starts (main.py): no kopf peering
    settings.persistence.finalizer = "cpuserve.dev/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cpuserve.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="cpuserve.dev")
    # a server deleted while its resync timer is mid-pass: kopf sees the timer still running and,
    # by default, looks again (and lifts the finalizer) only 60 s later; a pass takes well under
    # a second, so look every second
    settings.background.cancellation_polling = 1.0


@kopf.on.create(b.GROUP, b.VERSION, b.PLURAL)
@kopf.on.update(b.GROUP, b.VERSION, b.PLURAL, field="spec")
@kopf.on.resume(b.GROUP, b.VERSION, b.PLURAL)
def on_server(name, namespace, **_):
    reconcile(namespace, name)


@kopf.timer(b.GROUP, b.VERSION, b.PLURAL, interval=RESYNC_S, initial_delay=RESYNC_S)
def resync(name, namespace, **_):
    reconcile(namespace, name)


@kopf.on.event("", "v1", "pods", labels={b.L_SERVER: kopf.PRESENT})
def on_pod(body, type, **_):
    labels = body.get("metadata", {}).get("labels", {})
    reconcile(body["metadata"]["namespace"], labels[b.L_SERVER])


@kopf.on.event("", "v1", "nodes")
def on_node(body, type, **_):
    """A node changed: the servers with pods on it (a NotReady node, a lost one), and, when it
    can take pods now, the servers still missing replicas."""
    if type not in ("DELETED", "MODIFIED", "ADDED", None):
        return
    node = body["metadata"]["name"]
    pods = client.CoreV1Api().list_pod_for_all_namespaces(label_selector=b.L_SERVER,
                                                          field_selector=f"spec.nodeName={node}").items
    todo = {(p.metadata.namespace, p.metadata.labels[b.L_SERVER]) for p in pods}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (body.get("status") or {}).get("conditions") or [])
    if ready and type != "DELETED":
        todo |= {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in _servers()
                 if (s.get("status") or {}).get("phase") != "Ready"}
    for ns, name in sorted(todo):
        if WATCHED is None or ns in WATCHED:
            reconcile(ns, name)


def _servers() -> list[dict]:
    api = client.CustomObjectsApi()
    if WATCHED is None:
        return api.list_cluster_custom_object(b.GROUP, b.VERSION, b.PLURAL).get("items", [])
    return [s for ns in sorted(WATCHED) for s in api.list_namespaced_custom_object(
        b.GROUP, b.VERSION, ns, b.PLURAL).get("items", [])]
