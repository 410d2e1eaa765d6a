"""The images `make images` built, run for real under podman with runc:
- the amd64 engine serves /health, /v1/models and a streamed chat completion as its
  non-root user on a read-only root filesystem;
- the arm64 and s390x engines, under qemu-user, pass the kernel self-test of their own
  ISA (NEON, VXE) and give the amd64 image's 16 greedy tokens for three fixed completions;
- the operator image starts against a real kube-apiserver and answers its health probe.
Runs in the operator's virtualenv (no torch needed on the host: all of it is in the images)."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = next(line.split(":", 1)[1].strip().strip('"') for line in (ROOT / "charts/cpuserve/Chart.yaml").read_text()
               .splitlines() if line.startswith("appVersion:"))
RUN = ["podman", "--runtime", "runc", "run", "--rm", "--network=host", "--ulimit", "nofile=1024:1024",
       "--ulimit", "nproc=4096:4096"]
CHAT_PROMPT = "What is the capital of France?"
# the greedy parity runs: text for the model to go on with, not chat (the chat template's system
# prompt is 30 tokens a prompt, each about 0.27 GFLOP, which s390x's vector code under qemu runs
# at some 0.07 GFLOP/s; the template itself is Python, the same on every architecture)
COMPLETIONS = ["The capital of France is", "The three primary colors are", "The sea is"]
FOREIGN = {"arm64": ("neon_dotprod", "neon"), "s390x": ("vxe",)}  # the ISA tables each can pick


def image(name: str, arch: str) -> str:
    ref = f"localhost/cpuserve-{name}:{VERSION}-{arch}"
    if subprocess.run(["podman", "image", "exists", ref]).returncode != 0:
        pytest.fail(f"{ref} is not in local container storage: run `make images` first")
    return ref


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def wait_http(url: str, timeout: float, container: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if get(url)[0] == 200:
                return
        except OSError:
            pass
        state = subprocess.run(["podman", "inspect", "-f", "{{.State.Running}}", container], capture_output=True,
                               text=True).stdout.strip()
        if state != "true":
            break
        time.sleep(1)
    logs = subprocess.run(["podman", "logs", container], capture_output=True, text=True)
    pytest.fail(f"{url} did not answer within {timeout:.0f}s; container logs:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")


@pytest.fixture
def container():
    name = f"cpuserve-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["podman", "rm", "-f", "-t", "5", name], capture_output=True)


def cache_volume(arch: str) -> str:
    """A named volume per architecture for the engine's cache (the converted GGUF), kept
    between runs as a pod's cache volume would be."""
    return f"cpuserve-test-cache-{arch}:/var/cache/cpuserve"


def test_amd64_engine_serves_as_non_root_on_a_read_only_root(container):
    port = free_port()
    subprocess.run(RUN[:3] + ["run", "-d", "--rm", *RUN[5:], "--read-only", "--name", container,
                              "-v", cache_volume("amd64"), image("engine", "amd64"), "serve", "--port", str(port)],
                   check=True, capture_output=True)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", 300, container)
    models = json.loads(get(f"{base}/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": CHAT_PROMPT}],
                       "max_tokens": 16, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if
                   json.loads(e)["choices"])
    assert "Paris" in text
    body = json.dumps({"model": "smollm2", "prompt": "Is Paris in France? Answer:", "max_tokens": 4,
                       "temperature": 0, "guided_choice": [" yes", " no"]}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # structured output: the image carries its grammar engine
        assert json.loads(r.read())["choices"][0]["text"] in (" yes", " no")
    ps = subprocess.run(["podman", "exec", container, "sh", "-c",
                         "id -u; command -v gcc g++ cc cmake ninja || echo no-compiler; "
                         "touch /usr/x 2>&1 || echo read-only"], capture_output=True, text=True).stdout.split()
    assert ps[0] == "1000" and ps[1] == "no-compiler" and ps[-1] == "read-only"


@pytest.mark.parametrize("arch", ["amd64", "arm64", "s390x"])
def test_engine_image_labels(arch):
    out = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Labels}} {{.Architecture}}",
                          image("engine", arch)], capture_output=True, text=True, check=True).stdout
    labels, arch_field = json.loads(out.rsplit(" ", 1)[0]), out.rsplit(" ", 1)[1].strip()
    assert arch_field == arch == labels["io.cpuserve.architecture"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["io.cpuserve.isa-paths"] == {"amd64": "amx,avx512_bf16,avx512_vnni,avx512,avx2,scalar",
                                               "arm64": "neon_dotprod,neon,scalar",
                                               "s390x": "vxe,scalar"}[arch]
    assert labels["org.opencontainers.image.revision"] not in ("", "unknown")


def run_engine(arch: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(RUN + ["--read-only", "-v", cache_volume(arch), "--entrypoint", "cpuserve",
                                 image("engine", arch), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("arch", sorted(FOREIGN))
def test_foreign_engine_passes_its_isa_selftest(arch):
    r = run_engine(arch, "selftest", "--json", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["arch"] == {"arm64": "aarch64", "s390x": "s390x"}[arch]
    assert report["isas"][0] in FOREIGN[arch]  # qemu's default CPU has the dot product: neon_dotprod
    own = [c for c in report["checks"] if c["isa"] in FOREIGN[arch]]
    assert len(own) >= 11 and all(c["ok"] for c in own)
    assert {c["kernel"] for c in own} >= {"linear", "w8a8_linear", "paged_attention"}


def greedy(arch: str) -> list[list[int]]:
    args = ["generate", "--no-chat", "--max-tokens", "16", "--temperature", "0", "--json"]
    for p in COMPLETIONS:
        args += ["--prompt", p]
    r = run_engine(arch, *args, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [o["prompt"] for o in out] == COMPLETIONS
    return [o["token_ids"] for o in out]


@pytest.fixture(scope="module")
def amd64_tokens():
    tokens = greedy("amd64")
    assert all(len(t) == 16 for t in tokens)
    return tokens


@pytest.mark.parametrize("arch", sorted(FOREIGN))
def test_foreign_engine_gives_the_amd64_greedy_tokens(arch, amd64_tokens):
    assert greedy(arch) == amd64_tokens


def test_operator_image_answers_its_health_probe(container):
    from tests.operator.conftest import ASSETS, ControlPlane
    if not ASSETS or not Path(ASSETS, "kube-apiserver").exists():
        pytest.fail(f"envtest binaries missing in KUBEBUILDER_ASSETS={ASSETS!r}: run `make envtest`")
    cp = ControlPlane(Path(ASSETS), [ROOT / "crds" / "cpumodelserver.yaml"])
    try:
        os.chmod(cp.dir, 0o755)
        os.chmod(cp.kubeconfig, 0o644)
        port = free_port()
        subprocess.run(RUN[:3] + ["run", "-d", "--rm", *RUN[5:], "--read-only", "--name", container,
                                  "-v", f"{cp.kubeconfig}:/kubeconfig:ro", "-e", "KUBECONFIG=/kubeconfig",
                                  image("operator", "amd64"), "--standalone",
                                  f"--liveness=http://0.0.0.0:{port}/healthz"], check=True, capture_output=True)
        wait_http(f"http://127.0.0.1:{port}/healthz", 120, container)
        user = subprocess.run(["podman", "exec", container, "id", "-u"], capture_output=True, text=True).stdout
        assert user.strip() == "1000"
        has_torch = subprocess.run(["podman", "exec", container, "python3", "-c", "import torch"],
                                   capture_output=True)
        assert has_torch.returncode != 0
    finally:
        cp.stop()


def test_containerfiles_pass_hadolint():
    import sys
    hadolint = Path(sys.executable).parent / "hadolint"
    files = sorted(str(p) for p in (ROOT / "images").glob("*/Containerfile"))
    assert len(files) == 2
    r = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", *files],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


@pytest.mark.parametrize("arch, has", [("arm64", True), ("s390x", False)])
def test_foreign_engine_has_structured_output_where_a_wheel_exists(arch, has):
    """llguidance has wheels for amd64 and arm64 only: the s390x engine says so (its server
    answers constrained requests with that 400) rather than generate unconstrained text."""
    r = subprocess.run(RUN + ["--read-only", "--entrypoint", "python3", image("engine", arch), "-c",
                              "from cpuserve.structured import grammar as g; print(g.available()); "
                              "print(g.validate(g.GrammarSpec('regex', '[0-9]+')) or 'ok')"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    available, verdict = r.stdout.split("\n")[:2]
    assert available == str(has) and (verdict == "ok") == has, r.stdout
