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
    assert kinds.count("CustomResourceDefinition") == 3 and "DaemonSet" in kinds and "Deployment" in kinds
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=ml" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "cpuserve.dev")
    assert crd == yaml.safe_load((ROOT / "crds" / "cpumodelserver.yaml").read_text())  # one source of truth
    cluster.kubectl("create", "namespace", "cpuserve-system", check=False)
    r = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=rendered, check=False)
    assert r.returncode == 0, r.stderr
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "cpuserve-operator")
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}
    for need in [("cpuserve.dev", "cpumodelservers/status", "patch"), ("", "pods", "create"), ("", "pods", "delete"),
                 ("", "services", "create"), ("networking.k8s.io", "ingresses", "delete"), ("", "nodes", "watch")]:
        assert need in granted
    assert not any("*" in (g, res, v) for g, res, v in granted)  # nothing wildcard
