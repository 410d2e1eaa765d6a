"""The operator as a real process against the real API server. Nodes are Node
objects with published NUMA topology; the test plays the kubelet: it marks pods
Ready, rejects one (OutOfcpu), and finishes terminations."""
import json
import os
import subprocess
import sys

import pytest

from conftest import free_port, wait_for

NS = "default"


def topology(numa=2, cpus=8, mem_gib=16, smt=2):
    nodes = []
    for i in range(numa):
        first = list(range(i * cpus // smt, (i + 1) * cpus // smt))
        sib = [c + numa * cpus // smt for c in first]
        nodes.append({"id": i, "cpus": ",".join(map(str, first + sib)), "memory": mem_gib << 30})
    return {"numaNodes": nodes, "threadsPerCore": smt}


def add_node(cluster, name, **kw):
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name},
                     "annotations": {"cpuserve.dev/topology": json.dumps(topology(**kw))}}}))
    cluster.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps({"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated"}],
        "allocatable": {"cpu": "16", "memory": "32Gi", "pods": "110"},
        "capacity": {"cpu": "16", "memory": "32Gi", "pods": "110"}}}))


def pods(cluster, name="llm"):
    items = cluster.get("pods", "-n", NS, "-l", f"cpuserve.dev/server={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def kubelet(cluster, ready=True, name="llm"):
    """What kubelets would do: finish terminations, report new pods Running and Ready."""
    for p in cluster.get("pods", "-n", NS, "-l", f"cpuserve.dev/server={name}")["items"]:
        if p["metadata"].get("deletionTimestamp"):
            cluster.kubectl("delete", "pod", "-n", NS, p["metadata"]["name"], "--grace-period=0", "--force",
                            "--wait=false", check=False)
        elif ready and p.get("status", {}).get("phase") != "Running":
            set_status(cluster, p["metadata"]["name"], {
                "phase": "Running", "podIP": "10.1.0.1",
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]})


def set_status(cluster, pod, status):
    cluster.kubectl("patch", "pod", "-n", NS, pod, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def cms(cluster, name="llm"):
    return cluster.get("cms", "-n", NS, name)


def condition(obj, type_):
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def _placed_and_served(cluster):
    """Pods placed one per NUMA node, spreading over machines, Guaranteed, pinned, probed."""
    got = wait_for(lambda: len(pods(cluster)) == 3 and pods(cluster), 60, "3 pods")
    by_replica = {p["metadata"]["labels"]["cpuserve.dev/replica"]: p for p in got}
    assert [by_replica[i]["spec"]["nodeName"] for i in "012"] == ["node-a", "node-b", "node-a"]
    assert [by_replica[i]["metadata"]["annotations"]["cpuserve.dev/slot"] for i in "012"] == \
        ["node-a/0", "node-b/0", "node-a/1"]
    c = by_replica["0"]["spec"]["containers"][0]
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "6", "memory": str(4 << 30)}
    assert by_replica["0"]["status"]["qosClass"] == "Guaranteed"
    owner = by_replica["0"]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "CPUModelServer" and owner["controller"] is True
    svc = wait_for(lambda: cluster.get("svc", "-n", NS, "llm"), 30, "service")
    assert svc["spec"]["selector"] == {"cpuserve.dev/server": "llm"}
    pdb = wait_for(lambda: cluster.get("pdb", "-n", NS, "llm"), 30, "pod disruption budget")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert pdb["metadata"]["ownerReferences"][0]["kind"] == "CPUModelServer"
    # the budget counts the server's pods (the eviction API holds a drain to one of them at a time)
    wait_for(lambda: cluster.get("pdb", "-n", NS, "llm").get("status", {}).get("expectedPods") == 3, 60,
             "the budget counting the 3 pods")
    ing = wait_for(lambda: cluster.get("ingress", "-n", NS, "llm"), 30, "ingress")
    assert ing["spec"]["rules"][0]["host"] == "llm.example.com"
    wait_for(lambda: cms(cluster).get("status", {}).get("phase") == "Loading", 30, "phase Loading")
    assert cms(cluster)["status"]["readyText"] == "0/3"


def _becomes_ready(cluster) -> str:
    """The kubelet reports them Ready: the server is Ready and `kubectl wait` works."""
    kubelet(cluster)
    cluster.kubectl("wait", "--for=condition=Ready", "cms/llm", "-n", NS, "--timeout=60s")
    st = cms(cluster)["status"]
    assert st["phase"] == "Ready" and st["readyReplicas"] == 3 and st["endpoint"] == "http://llm.example.com/v1"
    assert {p["node"] for p in st["placements"]} == {"node-a", "node-b"}
    table = cluster.kubectl("get", "cms", "llm", "-n", NS).stdout
    assert "Ready" in table and "3/3" in table
    return st["specHash"]


def _rolls_one_at_a_time(cluster, old_hash: str):
    """A spec change rolls the pods one at a time."""
    cluster.kubectl("patch", "cms", "llm", "-n", NS, "--type=merge", "-p", '{"spec":{"engine":{"dtype":"bfloat16"}}}')
    most_starting = most_pods = 0

    def rolled():
        nonlocal most_starting, most_pods
        ps = pods(cluster)
        most_pods = max(most_pods, len(ps))
        new = [p for p in ps if p["metadata"]["labels"]["cpuserve.dev/spec-hash"] != old_hash]
        starting = [p for p in new if p.get("status", {}).get("phase") != "Running"]
        most_starting = max(most_starting, len(starting))
        kubelet(cluster)
        s = cms(cluster).get("status", {})
        return len(new) == 3 and len(ps) == 3 and s.get("phase") == "Ready" and s.get("specHash") != old_hash
    wait_for(rolled, 120, "rolling update", interval=0.5)
    assert most_starting == 1 and most_pods == 4  # one at a time, surging into the free fourth NUMA slot
    for p in pods(cluster):
        env = {e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]}
        assert "--dtype" in p["spec"]["containers"][0]["args"] and env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def _rejected_pod_replaced(cluster):
    """The kubelet rejects a pod: reported, replaced (after a backoff, not in a hot loop)."""
    victim = sorted(pods(cluster), key=lambda p: p["metadata"]["name"])[0]["metadata"]["name"]
    set_status(cluster, victim, {"phase": "Failed", "reason": "OutOfcpu",
                                 "message": "Pod was rejected: Node didn't have enough resource: cpu",
                                 "conditions": [{"type": "Ready", "status": "False"}]})
    wait_for(lambda: "OutOfcpu" in condition(cms(cluster), "Degraded").get("message", ""), 30, "Degraded: OutOfcpu")

    def replaced():
        kubelet(cluster)
        return cms(cluster)["status"]["phase"] == "Ready" and len(pods(cluster)) == 3
    wait_for(replaced, 60, "replacement Ready", interval=0.5)


def _node_lost(cluster):
    """A node goes away: its replica is re-placed; with too few slots left, Degraded says why."""
    cluster.kubectl("delete", "node", "node-b")

    def degraded():
        kubelet(cluster)
        s = cms(cluster)["status"]
        return s["phase"] == "Degraded" and "InsufficientNUMASlots" == condition(cms(cluster), "Ready")["reason"]
    wait_for(degraded, 60, "Degraded after node loss", interval=0.5)
    assert all(p["spec"]["nodeName"] == "node-a" for p in pods(cluster))
    cluster.kubectl("scale", "cms/llm", "-n", NS, "--replicas=2")

    def two_ready():
        kubelet(cluster)
        return cms(cluster)["status"]["phase"] == "Ready" and len(pods(cluster)) == 2
    wait_for(two_ready, 60, "Ready at 2 replicas", interval=0.5)


def _too_large_refused(cluster):
    """A size no NUMA node can hold: refused with a condition that says so."""
    cluster.kubectl("patch", "cms", "llm", "-n", NS, "--type=merge", "-p", '{"spec":{"engine":{"kvCacheGiB":100}}}')
    wait_for(lambda: condition(cms(cluster), "Ready").get("reason") == "DoesNotFitNUMANode", 30, "DoesNotFitNUMANode")
    msg = condition(cms(cluster), "Ready")["message"]
    assert "102.0 GiB" in msg and "16.0 GiB" in msg and cms(cluster)["status"]["phase"] == "Failed"


def _deleted_and_collected(cluster):
    """Deletion: everything it owns is garbage collected."""
    cluster.kubectl("delete", "cms", "llm", "-n", NS, "--wait=false")
    wait_for(lambda: cluster.kubectl("get", "cms", "llm", "-n", NS, check=False).returncode != 0, 60, "CR gone")
    try:
        wait_for(lambda: cluster.kubectl("get", "svc", "llm", "-n", NS, check=False).returncode != 0, 180,
                 "service GC")
    except TimeoutError as e:
        raise AssertionError(f"{e}\n--- kube-controller-manager:\n{cluster.tail('kube-controller-manager', 60)}")
    wait_for(lambda: cluster.kubectl("get", "ingress", "llm", "-n", NS, check=False).returncode != 0, 60, "ingress GC")
    wait_for(lambda: cluster.kubectl("get", "pdb", "llm", "-n", NS, check=False).returncode != 0, 60, "budget GC")

    def pods_gone():
        kubelet(cluster, ready=False)
        return not cluster.get("pods", "-n", NS, "-l", "cpuserve.dev/server=llm")["items"]
    wait_for(pods_gone, 60, "pods GC")


def test_lifecycle(cluster, operator):
    add_node(cluster, "node-a")
    add_node(cluster, "node-b")
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "llm", "namespace": NS},
        "spec": {"model": {"source": "packaged://smollm2", "servedName": "smollm2", "sizeGiB": 1},
                 "engine": {"kvCacheGiB": 2}, "replicas": 3,
                 "ingress": {"enabled": True, "host": "llm.example.com"}}}))
    _placed_and_served(cluster)
    _rolls_one_at_a_time(cluster, _becomes_ready(cluster))
    _rejected_pod_replaced(cluster)
    _node_lost(cluster)
    _too_large_refused(cluster)
    _deleted_and_collected(cluster)


def test_a_deleted_server_waits_at_most_a_second_for_a_resync_pass(monkeypatch):
    """kopf puts a finalizer on a server for its resync timer; a deletion that meets the timer
    mid-pass is looked at again after `cancellation_polling` (kopf's default: 60 s, which once
    kept a deleted server for a minute). The operator's own settings, as it starts."""
    import kopf
    from cpuserve_operator import handlers

    monkeypatch.setattr(handlers.config, "load_incluster_config", lambda: None)
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    assert settings.background.cancellation_polling <= 1.0
    assert settings.persistence.finalizer == "cpuserve.dev/kopf-finalizer"


def test_generated_objects_pass_server_side_validation(cluster):
    """Every builder's output, strictly validated by the API server (dry run)."""
    from cpuserve_operator import builders as b
    from cpuserve_operator.placement import parse_spec, plan
    from test_placement import machine

    cr = {"metadata": {"name": "dry", "namespace": NS, "uid": "00000000-0000-0000-0000-000000000001"}}
    for raw in ({"model": {"source": "pvc://weights/m"}, "placement": {"pinning": "Engine"},
                 "seccompProfile": {"type": "Localhost", "localhostProfile": "cpuserve/numa.json"},
                 "ingress": {"enabled": True, "host": "x.example.com", "tls": True, "className": "nginx"},
                 "monitoring": {"serviceMonitor": {"enabled": True, "interval": "1m30s", "labels": {"team": "ml"}}}},
                {"model": {"source": "packaged://smollm2"}, "placement": {"strategy": "TensorParallel",
                                                                         "tensorParallelSize": 2}},
                {"model": {"source": "image://registry.example/models/smollm2:q4", "path": "model.gguf",
                           "loraAdapters": [{"name": "sql", "source": "image://registry.example/lora/sql:1"},
                                            {"name": "chat", "source": "file:///opt/lora/chat"}]}},
                {"model": {"source": "https://models.example.com/m.gguf", "sha256": "ab" * 32}}):
        spec = parse_spec("dry", raw)
        (pl,) = plan(spec, [machine("n")]).placements
        for obj in (b.build_pod(cr, spec, pl), b.build_service(cr, spec), b.build_ingress(cr, spec),
                    b.build_pdb(cr, spec), b.build_service_monitor(cr, spec)):
            if obj is None:
                continue
            r = cluster.kubectl("create", "--dry-run=server", "--validate=strict", "-f", "-", input=json.dumps(obj),
                                check=False)
            assert r.returncode == 0, f"{obj['kind']}: {r.stderr}"


def test_a_service_monitor_follows_the_spec_and_the_crds(cluster, operator):
    """monitoring.serviceMonitor: created, changed and deleted with the spec; without the Prometheus
    Operator's CRD a Warning event, and the monitor appears once the CRD is installed again."""
    from conftest import MONITOR_CRD
    from pathlib import Path

    def monitor():
        r = cluster.kubectl("get", "servicemonitors.monitoring.coreos.com", "mon", "-n", NS, "-o", "json",
                            check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def server(sm):
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "mon", "namespace": NS},
            "spec": {"model": {"source": "packaged://smollm2"}, "replicas": 0, "monitoring": {"serviceMonitor": sm}}}))

    server({"enabled": True, "labels": {"release": "prom"}})
    sm = wait_for(monitor, 30, "service monitor")
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    svc = wait_for(lambda: cluster.get("svc", "-n", NS, "mon"), 30, "service")
    assert sm["spec"]["selector"]["matchLabels"] == {"cpuserve.dev/server": "mon"}
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()  # it selects the Service
    assert sm["metadata"]["labels"]["release"] == "prom" and sm["metadata"]["ownerReferences"][0]["name"] == "mon"
    server({"enabled": True, "interval": "15s", "labels": {"team": "ml"}})
    sm = wait_for(lambda: (m := monitor()) and m["spec"]["endpoints"][0]["interval"] == "15s" and m, 30, "new interval")
    assert "release" not in sm["metadata"]["labels"] and sm["metadata"]["labels"]["team"] == "ml"
    server({"enabled": False})
    wait_for(lambda: monitor() is None, 30, "monitor deleted")

    crd = Path(os.environ["KUBEBUILDER_ASSETS"], MONITOR_CRD)
    cluster.kubectl("delete", "-f", str(crd))
    try:
        server({"enabled": True})
        wait_for(lambda: any(e["reason"] == "ServiceMonitorUnavailable" and e["involvedObject"]["name"] == "mon"
                             for e in cluster.get("events", "-n", NS)["items"]), 30, "warning event")
    finally:
        cluster.kubectl("apply", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "-f", str(crd), "--timeout=60s")
    wait_for(monitor, 30, "monitor once the CRD is back")
    cluster.kubectl("delete", "cms", "mon", "-n", NS)
    wait_for(lambda: monitor() is None, 180, "monitor GC")


def test_tensor_parallel_pods(cluster, operator):
    add_node(cluster, "big", numa=4)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "tp", "namespace": NS},
        "spec": {"model": {"source": "packaged://smollm2", "servedName": "smollm2", "sizeGiB": 2},
                 "engine": {"kvCacheGiB": 3}, "replicas": 2,
                 "placement": {"strategy": "TensorParallel", "tensorParallelSize": 2, "pinning": "Engine"}}}))
    got = wait_for(lambda: len(pods(cluster, "tp")) == 2 and pods(cluster, "tp"), 60, "2 TP pods")
    slots = sorted(p["metadata"]["annotations"]["cpuserve.dev/slot"] for p in got)
    assert all(s.endswith(("/0,1", "/2,3")) for s in slots) and len(set(slots)) == 2
    for p in got:
        c = p["spec"]["containers"][0]
        args, env = c["args"], {e["name"]: e["value"] for e in c["env"]}
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert c["resources"]["limits"] == {"cpu": str(2 * (8 - 2)), "memory": str((2 + 2 * 3 + 1) << 30)}
        ranks = env["VLLM_CPU_OMP_THREADS_BIND"].split("|")
        assert len(ranks) == 2 and env["CPU_VISIBLE_MEMORY_NODES"] in ("0,1", "2,3")
        assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    kubelet(cluster, name="tp")
    cluster.kubectl("wait", "--for=condition=Ready", "cms/tp", "-n", NS, "--timeout=60s")
    placements = cms(cluster, "tp")["status"]["placements"]
    assert sorted(len(p["numaNodes"]) for p in placements) == [2, 2] and all(p["cpus"] for p in placements)
    cluster.kubectl("delete", "cms", "tp", "-n", NS)


def test_tainted_nodes_only_for_servers_that_tolerate_them(cluster, operator):
    """The operator binds pods by nodeName, so the scheduler never checks taints: a dedicated
    node's NoSchedule taint keeps a server off it (the status says why) until the server tolerates it."""
    add_node(cluster, "dedicated")
    cluster.kubectl("label", "node", "dedicated", "pool=llm")
    cluster.kubectl("taint", "node", "dedicated", "dedicated=llm:NoSchedule")
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "tol", "namespace": NS},
        "spec": {"model": {"source": "packaged://smollm2", "servedName": "smollm2"}, "engine": {"kvCacheGiB": 2},
                 "placement": {"nodeSelector": {"pool": "llm"}}}}))
    msg = wait_for(lambda: condition(cms(cluster, "tol"), "Ready").get("message", ""), 30, "a reason")
    assert "dedicated: taint dedicated=llm:NoSchedule not tolerated" in msg and not pods(cluster, "tol")
    tol = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    cluster.kubectl("patch", "cms", "tol", "-n", NS, "--type=merge", "-p",
                    json.dumps({"spec": {"placement": {"tolerations": [tol]}}}))
    (pod,) = wait_for(lambda: pods(cluster, "tol"), 30, "the pod on the tainted node")
    assert pod["spec"]["nodeName"] == "dedicated" and tol in pod["spec"]["tolerations"]
    cluster.kubectl("delete", "cms", "tol", "-n", NS)
    cluster.kubectl("delete", "node", "dedicated")


def test_two_replicas_on_two_numa_nodes_under_every_pinning(cluster, operator):
    """A two-NUMA-node machine per kubelet configuration (the agent's report of its CPU
    manager), a server per pinning mode: the two replicas always end on different NUMA nodes.
    Without a static CPU manager the engine is told its slot; with one, the kubelet chooses
    (the test plays the agent reporting its choice) and status shows what the pods got."""
    for policy in ("static", "none"):
        add_node(cluster, f"pin-{policy}", numa=2)
        cluster.kubectl("label", "node", f"pin-{policy}", f"pool=pin-{policy}")
        cluster.kubectl("annotate", "node", f"pin-{policy}", "cpuserve.dev/kubelet=" + json.dumps(
            {"cpuManagerPolicy": policy, "memoryManagerPolicy": "Static" if policy == "static" else "None"}))
    numa_cpus = [set(range(0, 4)) | set(range(8, 12)), set(range(4, 8)) | set(range(12, 16))]  # topology() of add_node
    for policy in ("static", "none"):
        for pinning in ("Kubelet", "Engine"):
            name = f"pin-{policy}-{pinning.lower()}"
            cluster.kubectl("apply", "-f", "-", input=json.dumps({
                "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"model": {"source": "packaged://smollm2", "sizeGiB": 1}, "engine": {"kvCacheGiB": 1},
                         "replicas": 2, "placement": {"pinning": pinning, "nodeSelector": {"pool": f"pin-{policy}"}}}}))
            got = wait_for(lambda: len(pods(cluster, name)) == 2 and pods(cluster, name), 60, f"{name}: 2 pods")
            got.sort(key=lambda p: p["metadata"]["labels"]["cpuserve.dev/replica"])
            envs = [{e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]} for p in got]
            if policy == "none":  # the engine binds itself to its slot
                assert [e["CPU_VISIBLE_MEMORY_NODES"] for e in envs] == ["0", "1"], name
                for e, cpus in zip(envs, numa_cpus):
                    assert set(map(int, e["VLLM_CPU_OMP_THREADS_BIND"].split(","))) <= cpus, name
            else:  # the kubelet picks (here: the other way round); the engine binds inside its cpuset
                assert all(e["VLLM_CPU_OMP_THREADS_BIND"] == "auto" for e in envs), name
                for p, node in zip(got, (1, 0)):
                    cluster.kubectl("annotate", "pod", "-n", NS, p["metadata"]["name"], "cpuserve.dev/assigned=" +
                                    json.dumps({"cpus": f"{4 * node + 1}-{4 * node + 3}", "memoryNodes": [node]}))
            kubelet(cluster, name=name)
            cluster.kubectl("wait", "--for=condition=Ready", f"cms/{name}", "-n", NS, "--timeout=30s")
            placements = wait_for(lambda: all(p.get("cpus") for p in cms(cluster, name)["status"]["placements"])
                                  and cms(cluster, name)["status"]["placements"], 20, f"{name}: placements")
            if policy == "static":
                assert [p["memoryNodes"] for p in placements] == [[1], [0]], name
                assert {p["reportedBy"] for p in placements} == {"kubelet"}
            else:
                assert [p["numaNodes"] for p in placements] == [[0], [1]], name
                assert {p["reportedBy"] for p in placements} == {"operator"}
            # the engines answer GET /topology (the agent records it): status shows where they really are
            where = (1, 0) if policy == "static" else (0, 1)
            for p, node in zip(got, where):
                cluster.kubectl("annotate", "pod", "-n", NS, p["metadata"]["name"], "cpuserve.dev/bound=" +
                                json.dumps({"cpus": f"{4 * node + 1}-{4 * node + 3}", "memoryNodes": [node]}))
            placements = wait_for(lambda: {p["reportedBy"] for p in cms(cluster, name)["status"]["placements"]}
                                  == {"engine"} and cms(cluster, name)["status"]["placements"], 20, "engine report")
            assert [p["memoryNodes"] for p in placements] == [[n] for n in where], name
            placed = [e for e in cluster.get("events", "-n", NS, "--field-selector",
                                             f"involvedObject.name={name},reason=Placed")["items"]]
            assert len(placed) == 2 and all(("static CPU manager" in e["message"]) == (policy == "static")
                                            for e in placed), name
            cluster.kubectl("delete", "cms", name, "-n", NS, "--wait=false")
            wait_for(lambda: not kubelet(cluster, ready=False, name=name) and not pods(cluster, name), 180,
                     "garbage collection")


@pytest.mark.parametrize("seccomp,admitted", [
    ({"type": "Localhost", "localhostProfile": "cpuserve/numa.json"}, {"restricted", "baseline", "privileged"}),
    ({"type": "RuntimeDefault"}, {"privileged"}),
])
def test_pod_security_level_engine_pods_need(cluster, seccomp, admitted):
    """What the README says: with the chart's Localhost profile an engine pod has no capability
    and passes Pod Security `restricted`; with RuntimeDefault it needs CAP_SYS_NICE, which
    `baseline` forbids. The API server's PodSecurity admission decides (server-side dry run)."""
    from cpuserve_operator import builders as b
    from cpuserve_operator.placement import parse_spec, plan
    from test_placement import machine

    spec = parse_spec("pss", {"seccompProfile": seccomp})
    (pl,) = plan(spec, [machine("n")]).placements
    for level in ("restricted", "baseline", "privileged"):
        ns = f"pss-{level}"
        cluster.kubectl("create", "namespace", ns, check=False)
        cluster.kubectl("label", "namespace", ns, f"pod-security.kubernetes.io/enforce={level}", "--overwrite")
        pod = b.build_pod({"metadata": {"name": "pss", "namespace": ns, "uid": "00000000-0000-0000-0000-00000000000a"}},
                          spec, pl)
        r = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
        assert (r.returncode == 0) == (level in admitted), f"{level}: {r.stderr}"


def test_model_claim_access_modes_decide_where_replicas_go(cluster, operator):
    """pvc:// models: a missing claim is refused with a condition; a ReadWriteOnce claim keeps
    the replicas on one node (a node can mount it, another cannot); ReadOnlyMany spreads them."""
    for n in ("claim-a", "claim-b"):
        add_node(cluster, n, numa=4)
        cluster.kubectl("label", "node", n, "pool=claim", "--overwrite")

    def server(name, claim):
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"source": f"pvc://{claim}/llama", "sizeGiB": 1}, "engine": {"kvCacheGiB": 1},
                     "replicas": 2, "placement": {"nodeSelector": {"pool": "claim"}}}}))

    def claim(name, mode):
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": NS},
            "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "10Gi"}}}}))

    server("rwo", "weights-rwo")
    cond = wait_for(lambda: condition(cms(cluster, "rwo"), "Ready").get("reason") == "ModelClaimUnusable"
                    and condition(cms(cluster, "rwo"), "Ready"), 30, "missing claim refused")
    assert "model claim weights-rwo not found" in cond["message"] and not pods(cluster, "rwo")
    claim("weights-rwo", "ReadWriteOnce")
    got = wait_for(lambda: len(pods(cluster, "rwo")) == 2 and pods(cluster, "rwo"), 30, "2 pods")
    assert len({p["spec"]["nodeName"] for p in got}) == 1  # one node: the claim mounts there only
    assert any(e["reason"] == "ReadWriteOnceModel" for e in cluster.get(
        "events", "-n", NS, "--field-selector", "involvedObject.name=rwo")["items"])
    claim("weights-rox", "ReadOnlyMany")
    server("rox", "weights-rox")
    got = wait_for(lambda: len(pods(cluster, "rox")) == 2 and pods(cluster, "rox"), 30, "2 pods")
    assert len({p["spec"]["nodeName"] for p in got}) == 2  # spread over machines
    for name in ("rwo", "rox"):
        cluster.kubectl("delete", "cms", name, "-n", NS, "--wait=false")
