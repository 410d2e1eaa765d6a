"""Kubernetes Events on a CPUModelServer: every decision the operator takes (placed, refused,
rolled, replaced, backing off) and every pod problem it sees, where `kubectl describe cms`
shows them. One Event object per (server, reason, message): a repeat bumps its count, as
the kubelet's own event aggregation does."""
from __future__ import annotations

import datetime as dt
import hashlib
import logging

from kubernetes.client.rest import ApiException

log = logging.getLogger("cpuserve_operator")
COMPONENT = "cpuserve-operator"


def event_body(cr: dict, type_: str, reason: str, message: str, now: dt.datetime) -> dict:
    """The core/v1 Event for one occurrence (pure: the name is a function of what it says)."""
    meta = cr["metadata"]
    digest = hashlib.sha256(f"{meta['uid']}\0{reason}\0{message}".encode()).hexdigest()[:12]
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{digest}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": cr["apiVersion"], "kind": cr["kind"], "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta["uid"],
                           "resourceVersion": meta.get("resourceVersion", "")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def record(core, cr: dict, type_: str, reason: str, message: str) -> None:
    """Posts the Event, or counts a repeat of it; never fails a reconcile."""
    body = event_body(cr, type_, reason, message, dt.datetime.now(dt.timezone.utc))
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    (log.warning if type_ == "Warning" else log.info)("%s/%s: %s: %s", ns, cr["metadata"]["name"], reason, message)
    try:
        core.create_namespaced_event(ns, body)
    except ApiException as e:
        if e.status != 409:
            log.warning("event %s/%s not recorded: %s", ns, name, e.reason)
            return
        try:
            old = core.read_namespaced_event(name, ns)
            core.patch_namespaced_event(name, ns, {"count": (old.count or 1) + 1,
                                                   "lastTimestamp": body["lastTimestamp"]})
        except ApiException as e2:
            log.warning("event %s/%s not updated: %s", ns, name, e2.reason)
