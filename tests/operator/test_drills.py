"""Operator drills against a control plane of their own (etcd, kube-apiserver and
kube-controller-manager; no kubelet: the test plays it, as in test_operator.py):
the operator killed mid-rollout and restarted, the API server restarted, watches whose
resourceVersion etcd has compacted away (410 Gone), a CR deleted while its pods are
being created, and 50 CRs created and deleted in a burst. Each must converge with
nothing orphaned and no hot loop.

The operator runs under a user of its own, and the API server's audit log records that
user's every request: each drill counts them (by verb, and the refused ones) and the
Events in the namespace. The watch cache is off, so a watch resumed from a compacted
resourceVersion is answered from etcd, which refuses it; the operator re-watches every
WATCH_TIMEOUT seconds (300 in production) so that the drill sees a resume. The figures
are printed and, with CPUSERVE_DRILL_REPORT set, written there as JSON
(docs/reliability.md keeps the last run's)."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ASSETS, NEEDED, ROOT, ControlPlane, free_port, wait_for
from test_operator import add_node

NS = "drills"
USER = "drill-operator"
RESYNC, WATCH_TIMEOUT = 10, 5  # resync: the production default
RUNNING = json.dumps({"status": {"phase": "Running", "podIP": "10.1.0.1", "conditions": [
    {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}})
QUIET_S = 8  # the window after convergence in which an operator at rest must not write
HANDLED = "cpuserve.dev/last-handled-configuration"  # kopf's diff base (handlers.py: AnnotationsDiffBaseStorage)
POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [ResponseStarted]
rules:
  - level: Metadata
    users: [%s]
  - level: None
""" % USER


class Audit:
    """The operator's requests, read from the API server's audit log."""

    def __init__(self, path: Path):
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def records(self, since: int, stage: str = "RequestReceived") -> list[dict]:
        with self.path.open("rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
        out = [json.loads(ln) for ln in lines if ln.strip()]
        return [r for r in out if r.get("stage") == stage and r["user"]["username"] == USER]

    def summary(self, since: int) -> dict:
        reqs = self.records(since)
        refused = collections.Counter(str(r["responseStatus"]["code"]) for r in self.records(since, "ResponseComplete")
                                      if r.get("responseStatus", {}).get("code", 200) >= 400)
        return {"requests": len(reqs), "by_verb": dict(collections.Counter(r["verb"] for r in reqs).most_common()),
                "refused": dict(refused)}


class Operator:
    def __init__(self, plane: ControlPlane):
        self.plane, self.proc = plane, None
        self.log = plane.dir / "operator.log"

    def start(self) -> None:
        env = dict(os.environ, KUBECONFIG=str(self.plane.kubeconfig_for(USER)), CPUSERVE_OPERATOR_RESYNC=str(RESYNC),
                   CPUSERVE_OPERATOR_WATCH_TIMEOUT=str(WATCH_TIMEOUT))
        with self.log.open("a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cpuserve_operator.main", "--standalone", "--namespace",
                                          NS, "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
                                          "--metrics-port", str(free_port())],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)

    def stop(self, kill: bool = False) -> None:
        (self.proc.kill if kill else self.proc.terminate)()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    if not ASSETS or not all(Path(ASSETS, b).exists() for b in NEEDED):
        msg = f"envtest binaries missing in KUBEBUILDER_ASSETS={ASSETS!r}: run `make test-operator`"
        pytest.fail(msg) if os.environ.get("CI") else pytest.skip(msg)
    d = tmp_path_factory.mktemp("drills")
    (d / "policy.yaml").write_text(POLICY)
    cp = ControlPlane(Path(ASSETS), [ROOT / "crds" / "cpumodelserver.yaml"], users=(USER,), apiserver_args=[
        "--audit-policy-file", str(d / "policy.yaml"), "--audit-log-path", str(d / "audit.log"),
        "--watch-cache=false"])
    cp.audit = Audit(d / "audit.log")
    cp.kubectl("create", "namespace", NS)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def operator(plane):
    op = Operator(plane)
    op.start()
    yield op
    op.stop()
    print(op.log.read_text()[-4000:])


@pytest.fixture(scope="module")
def report():
    rows: list[dict] = []
    yield rows
    print(json.dumps(rows, indent=1))
    if os.environ.get("CPUSERVE_DRILL_REPORT"):
        Path(os.environ["CPUSERVE_DRILL_REPORT"]).write_text(json.dumps(rows, indent=1) + "\n")


# -- the kubelet's part, and what the drills look at ---------------------------------------------
def server(name: str, replicas: int = 1) -> dict:
    return {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"source": "packaged://smollm2", "sizeGiB": 1}, "engine": {"kvCacheGiB": 1},
                     "replicas": replicas}}


def apply(plane, *objs: dict) -> None:
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def all_pods(plane) -> list[dict]:
    return plane.get("pods", "-n", NS)["items"]


def live(pods: list[dict], name: str | None = None) -> list[dict]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (name is None or p["metadata"]["labels"].get("cpuserve.dev/server") == name)]


def kubelet(plane) -> list[dict]:
    """Finishes terminations and reports new pods Running and Ready; returns the pods it saw."""
    pods = all_pods(plane)

    def one(p):
        name = p["metadata"]["name"]
        if p["metadata"].get("deletionTimestamp"):
            plane.kubectl("delete", "pod", "-n", NS, name, "--grace-period=0", "--force", "--wait=false", check=False)
        elif p.get("status", {}).get("phase") != "Running":
            plane.kubectl("patch", "pod", "-n", NS, name, "--subresource=status", "--type=merge", "-p", RUNNING,
                          check=False)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, pods))
    return pods


def servers(plane) -> list[dict]:
    return plane.get("cms", "-n", NS)["items"]


def handled(cr: dict | None) -> bool:
    """kopf has recorded the CR's current spec as handled (its diff base, written in a patch of its own
    after the handler's status patch): until then the operator is not at rest."""
    base = ((cr or {}).get("metadata", {}).get("annotations") or {}).get(HANDLED)
    return base is not None and json.loads(base).get("spec") == cr.get("spec")


def ready(plane, name: str, replicas: int, spec_hash: str | None = None) -> bool:
    cr = next((s for s in servers(plane) if s["metadata"]["name"] == name), None)
    st = (cr or {}).get("status", {})
    pods = live(all_pods(plane), name)
    return (st.get("phase") == "Ready" and st.get("readyReplicas") == replicas and len(pods) == replicas and handled(cr)
            and (spec_hash is None or all(p["metadata"]["labels"]["cpuserve.dev/spec-hash"] == spec_hash
                                          for p in pods)))


def converge(plane, check, what: str, timeout: float = 180) -> float:
    t0 = time.monotonic()

    def step():
        kubelet(plane)
        return check()
    wait_for(step, timeout, what, interval=0.5)
    return time.monotonic() - t0


def settled(plane, n: int) -> None:
    """Every pod, terminating ones included, is one of the `n` wanted once terminations finish."""
    converge(plane, lambda: len(all_pods(plane)) == n, f"exactly {n} pods", timeout=20)


def event_count(plane) -> int:
    return sum(e.get("count") or 1 for e in plane.get("events", "-n", NS)["items"])


class Drill:
    """Counts one drill: the operator's requests and the Events from start to end, then
    a quiet window in which the operator, at rest, must not write."""

    def __init__(self, plane, report: list, name: str):
        self.plane, self.report, self.name = plane, report, name
        self.mark, self.events, self.t0 = plane.audit.mark(), event_count(plane), time.monotonic()

    def converged(self, seconds: float, operator: Operator, **extra) -> dict:
        row = {"drill": self.name, "converged_s": round(seconds, 1), **self.plane.audit.summary(self.mark),
               "events": event_count(self.plane) - self.events, **extra}
        quiet = self.plane.audit.mark()
        time.sleep(QUIET_S)
        kubelet(self.plane)  # (nothing to do: the check below must see no change)
        rest = self.plane.audit.records(quiet)
        writes = [f"{r['verb']} {r['objectRef'].get('resource')}/{r['objectRef'].get('name')}" for r in rest
                  if r["verb"] in ("create", "update", "patch", "delete", "deletecollection")]
        row["at_rest_per_s"] = round(len(rest) / QUIET_S, 1)
        self.report.append(row)
        assert operator.proc.poll() is None, "the operator exited"
        assert not writes, f"{self.name}: the operator at rest still writes: {writes[:10]}"
        return row


# -- the drills, in order: each starts where the last one left ------------------------------------
def test_operator_killed_mid_rollout_and_restarted(plane, operator, report):
    for i in range(6):
        add_node(plane, f"drill-{i}")
    apply(plane, server("roll", 3))
    converge(plane, lambda: ready(plane, "roll", 3), "3 replicas Ready")
    drill = Drill(plane, report, "operator SIGKILLed mid-rollout, restarted")
    old = servers(plane)[0]["status"]["specHash"]
    plane.kubectl("patch", "cms", "roll", "-n", NS, "--type=merge", "-p", '{"spec":{"engine":{"dtype":"bfloat16"}}}')
    wait_for(lambda: any(p["metadata"]["labels"]["cpuserve.dev/spec-hash"] != old for p in live(all_pods(plane))),
             60, "the first new pod")
    operator.stop(kill=True)
    kubelet(plane)  # the new pod becomes Ready while no operator runs
    operator.start()
    most = 0

    def rolled():
        nonlocal most
        pods = live(all_pods(plane), "roll")
        most = max(most, len(pods))
        st = servers(plane)[0].get("status", {})
        return st.get("specHash") not in (None, old) and ready(plane, "roll", 3, st["specHash"])
    seconds = converge(plane, rolled, "the rollout finished by the new operator")
    assert most <= 4  # still one surge pod at a time across the restart
    settled(plane, 3)  # nothing orphaned: every old pod is gone once its termination is done
    drill.converged(seconds, operator)


def test_api_server_restarted(plane, operator, report):
    drill = Drill(plane, report, "kube-apiserver stopped, down 15 s, restarted")
    plane.restart_apiserver(down_s=15)
    plane.kubectl("scale", "cms/roll", "-n", NS, "--replicas=4")
    seconds = converge(plane, lambda: ready(plane, "roll", 4), "scaled to 4 after the restart")
    settled(plane, 4)
    drill.converged(seconds, operator)


def etcd(plane, path: str, body: dict) -> dict:
    req = urllib.request.Request(plane.etcd + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def test_watch_resumed_from_a_compacted_revision_relists(plane, operator, report):
    drill = Drill(plane, report, "watches expired (etcd compacted: 410 Gone)")
    # other objects move etcd's revision past everything the operator has seen, then it is compacted
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"churn-{i}", "namespace": "default"}}
        for i in range(20)]}))
    rev = int(etcd(plane, "/v3/kv/range", {"key": "AA=="})["header"]["revision"])
    mark = plane.audit.mark()  # (before the compaction: a watch may resume the moment it is done)
    etcd(plane, "/v3/kv/compaction", {"revision": rev, "physical": True})

    def relisted():  # kopf's own requests: a list (not a watch) of a resource it watches
        return {r["objectRef"]["resource"] for r in plane.audit.records(mark)
                if r["verb"] == "list" and r.get("userAgent", "").startswith("kopf/")}
    got = wait_for(relisted, 3 * WATCH_TIMEOUT + 10, "a relist after 410 Gone")
    plane.kubectl("scale", "cms/roll", "-n", NS, "--replicas=2")
    seconds = converge(plane, lambda: ready(plane, "roll", 2), "scaled to 2 after the relist")
    settled(plane, 2)
    drill.converged(seconds, operator, relisted=sorted(got))


def test_server_deleted_while_its_pods_are_created(plane, operator, report):
    drill = Drill(plane, report, "CR deleted while its 6 pods are created")
    apply(plane, server("doomed", 6))
    wait_for(lambda: live(all_pods(plane), "doomed"), 30, "the first pod", interval=0.05)
    plane.kubectl("delete", "cms", "doomed", "-n", NS, "--wait=false")

    def gone():
        return (not any(s["metadata"]["name"] == "doomed" for s in servers(plane))
                and not [p for p in all_pods(plane) if p["metadata"]["labels"].get("cpuserve.dev/server") == "doomed"]
                and plane.kubectl("get", "svc", "doomed", "-n", NS, check=False).returncode != 0)
    seconds = converge(plane, gone, "the deleted server's pods and Service gone")
    drill.converged(seconds, operator)
    assert ready(plane, "roll", 2)  # its neighbour untouched


def test_fifty_servers_created_and_deleted_in_a_burst(plane, operator, report):
    for i in range(13):  # 52 NUMA slots
        add_node(plane, f"burst-{i}", numa=4, cpus=16, mem_gib=16)
    plane.kubectl("delete", "cms", "--all", "-n", NS, "--wait=false")
    converge(plane, lambda: not all_pods(plane) and not servers(plane), "the earlier server gone")
    drill = Drill(plane, report, "50 CRs created in one burst, then deleted in one")
    apply(plane, *(server(f"b{i:02d}") for i in range(50)))
    up = converge(plane, lambda: all(ready(plane, f"b{i:02d}", 1) for i in range(50)) if
                  sum(1 for s in servers(plane) if s.get("status", {}).get("phase") == "Ready") == 50 else False,
                  "50 servers Ready", timeout=300)
    pods = live(all_pods(plane))
    slots = [p["metadata"]["annotations"]["cpuserve.dev/slot"] for p in pods]
    assert len(pods) == 50 and len(set(slots)) == 50, collections.Counter(slots).most_common(3)  # no slot twice
    plane.kubectl("delete", "cms", "--all", "-n", NS, "--wait=false")
    crs = converge(plane, lambda: not servers(plane), "all 50 CRs gone", timeout=300)
    down = crs + converge(plane, lambda: not all_pods(plane) and not plane.get("svc", "-n", NS)["items"],
                          "their pods and Services gone", timeout=300)
    drill.converged(up + down, operator, up_s=round(up, 1), crs_gone_s=round(crs, 1), down_s=round(down, 1))
