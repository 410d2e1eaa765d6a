"""Two operator processes against the real API server: one holds the Lease and acts, the
other stands by (alive, acting on nothing); when the leader dies the other takes over, and a
leader that stops cleanly hands the Lease over at once."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import free_port, wait_for
from test_operator import add_node

NS = "ha"
DURATION = 4  # seconds without renewal before the standby takes over (15 in production)


def start(cluster, name):
    log = cluster.dir / f"operator-{name}.log"
    ports = free_port(), free_port()
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), POD_NAME=name, POD_NAMESPACE=NS,
               CPUSERVE_OPERATOR_RESYNC="1", CPUSERVE_OPERATOR_LEASE_DURATION=str(DURATION))
    proc = subprocess.Popen([sys.executable, "-m", "cpuserve_operator.main", "--namespace", NS,
                             "--liveness", f"http://127.0.0.1:{ports[0]}/healthz", "--metrics-port", str(ports[1])],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    proc.name, proc.log, proc.health, proc.metrics = name, log, ports[0], ports[1]
    return proc


def holder(cluster):
    r = cluster.kubectl("get", "lease", "-n", NS, "cpuserve-operator", "-o", "json", check=False)
    return json.loads(r.stdout)["spec"].get("holderIdentity") if r.returncode == 0 else None


def leader_gauge(proc):
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics}/metrics", timeout=3).read().decode()
    return next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("cpuserve_operator_leader "))


def healthy(proc):
    return urllib.request.urlopen(f"http://127.0.0.1:{proc.health}/healthz", timeout=3).status == 200


def created(proc, server):
    return f"created Pod {NS}/{server}-" in proc.log.read_text()


def server(cluster, name):
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"source": "packaged://smollm2", "sizeGiB": 1}, "engine": {"kvCacheGiB": 1},
                 "placement": {"nodeSelector": {"pool": "ha"}}}}))


@pytest.fixture
def pair(cluster):
    cluster.kubectl("create", "namespace", NS, check=False)
    add_node(cluster, "ha-a")
    cluster.kubectl("label", "node", "ha-a", "pool=ha", "--overwrite")
    procs = [start(cluster, "op-a"), start(cluster, "op-b")]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for p in procs:
            print(f"--- {p.name}\n{p.log.read_text()[-3000:]}")
        # the session's other tests place onto every node they see: leave none of ours behind
        cluster.kubectl("delete", "pods", "--all", "-n", NS, "--grace-period=0", "--force", check=False)
        cluster.kubectl("delete", "node", "ha-a", check=False)


def test_one_acts_the_other_takes_over(cluster, pair):
    first = wait_for(lambda: holder(cluster), 30, "a Lease holder")
    lead, standby = sorted(pair, key=lambda p: p.name != first)
    wait_for(lambda: leader_gauge(lead) == 1 and healthy(standby), 30, "leader and standby up")
    server(cluster, "one")
    wait_for(lambda: created(lead, "one"), 30, "the leader creates the pod")
    time.sleep(2 * DURATION)  # renewals keep the Lease; the standby stays idle however long it waits
    assert holder(cluster) == lead.name and leader_gauge(standby) == 0 and healthy(standby)
    assert "Handler" not in standby.log.read_text() and not created(standby, "one")

    # the leader dies without a word: after DURATION without renewal, the standby acts
    lead.send_signal(signal.SIGKILL)
    lead.wait()
    t0 = time.monotonic()
    wait_for(lambda: holder(cluster) == standby.name, 4 * DURATION, "takeover")
    took = time.monotonic() - t0
    server(cluster, "two")
    wait_for(lambda: created(standby, "two"), 30, "the new leader creates the pod")
    assert took >= DURATION - 1, f"took the Lease after {took:.1f}s, before it expired"
    print(f"takeover {took:.1f}s after the leader died (lease duration {DURATION}s)")

    # a clean stop releases the Lease: a fresh candidate takes it without waiting it out
    late = start(cluster, "op-c")
    pair.append(late)
    wait_for(lambda: healthy(late), 30, "op-c standing by")
    standby.send_signal(signal.SIGTERM)
    assert standby.wait(30) == 0
    t0 = time.monotonic()
    wait_for(lambda: holder(cluster) == "op-c", 3 * DURATION, "op-c leads")
    assert time.monotonic() - t0 < DURATION, "a released Lease is taken at once"
    for name in ("one", "two"):
        cluster.kubectl("delete", "cms", name, "-n", NS, "--wait=false")


def test_a_stopped_elector_renews_no_more_and_its_release_holds(cluster):
    """A clean shutdown stops the renewals before it hands the Lease over: one renewal after the
    release would take the Lease back, and a fresh candidate would wait it out."""
    from kubernetes import config

    from cpuserve_operator.leader import Elector

    cluster.kubectl("create", "namespace", NS, check=False)
    config.load_kube_config(str(cluster.kubeconfig))
    e = Elector(NS, "stop-test", "me", duration=4, renew_deadline=3, retry=0.2)
    e.wait_until_leading()
    lost = []
    keeper = threading.Thread(target=e.keep_leading, args=(lambda: lost.append(True),))
    keeper.start()
    time.sleep(0.5)  # a few renewals
    e.stop()
    keeper.join(5)
    assert not keeper.is_alive() and not lost
    e.release()
    time.sleep(1)  # five renewal periods
    lease = json.loads(cluster.kubectl("get", "lease", "-n", NS, "stop-test", "-o", "json").stdout)
    assert lease["spec"].get("holderIdentity") == ""
