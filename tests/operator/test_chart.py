"""The Helm chart: lints, renders, and every rendered object passes the real API
server's strict server-side validation; its RBAC lists what the reconciler uses."""
import subprocess
from pathlib import Path

import yaml

from conftest import ASSETS, ROOT

CHART = ROOT / "charts" / "cpuserve"


def helm(*args):
    r = subprocess.run([str(Path(ASSETS) / "helm"), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_chart_renders_and_validates(cluster):
    helm("lint", str(CHART))
    rendered = helm("template", "cpuserve", str(CHART), "--namespace", "cpuserve-system", "--include-crds",
                    "--set", "operator.watchNamespaces={ml,prod}")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 1 and "DaemonSet" in kinds and "Deployment" in kinds
    lease = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "cpuserve-operator-lease")
    assert {"get", "update"} <= {v for r in lease["rules"] if r.get("resourceNames") == ["cpuserve-operator"]
                                 for v in r["verbs"]}
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=ml" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    # one multi-arch name per image, tagged with the chart's appVersion unless values say otherwise
    app = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    op = deploy["spec"]["template"]["spec"]["containers"][0]
    assert op["image"] == f"ghcr.io/cpuserve/cpuserve-operator:{app}"
    env = {e["name"]: e.get("value") for e in op["env"]}
    assert env["CPUSERVE_ENGINE_IMAGE"] == f"ghcr.io/cpuserve/cpuserve-engine:{app}"
    custom = [d for d in yaml.safe_load_all(helm(
        "template", "cpuserve", str(CHART), "--set", "imagePullSecrets[0].name=regcred",
        "--set", "engine.image.repository=reg.example/cpuserve-engine", "--set", "engine.image.tag=dev")) if d]
    for d in custom:
        if d["kind"] in ("Deployment", "DaemonSet"):
            assert d["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    op = next(d for d in custom if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "CPUSERVE_ENGINE_IMAGE", "value": "reg.example/cpuserve-engine:dev"} in op["env"]
    with_config = helm("template", "cpuserve", str(CHART), "--namespace", "cpuserve-system", "--set-json",
                       'nodeAgent.kubeletConfig=[{"path": "/var/lib/kubelet/config.yaml"}, '
                       '{"path": "/etc/kubernetes/kubelet.conf.d", "type": "Directory"}]')
    ds = next(d for d in yaml.safe_load_all(with_config) if d and d["kind"] == "DaemonSet")
    agent = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "assignments")
    assert agent["args"][-2:] == ["--kubelet-config=/kubelet-config/0", "--kubelet-config=/kubelet-config/1"]
    host = {v["name"]: v["hostPath"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    assert host["kubelet-config-0"] == {"path": "/var/lib/kubelet/config.yaml", "type": "File"}
    assert host["kubelet-config-1"]["type"] == "Directory"
    cluster.kubectl("create", "namespace", "cpuserve-system", check=False)
    r = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=with_config, check=False)
    assert r.returncode == 0, r.stderr
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "cpuserve.dev")
    assert crd == yaml.safe_load((ROOT / "crds" / "cpumodelserver.yaml").read_text())  # one source of truth
    cluster.kubectl("create", "namespace", "cpuserve-system", check=False)
    r = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=rendered, check=False)
    assert r.returncode == 0, r.stderr
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "cpuserve-operator")
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}
    for need in [("cpuserve.dev", "cpumodelservers/status", "patch"), ("", "pods", "create"), ("", "pods", "delete"),
                 ("", "services", "create"), ("networking.k8s.io", "ingresses", "delete"), ("", "nodes", "watch"),
                 ("policy", "poddisruptionbudgets", "create")]:
        assert need in granted
    assert not any("*" in (g, res, v) for g, res, v in granted)  # nothing wildcard


def test_operator_works_with_the_charts_rbac(cluster):
    """The operator, authenticated as the chart's ServiceAccount (its ClusterRole, and its
    Role for the leader Lease), wins the election and reconciles a server: the RBAC the chart
    lists is enough."""
    import json
    import os
    import sys

    from conftest import free_port, wait_for

    rendered = helm("template", "cpuserve", str(CHART), "--namespace", "cpuserve-system")
    rbac = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in
            ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    cluster.kubectl("create", "namespace", "cpuserve-system", check=False)
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in rbac))
    token = cluster.kubectl("create", "token", "cpuserve-operator", "-n", "cpuserve-system").stdout.strip()
    kubeconfig = cluster.dir / "operator-sa.kubeconfig"
    cfg = json.loads(cluster.kubeconfig.read_text())
    cfg["users"] = [{"name": "admin", "user": {"token": token}}]
    kubeconfig.write_text(json.dumps(cfg))
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "rbac-node", "annotations": {
            "cpuserve.dev/topology": json.dumps({"numaNodes": [{"id": 0, "cpus": "0-7", "memory": 32 << 30}]})}}}))
    cluster.kubectl("patch", "node", "rbac-node", "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
    log = open(cluster.dir / "operator-sa.log", "w")
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), POD_NAME="op-0", POD_NAMESPACE="cpuserve-system",
               CPUSERVE_OPERATOR_LEASE="cpuserve-operator")
    proc = subprocess.Popen([sys.executable, "-m", "cpuserve_operator.main", "--namespace", "rbac",
                             "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
                             "--metrics-port", str(free_port())], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        cluster.kubectl("create", "namespace", "rbac", check=False)
        cluster.kubectl("apply", "-n", "rbac", "-f", "-", input=json.dumps({
            "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "sa"},
            "spec": {"model": {"source": "packaged://smollm2"}, "engine": {"kvCacheGiB": 1},
                     "monitoring": {"serviceMonitor": {"enabled": True}}}}))
        wait_for(lambda: cluster.get("pods", "-n", "rbac", "-l", "cpuserve.dev/server=sa")["items"], 60, "pod")
        wait_for(lambda: cluster.get("cms", "-n", "rbac", "sa").get("status", {}).get("phase") == "Loading", 60,
                 "status written")
        assert cluster.get("svc", "-n", "rbac", "sa")["spec"]["ports"][0]["port"] == 8000
        wait_for(lambda: cluster.get("pdb", "-n", "rbac", "sa"), 30, "pod disruption budget")
        wait_for(lambda: cluster.get("servicemonitors.monitoring.coreos.com", "-n", "rbac", "sa"), 30, "monitor")
        assert cluster.get("lease", "-n", "cpuserve-system", "cpuserve-operator")["spec"]["holderIdentity"] == "op-0"
        assert any(e["reason"] == "Placed" for e in cluster.get("events", "-n", "rbac")["items"])
        text = (cluster.dir / "operator-sa.log").read_text()
        assert "Forbidden" not in text and "forbidden" not in text, text[-3000:]
    finally:
        proc.terminate()
        proc.wait(20)
        cluster.kubectl("delete", "namespace", "rbac", "--wait=false", check=False)
        cluster.kubectl("delete", "node", "rbac-node", check=False)


def test_node_agent_may_change_only_its_own_node(cluster):
    """The chart's ValidatingAdmissionPolicy, enforced by the real API server on a token bound
    to an agent pod on node agent-a: node agent-a and its pods may be patched, agent-b and its
    pods may not, and an unbound token may patch nothing."""
    import json
    import time

    rendered = [d for d in yaml.safe_load_all(helm("template", "cpuserve", str(CHART), "--namespace",
                                                   "cpuserve-system")) if d]
    kinds = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
             "ValidatingAdmissionPolicyBinding")
    cluster.kubectl("create", "namespace", "cpuserve-system", check=False)
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in rendered if d["kind"] in kinds))
    for n in ("agent-a", "agent-b"):
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}))
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"engine-{n}", "namespace": "default",
                                                            "labels": {"cpuserve.dev/server": "x"}},
            "spec": {"nodeName": n, "containers": [{"name": "engine", "image": "x"}]}}))
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent-pod", "namespace": "cpuserve-system"},
        "spec": {"nodeName": "agent-a", "serviceAccountName": "cpuserve-node-agent",
                 "containers": [{"name": "agent", "image": "x"}]}}))

    def as_agent(bound: bool, *args):
        extra = ["--bound-object-kind", "Pod", "--bound-object-name", "agent-pod"] if bound else []
        token = cluster.kubectl("create", "token", "cpuserve-node-agent", "-n", "cpuserve-system", *extra).stdout.strip()
        return cluster.kubectl("--token", token, *args, check=False)

    def patch(bound, *target):
        return as_agent(bound, "patch", *target, "--type=merge", "-p",
                        '{"metadata":{"annotations":{"cpuserve.dev/test":"1"}}}')

    # the policy takes a moment to be loaded by the API server
    deadline = time.monotonic() + 30
    while patch(True, "node", "agent-b").returncode == 0 and time.monotonic() < deadline:
        time.sleep(1)
    assert patch(True, "node", "agent-a").returncode == 0
    r = patch(True, "node", "agent-b")
    assert r.returncode != 0 and "node agent-a may change only that node and its pods" in r.stderr, r.stderr
    assert patch(True, "pod", "-n", "default", "engine-agent-a").returncode == 0
    assert patch(True, "pod", "-n", "default", "engine-agent-b").returncode != 0
    r = patch(False, "node", "agent-a")
    assert r.returncode != 0 and "unknown node" in r.stderr, r.stderr
    for n in ("agent-a", "agent-b"):
        cluster.kubectl("delete", "pod", "-n", "default", f"engine-{n}", "--grace-period=0", "--force", check=False)
        cluster.kubectl("delete", "node", n, check=False)
    cluster.kubectl("delete", "pod", "-n", "cpuserve-system", "agent-pod", "--grace-period=0", "--force", check=False)
