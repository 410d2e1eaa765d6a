"""The CRD on a real API server: defaults, printer columns, the scale
subresource, and invalid CRs refused by the server with a clear message."""
import json

import pytest

CR = """
apiVersion: cpuserve.dev/v1alpha1
kind: CPUModelServer
metadata: {name: %(name)s}
spec:
  model: {source: "packaged://smollm2", servedName: smollm2}
%(extra)s
"""


def apply(cluster, name, extra="", check=True):
    return cluster.kubectl("apply", "-f", "-", input=CR % {"name": name, "extra": extra}, check=check)


def test_defaults_columns_and_scale(cluster):
    apply(cluster, "crd-defaults")
    obj = cluster.get("cms", "crd-defaults")
    spec = obj["spec"]
    assert spec["replicas"] == 1 and spec["engine"]["dtype"] == "auto" and "kvCacheGiB" not in spec["engine"]
    assert spec["placement"] == {"strategy": "PerNUMANode", "tensorParallelSize": 1, "reservedCPUs": 1,
                                 "pinning": "Kubelet", "requiredISA": []}
    assert spec["seccompProfile"] == {"type": "RuntimeDefault"} and spec["service"]["port"] == 8000
    table = cluster.kubectl("get", "cms", "crd-defaults").stdout.splitlines()[0].split()
    assert table == ["NAME", "MODEL", "PHASE", "READY", "ENDPOINT", "AGE"]
    cluster.kubectl("scale", "cms/crd-defaults", "--replicas=3")
    assert cluster.get("cms", "crd-defaults")["spec"]["replicas"] == 3
    cluster.kubectl("delete", "cms", "crd-defaults")


def test_the_api_key_secrets_key_defaults(cluster):
    apply(cluster, "crd-key", "  service: {apiKeySecret: {name: llm-key}}")
    assert cluster.get("cms", "crd-key")["spec"]["service"]["apiKeySecret"] == {"name": "llm-key", "key": "api-key"}
    cluster.kubectl("delete", "cms", "crd-key")


@pytest.mark.parametrize("extra,message", [
    ("  placement: {tensorParallelSize: 2}", "needs placement.strategy TensorParallel"),
    ("  placement: {strategy: TensorParallel}", "needs placement.tensorParallelSize >= 2"),
    ("  placement: {pinning: Engine, reservedCPUs: 0}", "pinning Engine needs placement.reservedCPUs >= 1"),
    ("  seccompProfile: {type: Localhost}", "localhostProfile is required with type Localhost"),
    ("  ingress: {enabled: true, tls: true}", "ingress.tls needs ingress.host"),
    ("  replicas: -1", "spec.replicas"),
    ("  engine: {dtype: int4}", "Unsupported value: \"int4\""),
    ("  placement: {strategy: Sideways}", "Unsupported value: \"Sideways\""),
    ("  placement: {tolerations: [{key: k, operator: Exists, value: v}]}", "a toleration with operator Exists takes no value"),
    ("  placement: {tolerations: [{value: v}]}", "a toleration with an empty key needs operator Exists"),
    ("  placement: {tolerations: [{key: k, effect: Sometimes}]}", "Unsupported value: \"Sometimes\""),
    ("  service: {apiKeySecret: {key: token}}", "spec.service.apiKeySecret.name: Required value"),
    ("  ingress: {enabled: true, path: llm}", "spec.ingress.path"),
])
def test_invalid_crs_are_refused_by_the_api_server(cluster, extra, message):
    r = apply(cluster, "crd-invalid", extra, check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["Upper", "9lives", "has.dot", "x" * 53])
def test_names_that_cannot_name_a_service_are_refused(cluster, name):
    r = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": name},
        "spec": {"model": {"source": "packaged://smollm2"}}}))
    assert r.returncode != 0 and "DNS-1035 label of at most 52" in r.stderr, r.stderr


def test_unknown_packaged_model_refused(cluster):
    r = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "crd-pkg"},
        "spec": {"model": {"source": "packaged://llama-70b"}}}))
    assert r.returncode != 0 and "packages one model: packaged://smollm2" in r.stderr, r.stderr


def test_model_path_only_for_images(cluster):
    r = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "crd-path"},
        "spec": {"model": {"source": "pvc://c/m", "path": "x"}}}))
    assert r.returncode != 0 and "model.path is for image:// sources" in r.stderr, r.stderr


def test_downloaded_models_need_a_checksum(cluster):
    def apply_model(model):
        return cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
            "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "crd-sha"},
            "spec": {"model": model}}))
    r = apply_model({"source": "https://models.example.com/m.gguf"})
    assert r.returncode != 0 and "need model.sha256" in r.stderr, r.stderr
    r = apply_model({"source": "pvc://c/m", "sha256": "ab" * 32})
    assert r.returncode != 0 and "model.sha256 is for http(s)://" in r.stderr, r.stderr
    r = apply_model({"source": "s3://bucket/m.gguf", "sha256": "ab" * 32})
    assert r.returncode == 0, r.stderr
    cluster.kubectl("delete", "cms", "crd-sha")


def test_bad_model_source_refused(cluster):
    r = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
        "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "crd-src"},
        "spec": {"model": {"source": "ftp://host/model"}}}))
    assert r.returncode != 0 and "spec.model.source" in r.stderr


def test_lora_adapters_are_checked_by_the_api_server(cluster):
    def apply_adapters(adapters):
        return cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
            "apiVersion": "cpuserve.dev/v1alpha1", "kind": "CPUModelServer", "metadata": {"name": "crd-lora"},
            "spec": {"model": {"source": "packaged://smollm2", "servedName": "base", "loraAdapters": adapters}}}))
    r = apply_adapters([{"name": "base", "source": "image://r/a:1"}])
    assert r.returncode != 0 and "must differ from model.servedName" in r.stderr, r.stderr
    r = apply_adapters([{"name": "a", "source": "file:///opt/a", "path": "x"}])
    assert r.returncode != 0 and "loraAdapters[].path is for image:// sources" in r.stderr, r.stderr
    r = apply_adapters([{"name": "a", "source": "pvc://c/a"}])
    assert r.returncode != 0 and "spec.model.loraAdapters[0].source" in r.stderr, r.stderr
    r = apply_adapters([{"name": "a", "source": "image://r/a:1"}, {"name": "a", "source": "image://r/b:1"}])
    assert r.returncode != 0 and "Duplicate value" in r.stderr, r.stderr
    assert apply_adapters([{"name": "a", "source": "image://r/a:1", "path": "lora"}]).returncode == 0
    cluster.kubectl("delete", "cms", "crd-lora")

