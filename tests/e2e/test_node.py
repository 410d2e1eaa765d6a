"""The product's central claim on a real node: a CPUModelServer becomes a pod that the
kubelet admits, that gets exactly the CPUs and the memory node its status reports, that
can bind its memory under the agent's seccomp profile (and says so, once, when it cannot),
and that answers OpenAI requests through its Service. Then scale, roll and delete.

The tests run in order, as a user's session would: each step starts where the last left."""
from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

from cluster import CGROUP, KUBELET_ROOT, NODE_NAME, ROOT, wait_for

from conftest import VERSION

NS, NAME = "default", "smollm2"
NO_NUMA_PROFILE = "cpuserve-e2e/no-numa.json"
NUMA_CALLS = ["get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages"]
MEMBIND_WARNING = "NUMA memory binding is not in effect"
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "s390x": "s390x"}[os.uname().machine]
PROFILE = ROOT / "charts" / "cpuserve" / "files" / "seccomp" / f"numa-{ARCH}.json"  # what the chart installs here
CR = {
    "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": NAME, "namespace": NS},
    "spec": {"model": {"source": "packaged://smollm2", "servedName": "smollm2", "sizeGiB": 0.5},
             # the pod's memory passed through: the engine sizes its KV cache from that limit
             "engine": {"memoryGiB": 1.75, "maxNumSeqs": 8, "maxModelLen": 2048},
             "placement": {"strategy": "PerNUMANode", "reservedCPUs": 1, "pinning": "Kubelet"},
             "replicas": 1,
             "seccompProfile": {"type": "Localhost", "localhostProfile": "cpuserve/numa.json"}},
}


def helm_values(kubelet_config: Path) -> dict:
    """The chart's defaults but for the images (imported into containerd, never pulled), the
    operator's and agent's CPU requests (a 2-CPU node has one CPU to give, reservedSystemCPUs: 0,
    and it goes to the engine), and where this node's kubelet configuration is."""
    images = {"repository": "localhost/cpuserve-operator", "tag": VERSION, "pullPolicy": "Never"}
    return {"engine": {"image": {"repository": "localhost/cpuserve-engine", "tag": VERSION}},
            "operator": {"image": images, "resources": {"requests": {"cpu": "0", "memory": "128Mi"},
                                                        "limits": {"memory": "256Mi"}}},
            "nodeAgent": {"image": images, "resources": {"requests": {"cpu": "0", "memory": "48Mi"},
                                                         "limits": {"memory": "96Mi"}},
                          "kubeletConfig": [{"path": str(kubelet_config / "kubelet.yaml"), "type": "File"},
                                            {"path": str(kubelet_config / "kubelet.conf.d"), "type": "Directory"}]}}


def server(node) -> dict:
    return node.get("cms", NAME, "-n", NS)


def engine_pods(node) -> list[dict]:
    pods = node.get("pods", "-n", NS, "-l", f"cpuserve.dev/server={NAME}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def the_pod(node) -> dict:
    pods = engine_pods(node)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def container_cgroup(pod: dict, name: str = "engine", controller: str = "cpuset") -> Path:
    """A container's cgroup on the host (cgroupfs driver, v1): kubepods/[burstable|besteffort/]pod<uid>/<id>."""
    cid = next(c["containerID"] for c in pod["status"]["containerStatuses"] if c["name"] == name)
    qos = {"Guaranteed": "", "Burstable": "burstable", "BestEffort": "besteffort"}[pod["status"]["qosClass"]]
    path = CGROUP / controller / "kubepods" / qos / f"pod{pod['metadata']['uid']}" / cid.split("://", 1)[1]
    assert path.is_dir(), f"no cgroup {path}"
    return path


def cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def service_url(node) -> str:
    svc = node.get("svc", NAME, "-n", NS)
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"


def wait_ready(node, timeout: int = 300) -> dict:
    node.kubectl("wait", "--for=condition=Ready", f"cms/{NAME}", "-n", NS, f"--timeout={timeout}s",
                 timeout=timeout + 30)
    return server(node)


def topology_in_pod(node, pod: dict) -> dict:
    out = node.kubectl("exec", "-n", NS, pod["metadata"]["name"], "-c", "engine", "--", "cpuserve", "topology",
                       "--json").stdout
    return json.loads(out)


# -- the session -----------------------------------------------------------------------------------
def test_helm_install_publishes_topology_and_the_seccomp_profile(node, tmp_path):
    values = tmp_path / "values.json"
    values.write_text(json.dumps(helm_values(node.dir)))
    r = run_helm(node, "install", "cpuserve", str(ROOT / "charts" / "cpuserve"), "-n", "cpuserve-system",
                 "--create-namespace", "-f", str(values), "--wait", "--timeout", "4m")
    assert "STATUS: deployed" in r.stdout
    labels = wait_for(lambda: (lbl := node.get("node", NODE_NAME)["metadata"]["labels"]).get("cpuserve.dev/numa-nodes")
                      and lbl, 60, "the node agent's labels")
    assert int(labels["cpuserve.dev/numa-nodes"]) >= 1
    profile = KUBELET_ROOT / "seccomp" / "cpuserve" / "numa.json"
    assert json.loads(profile.read_text()) == json.loads(PROFILE.read_text())  # the node's architecture's


def test_server_becomes_ready_with_the_cpus_the_kubelet_gave_it(node):
    node.kubectl("apply", "-f", "-", input=json.dumps(CR))
    cms = wait_ready(node)
    assert cms["status"]["readyReplicas"] == 1
    # the node agent asks the engine where it bound itself (GET /topology, over the pod network)
    # and records it; the operator copies it into the status
    placement = wait_for(lambda: (p := server(node)["status"]["placements"][0]).get("reportedBy") == "engine"
                         and p, 60, "status.placements[0] from the engine's /topology")
    kubelet = json.loads(node.get("node", NODE_NAME)["metadata"]["annotations"]["cpuserve.dev/kubelet"])
    assert kubelet["cpuManagerPolicy"] == "static" and kubelet["memoryManagerPolicy"] == "Static", kubelet
    assert kubelet["topologyManagerPolicy"] == "single-numa-node", kubelet  # from the chart's drop-in
    pod = the_pod(node)
    assert placement["pod"] == pod["metadata"]["name"] and placement["node"] == NODE_NAME
    cg = container_cgroup(pod)
    cpus = cpulist((cg / "cpuset.cpus").read_text())
    assert cpus == cpulist(placement["cpus"]), (cpus, placement)
    alloc = int(node.get("node", NODE_NAME)["status"]["allocatable"]["cpu"])
    assert len(cpus) == alloc  # reservedCPUs: 1 leaves exactly the kubelet's reservedSystemCPUs
    # the memory node: the placed NUMA node, as the kubelet's memory manager set it
    mems = cpulist((cg / "cpuset.mems").read_text())
    assert mems == set(placement["numaNodes"]) == set(placement["memoryNodes"]), (mems, placement)
    # under the Localhost profile the engine may not even gain a capability (Pod Security: restricted)
    for pid in (cg / "tasks").read_text().split()[:1]:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        for key in ("CapEff", "CapBnd"):
            caps = next(ln for ln in status if ln.startswith(key))
            assert int(caps.split()[1], 16) == 0, caps


def test_no_other_container_on_the_node_shares_those_cpus(node):
    """Every other running container of every pod on the node (the operator's, the agent's)
    has a cpuset without the engine's CPUs. Pod sandboxes are not containers of the pod spec:
    their pause process keeps the pod cgroup's cpuset and sleeps in pause(2)."""
    pod = the_pod(node)
    cpus = cpulist((container_cgroup(pod) / "cpuset.cpus").read_text())
    others = [(p["metadata"]["name"], c["name"]) for p in node.get("pods", "-A")["items"]
              for c in p["status"].get("containerStatuses", []) if "running" in c.get("state", {})
              and p["metadata"]["uid"] != pod["metadata"]["uid"]]
    assert len(others) >= 3, others  # two operator replicas, the agent's two containers
    pods = {p["metadata"]["name"]: p for p in node.get("pods", "-A")["items"]}
    for pod_name, name in others:
        theirs = cpulist((container_cgroup(pods[pod_name], name) / "cpuset.cpus").read_text())
        assert theirs and not cpus & theirs, f"{pod_name}/{name} has CPUs {theirs}, the engine {cpus}"
    # and every thread of the engine runs there
    for pid in (container_cgroup(pod) / "tasks").read_text().split():
        allowed = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if ln.startswith("Cpus_allowed_list"))
        assert cpulist(allowed.split(":")[1]) <= cpus


def test_memory_binding_is_effective_under_the_agents_profile(node):
    pod = the_pod(node)
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "Localhost",
                                                                "localhostProfile": "cpuserve/numa.json"}
    topo = topology_in_pod(node, pod)
    assert topo["memory_binding"]["effective"] is True, topo["memory_binding"]
    logs = node.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "engine").stdout
    assert MEMBIND_WARNING not in logs
    # the KV cache the 1.75 GiB limit leaves, with the computation in the log: limit - in use -
    # weights (the GGUF's blocks, 0.09 GiB) - runtime reserve
    line = next((ln for ln in logs.splitlines() if "KV cache" in ln and "memory limit 1.75 GiB" in ln), None)
    assert line, logs[-3000:]
    nums = [float(x) for x in re.findall(r"([0-9.]+) GiB", line.split("memory limit")[1])[:1]
            + re.findall(r"- (?:in use|weights|runtime reserve) ([0-9.]+)", line)]
    kv = float(line.split("KV cache ")[1].split(" GiB")[0])
    assert len(nums) == 4 and 0 < kv < 1.75 and abs(nums[0] - sum(nums[1:]) - kv) < 0.02, line
    assert nums[2] < 0.1, line  # the weights stay in their blocks in the pod too


def test_streamed_chat_and_metrics_through_the_service(node):
    url = service_url(node)
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "What is a CPU?"}],
                       "max_tokens": 12, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    chunks, done = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert done and len(chunks) >= 3 and text.strip(), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") or chunks[-2]["choices"][0]["finish_reason"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    generated = [float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                 if ln.startswith("vllm:generation_tokens_total{")]
    assert generated and sum(generated) >= len(chunks) - 2, metrics[:1000]  # the stream's tokens were counted


def test_a_spec_change_rolls_and_a_forbidding_profile_warns_once(node):
    """A profile that refuses the NUMA calls (RuntimeDefault without CAP_SYS_NICE): the rolled pod
    still serves, `cpuserve topology` reports binding not effective, the log warns once."""
    numa = json.loads(PROFILE.read_text())
    # RuntimeDefault for a container without CAP_SYS_NICE: the chart's profile without its NUMA rule
    forbid = {**numa, "syscalls": [r for r in numa["syscalls"] if not set(NUMA_CALLS) & set(r["names"])]}
    assert len(forbid["syscalls"]) == len(numa["syscalls"]) - 1
    path = KUBELET_ROOT / "seccomp" / NO_NUMA_PROFILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(forbid))
    old = the_pod(node)["metadata"]["name"]
    old_hash = server(node)["status"]["specHash"]
    node.kubectl("patch", "cms", NAME, "-n", NS, "--type=merge", "-p",
                 json.dumps({"spec": {"seccompProfile": {"type": "Localhost", "localhostProfile": NO_NUMA_PROFILE}}}))
    wait_for(lambda: server(node)["status"].get("specHash") != old_hash, 60, "the operator sees the new spec")
    wait_for(lambda: [p["metadata"]["name"] for p in engine_pods(node)] not in ([], [old])
             and server(node)["status"]["phase"] == "Ready", 300, "the rolled pod Ready", interval=2)
    pod = the_pod(node)
    assert pod["metadata"]["name"] != old
    assert pod["spec"]["securityContext"]["seccompProfile"]["localhostProfile"] == NO_NUMA_PROFILE
    topo = topology_in_pod(node, pod)
    assert topo["memory_binding"]["effective"] is False, topo
    logs = node.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "engine").stdout
    assert logs.count(MEMBIND_WARNING) == 1, logs[-3000:]
    # and it still serves
    with urllib.request.urlopen(f"{service_url(node)}/v1/models", timeout=30) as r:
        assert json.load(r)["data"][0]["id"] == "smollm2"


def test_scale_to_zero_and_back(node):
    node.kubectl("scale", f"cms/{NAME}", "-n", NS, "--replicas=0")
    wait_for(lambda: not engine_pods(node) and not node.get("pods", "-n", NS, "-l",
                                                            f"cpuserve.dev/server={NAME}")["items"],
             120, "no engine pods", interval=1)
    assert server(node)["status"]["readyReplicas"] == 0
    node.kubectl("scale", f"cms/{NAME}", "-n", NS, "--replicas=1")
    cms = wait_ready(node)
    assert cms["status"]["readyReplicas"] == 1 and len(engine_pods(node)) == 1


def test_deleting_the_server_leaves_nothing_behind(node):
    pod = the_pod(node)
    node.kubectl("delete", "cms", NAME, "-n", NS, "--wait=true", "--timeout=120s", timeout=150)
    sel = f"cpuserve.dev/server={NAME}"
    wait_for(lambda: not node.get("pods,svc,ingress", "-n", NS, "-l", sel)["items"], 120,
             "the server's pods, Service and Ingress gone", interval=1)
    # the kubelet released the CPUs: back in the shared pool, the pod's cgroup gone
    wait_for(lambda: not (CGROUP / "cpuset" / "kubepods" / f"pod{pod['metadata']['uid']}").exists(), 60,
             "the pod's cgroup removed")
    wait_for(lambda: pod["metadata"]["uid"] not in json.loads((KUBELET_ROOT / "cpu_manager_state").read_text())
             .get("entries", {}), 60, "the CPU manager's checkpoint without the pod")


def test_helm_uninstall(node):
    run_helm(node, "uninstall", "cpuserve", "-n", "cpuserve-system", "--wait", "--timeout", "2m")
    wait_for(lambda: not node.get("pods", "-n", "cpuserve-system")["items"], 120, "the operator's pods gone")


def run_helm(node, *args):
    from cluster import run
    return run(node.assets / "helm", "--kubeconfig", node.admin, *args, timeout=300)

