"""kopf wiring: every trigger ends in reconcile(namespace, name)."""
from __future__ import annotations

import logging
import os

import kopf
from kubernetes import client, config

from cpuserve_operator import builders as b
from cpuserve_operator.reconcile import reconcile

RESYNC_S = float(os.environ.get("CPUSERVE_OPERATOR_RESYNC", "10"))


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
    settings.peering.name = os.environ.get("CPUSERVE_OPERATOR_PEERING", "cpuserve-operator")
    settings.peering.mandatory = False
    settings.persistence.finalizer = "cpuserve.dev/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cpuserve.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="cpuserve.dev")


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
    if type not in ("DELETED", "MODIFIED", "ADDED", None):
        return
    servers = client.CustomObjectsApi().list_cluster_custom_object(b.GROUP, b.VERSION, b.PLURAL)
    for s in servers.get("items", []):
        reconcile(s["metadata"]["namespace"], s["metadata"]["name"])
