"""One active operator replica, elected by a coordination.k8s.io Lease, the way client-go's
leader election does it: the holder renews the Lease every `retry` seconds; a standby takes
it over once it has seen no renewal for `duration` seconds *by its own clock* (it times the
record's changes itself, so clocks need not agree); a holder that cannot renew within
`renew_deadline` stops acting (the process exits and restarts as a standby); a holder that
shuts down cleanly releases the Lease so that a standby takes over at once.

`decide` is the pure rule; `Elector` carries it out against the API server."""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("cpuserve_operator.leader")


@dataclass(frozen=True)
class Observed:
    """What a candidate last saw of the Lease, and when (its own monotonic clock)."""
    holder: str
    record: str          # the holder's renewTime as written: a change means the holder is alive
    at: float


def decide(lease: dict | None, me: str, seen: Observed | None, now: float, duration: float) -> str:
    """create (no Lease yet), renew (ours), acquire (free, released or expired), or wait."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if holder == me:
        return "renew"
    if not holder:
        return "acquire"
    if seen is None or seen.holder != holder or seen.record != str(spec.get("renewTime")):
        return "wait"  # the record changed since we last looked: its holder is alive
    return "acquire" if now - seen.at >= duration else "wait"


def _micro(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    def __init__(self, namespace: str, name: str, identity: str, duration: float = 15, renew_deadline: float = 10,
                 retry: float = 2):
        self.ns, self.name, self.me = namespace, name, identity
        self.duration, self.renew_deadline, self.retry = duration, renew_deadline, retry
        self.api = client.CoordinationV1Api()
        self.seen: Observed | None = None
        self.leading = threading.Event()
        self.stopping = threading.Event()  # set by a clean shutdown: keep_leading renews no more

    def _body(self, lease: dict | None, transition: bool) -> dict:
        now = _micro(dt.datetime.now(dt.timezone.utc))
        spec = dict((lease or {}).get("spec") or {})
        spec.update(holderIdentity=self.me, leaseDurationSeconds=int(self.duration), renewTime=now)
        if transition or not spec.get("acquireTime"):
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease else 0)
        meta = {"name": self.name, "namespace": self.ns}
        if lease:
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_once(self) -> bool:
        """One round of the rule; True while this process holds the Lease."""
        try:
            lease = client.ApiClient().sanitize_for_serialization(self.api.read_namespaced_lease(self.name, self.ns))
        except ApiException as e:
            if e.status != 404:
                raise
            lease = None
        spec = (lease or {}).get("spec") or {}
        now = time.monotonic()
        record = (spec.get("holderIdentity") or "", str(spec.get("renewTime")))
        if self.seen is None or (self.seen.holder, self.seen.record) != record:
            seen_before, self.seen = self.seen, Observed(*record, now)
        else:
            seen_before = self.seen
        action = decide(lease, self.me, seen_before, now, self.duration)
        if action == "wait":
            return False
        try:
            if action == "create":
                self.api.create_namespaced_lease(self.ns, self._body(None, True))
            else:
                self.api.replace_namespaced_lease(self.name, self.ns, self._body(lease, action == "acquire"))
        except ApiException as e:
            if e.status in (409, 422):  # another candidate wrote first: it leads
                return False
            raise
        if action != "renew":
            log.info("%s now leads (Lease %s/%s, %s)", self.me, self.ns, self.name, action)
        return True

    def wait_until_leading(self) -> None:
        while not self._round():
            time.sleep(self.retry)
        self.leading.set()

    def _round(self) -> bool:
        try:
            return self.try_once()
        except Exception as e:  # noqa: BLE001 - the API server being away is a reason to retry
            log.warning("leader election: %s", e)
            return False

    def keep_leading(self, on_lost) -> None:
        """Renews until it cannot for renew_deadline seconds (or another holds the Lease): on_lost().
        Returns without it once stop() is called."""
        last_ok = time.monotonic()
        while True:
            if self.stopping.wait(self.retry):
                return
            if self._round():
                last_ok = time.monotonic()
            elif self.seen is not None and self.seen.holder not in ("", self.me):
                log.error("Lease %s/%s is held by %s: stepping down", self.ns, self.name, self.seen.holder)
                break
            elif time.monotonic() - last_ok > self.renew_deadline:
                log.error("could not renew Lease %s/%s for %.0fs: stepping down", self.ns, self.name,
                          self.renew_deadline)
                break
        self.leading.clear()
        on_lost()

    def stop(self) -> None:
        """No renewal starts after this (a renewal under way finishes): what a clean shutdown does
        before release(), so that the Lease is not renewed again after it was handed over."""
        self.stopping.set()

    def release(self) -> None:
        """Hands the Lease over at once (a clean shutdown, after stop())."""
        try:
            lease = client.ApiClient().sanitize_for_serialization(self.api.read_namespaced_lease(self.name, self.ns))
            if (lease.get("spec") or {}).get("holderIdentity") == self.me:
                body = self._body(lease, False)
                body["spec"].update(holderIdentity="", leaseDurationSeconds=1)
                self.api.replace_namespaced_lease(self.name, self.ns, body)
                log.info("released Lease %s/%s", self.ns, self.name)
        except Exception as e:  # noqa: BLE001 - the standby takes over after `duration` anyway
            log.warning("releasing the Lease: %s", e)
