"""What the kubelet reports about pods (image pulls, crash loops, OOM kills) and nodes (a
NotReady blip, a lost node) as the operator reports it: conditions, Events, metrics. The
test writes pod and node status as kubelets and the node controller would."""
import json
import time
import urllib.request

from conftest import wait_for
from test_operator import NS, add_node, cms, condition, kubelet, pods, set_status


def events(cluster, name):
    items = cluster.get("events", "-n", NS, "--field-selector", f"involvedObject.name={name}")["items"]
    return {(e["reason"], e["message"]) for e in items}


def reasons(cluster, name):
    return {r for r, _ in events(cluster, name)}


def apply_server(cluster, name, replicas, node_selector):
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"source": "packaged://smollm2", "sizeGiB": 1}, "engine": {"kvCacheGiB": 1},
                 "replicas": replicas, "placement": {"nodeSelector": node_selector}}}))


def test_pod_problems_reach_status_events_and_metrics(cluster, operator):
    add_node(cluster, "sick-a", numa=3)
    cluster.kubectl("label", "node", "sick-a", "pool=sick")
    apply_server(cluster, "sick", 3, {"pool": "sick"})
    got = wait_for(lambda: len(pods(cluster, "sick")) == 3 and pods(cluster, "sick"), 60, "3 pods")
    by = {p["metadata"]["labels"]["cpuserve.dev/replica"]: p["metadata"]["name"] for p in got}
    assert reasons(cluster, "sick") >= {"Placed"}
    waiting = {"type": "ContainersReady", "status": "False"}
    set_status(cluster, by["0"], {"phase": "Pending", "conditions": [waiting], "containerStatuses": [{
        "name": "engine", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope:1"'}}}]})
    set_status(cluster, by["1"], {"phase": "Running", "conditions": [waiting], "containerStatuses": [{
        "name": "engine", "image": "x", "imageID": "", "ready": False, "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s restarting failed container"}},
        "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": "ValueError: no such model"}}}]})
    set_status(cluster, by["2"], {"phase": "Running", "conditions": [waiting], "containerStatuses": [{
        "name": "engine", "image": "x", "imageID": "", "ready": False, "restartCount": 1,
        "state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]})
    # within one reconcile (each status write is a pod event that triggers one)
    t0 = time.monotonic()
    wait_for(lambda: reasons(cluster, "sick") >= {"ImagePullBackOff", "CrashLoopBackOff", "OOMKilled"}, 15, "Events")
    deg = wait_for(lambda: condition(cms(cluster, "sick"), "Degraded").get("status") == "True"
                   and condition(cms(cluster, "sick"), "Degraded"), 15, "Degraded")
    took = time.monotonic() - t0
    assert "ImagePullBackOff" in deg["message"] and 'pulling image "nope:1"' in deg["message"]
    assert "CrashLoopBackOff" in deg["message"] and "ValueError: no such model" in deg["message"]
    assert "OOMKilled (exit 137)" in deg["message"]
    st = cms(cluster, "sick")["status"]
    assert st["phase"] == "Degraded" and condition(cms(cluster, "sick"), "Ready")["reason"] == "ImagePullBackOff"
    # told once, not at every resync
    time.sleep(3)
    items = cluster.get("events", "-n", NS, "--field-selector", "involvedObject.name=sick,reason=OOMKilled")["items"]
    assert len(items) == 1 and items[0]["count"] == 1, items
    text = urllib.request.urlopen(operator.metrics, timeout=5).read().decode()
    assert 'cpuserve_operator_replicas{namespace="default",server="sick",state="failing"} 3.0' in text
    assert 'cpuserve_operator_events_total{reason="OOMKilled",type="Warning"}' in text
    assert "cpuserve_operator_reconciles_total{result=\"ok\"}" in text
    assert "cpuserve_operator_queue_wait_seconds_bucket" in text
    print(f"problems in status and Events {took:.1f}s after the kubelet reported them")
    # recovered: Ready, and the problems leave the conditions
    kubelet(cluster, name="sick")
    for p in pods(cluster, "sick"):
        set_status(cluster, p["metadata"]["name"], {"phase": "Running", "containerStatuses": [{
            "name": "engine", "image": "x", "imageID": "", "ready": True, "restartCount": 1, "state": {"running": {}}}],
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]})
    cluster.kubectl("wait", "--for=condition=Ready", "cms/sick", "-n", NS, "--timeout=30s")
    assert condition(cms(cluster, "sick"), "Degraded")["status"] == "False"
    cluster.kubectl("delete", "cms", "sick", "-n", NS, "--wait=false")


def node_ready(cluster, name, status):
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.kubectl("patch", "node", name, "--subresource=status", "--type=strategic", "-p", json.dumps({"status": {
        "conditions": [{"type": "Ready", "status": status, "reason": "Simulated", "message": "test",
                        "lastTransitionTime": now, "lastHeartbeatTime": now}]}}))


def test_a_not_ready_blip_kills_nothing_a_lost_node_is_replaced(cluster, operator):
    add_node(cluster, "blip-a")
    cluster.kubectl("label", "node", "blip-a", "pool=blip")
    apply_server(cluster, "blip", 2, {"pool": "blip"})
    wait_for(lambda: len(pods(cluster, "blip")) == 2, 60, "2 pods")
    kubelet(cluster, name="blip")
    cluster.kubectl("wait", "--for=condition=Ready", "cms/blip", "-n", NS, "--timeout=30s")
    before = sorted(p["metadata"]["uid"] for p in pods(cluster, "blip"))
    assert all(t["tolerationSeconds"] == 8 for p in pods(cluster, "blip") for t in p["spec"]["tolerations"]
               if t["key"].startswith("node.kubernetes.io/"))

    # a kubelet restart: NotReady for 4 s of the 8 s grace; reported, nothing deleted
    node_ready(cluster, "blip-a", "Unknown")
    wait_for(lambda: condition(cms(cluster, "blip"), "Degraded").get("reason") == "NodeNotReady", 10, "NodeNotReady")
    time.sleep(3)
    node_ready(cluster, "blip-a", "True")
    wait_for(lambda: condition(cms(cluster, "blip"), "Degraded").get("status") == "False", 10, "recovered")
    all_pods = cluster.get("pods", "-n", NS, "-l", "cpuserve.dev/server=blip")["items"]
    assert sorted(p["metadata"]["uid"] for p in all_pods) == before
    assert not any(p["metadata"].get("deletionTimestamp") for p in all_pods)

    # lost for longer than the grace: deleted gracefully (no kubelet confirms it) and told
    node_ready(cluster, "blip-a", "False")
    wait_for(lambda: all(p["metadata"].get("deletionTimestamp") for p in
                         cluster.get("pods", "-n", NS, "-l", "cpuserve.dev/server=blip")["items"]), 20, "pods deleted")
    assert any("NodeLost" in m for r, m in events(cluster, "blip") if r == "Replacing")
    doomed = cluster.get("pods", "-n", NS, "-l", "cpuserve.dev/server=blip")["items"]
    assert all(p["metadata"]["deletionGracePeriodSeconds"] == 30 for p in doomed)  # not forced at once
    cluster.kubectl("delete", "cms", "blip", "-n", NS, "--wait=false")
    node_ready(cluster, "blip-a", "True")
    wait_for(lambda: not kubelet(cluster, ready=False, name="blip") and not pods(cluster, "blip"), 180, "cleanup")


def test_a_namespaced_operator_leaves_other_namespaces_alone(cluster, operator):
    """The operator watches `default` only: node events (which list servers cluster-wide to find
    the ones a node concerns) must not reconcile a server in another namespace."""
    cluster.kubectl("create", "namespace", "elsewhere", check=False)
    add_node(cluster, "ns-a")
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer",
        "metadata": {"name": "theirs", "namespace": "elsewhere"},
        "spec": {"model": {"source": "packaged://smollm2", "sizeGiB": 1}, "engine": {"kvCacheGiB": 1}}}))
    for status in ("Unknown", "True", "False", "True"):  # node events, each a reason to look at servers
        node_ready(cluster, "ns-a", status)
        time.sleep(1)
    assert not cluster.get("pods", "-n", "elsewhere")["items"]
    assert "status" not in cluster.get("cms", "-n", "elsewhere", "theirs")
    cluster.kubectl("delete", "cms", "theirs", "-n", "elsewhere", "--wait=false")
