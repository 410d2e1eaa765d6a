"""A real control plane on loopback for the operator tests, the envtest way:
etcd, kube-apiserver and kube-controller-manager (garbage collection, disruption budgets) from
KUBEBUILDER_ASSETS (`make envtest` builds them), a kubeconfig with an admin
token, and kubectl. No kubelets: the tests create Node objects with NUMA
topology and advance pod status themselves."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSETS = os.environ.get("KUBEBUILDER_ASSETS")
NEEDED = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
# the Prometheus Operator's ServiceMonitor CRD from its Go module (operator/hack/envtest/install.sh)
MONITOR_CRD = "crds/monitoring.coreos.com_servicemonitors-v0.85.0.yaml"


def pytest_collection_modifyitems(config, items):
    """Tests that need a control plane (the shared `cluster`, or the drills' own `plane`, which
    starts one with an audit log) are marked `cluster`: `make test-python` runs the others (-m
    "not cluster"), `make test-operator` all of them, so each runs once, after `make envtest`."""
    for item in items:
        if {"cluster", "plane"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: needs the envtest control plane (KUBEBUILDER_ASSETS)")


def pytest_report_header(config):
    if ASSETS and Path(ASSETS, "kube-apiserver").exists():
        out = subprocess.run([str(Path(ASSETS, "kube-apiserver")), "--version"], capture_output=True, text=True)
        return f"envtest: {out.stdout.strip()} from KUBEBUILDER_ASSETS={ASSETS}"
    return "envtest: KUBEBUILDER_ASSETS not set (run `make test-operator`)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except RuntimeError:
            raise
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s (last error: {last})")


class ControlPlane:
    """`apiserver_args` are added to kube-apiserver's; each of `users` gets a token of its own
    (in system:masters) and a kubeconfig (`kubeconfig_for`), so that its requests can be told
    apart, e.g. in an audit log."""

    def __init__(self, assets: Path, crds: list[Path] = (), apiserver_args: list[str] = (), users: tuple = ()):
        self.assets = assets
        self.dir = Path(tempfile.mkdtemp(prefix="cpuserve-envtest-"))
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}
        token = os.urandom(16).hex()
        self.tokens = {"admin": token, **{u: os.urandom(16).hex() for u in users}}
        (self.dir / "tokens.csv").write_text("".join(f'{t},{u},{u},"system:masters"\n' for u, t in self.tokens.items()))
        subprocess.run(["openssl", "genrsa", "-out", str(self.dir / "sa.key"), "2048"], check=True,
                       capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(self.dir / "sa.key"), "-pubout", "-out",
                        str(self.dir / "sa.pub")], check=True, capture_output=True)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.start("etcd", [str(assets / "etcd"), "--data-dir", str(self.dir / "etcd"),
                            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
                            "--unsafe-no-fsync"])
        self.etcd = f"http://127.0.0.1:{etcd_port}"
        self.start("kube-apiserver", [
            str(assets / "kube-apiserver"), "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", "127.0.0.1", "--secure-port", str(api_port), "--cert-dir", str(self.dir / "certs"),
            "--token-auth-file", str(self.dir / "tokens.csv"), "--authorization-mode", "RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(self.dir / "sa.pub"),
            "--service-account-signing-key-file", str(self.dir / "sa.key"),
            "--service-cluster-ip-range", "10.96.0.0/16", "--disable-admission-plugins", "ServiceAccount",
            "--allow-privileged=true", *apiserver_args])
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig = self.kubeconfig_for("admin")
        self.wait_apiserver()
        # CRDs before the controller manager: its garbage collector then watches them from its
        # first discovery instead of picking them up on a later resync.
        for crd in crds:
            self.kubectl("apply", "-f", str(crd))
            self.kubectl("wait", "--for=condition=Established", "-f", str(crd), "--timeout=60s")
        self.start("kube-controller-manager", [
            str(assets / "kube-controller-manager"), "--kubeconfig", str(self.kubeconfig),
            "--authentication-kubeconfig", str(self.kubeconfig), "--authorization-kubeconfig", str(self.kubeconfig),
            "--controllers", "garbagecollector,namespace,serviceaccount-token,disruption",
            "--service-account-private-key-file", str(self.dir / "sa.key"), "--leader-elect=false",
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port())])
        self.version = json.loads(self.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]

    def kubeconfig_for(self, user: str) -> Path:
        path = self.dir / ("kubeconfig" if user == "admin" else f"kubeconfig-{user}")
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "envtest",
            "clusters": [{"name": "envtest", "cluster": {"server": self.server, "insecure-skip-tls-verify": True}}],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": user,
                                                        "namespace": "default"}}]}))
        return path

    def wait_apiserver(self) -> None:
        self.wait_ready(lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
                        "kube-apiserver ready")

    def restart_apiserver(self, down_s: float) -> None:
        """Stops kube-apiserver, keeps it down for about `down_s` seconds (at least its shutdown),
        starts it again as it was."""
        names = list(self.logs)
        i = names.index("kube-apiserver")
        old = self.procs[i]
        t0 = time.monotonic()
        old.terminate()
        try:
            old.wait(10)  # (it drains long-running requests first: watches hold it past its port's close)
        except subprocess.TimeoutExpired:
            old.kill()
            old.wait()
        time.sleep(max(0.0, down_s - (time.monotonic() - t0)))
        with self.logs["kube-apiserver"].open("a") as log:
            self.procs[i] = subprocess.Popen(old.args, stdout=log, stderr=subprocess.STDOUT)
        self.wait_apiserver()

    def wait_ready(self, check, what: str, timeout: float = 180) -> None:
        def alive_and(check=check):
            for name, p in zip(self.logs, self.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.tail(name)}")
            return check()
        try:
            wait_for(alive_and, timeout, what)
        except (TimeoutError, RuntimeError) as e:
            self.stop(keep=True)
            raise RuntimeError(f"{e}\n--- kube-apiserver log:\n{self.tail('kube-apiserver')}") from None

    def tail(self, name: str, n: int = 30) -> str:
        lines = self.logs[name].read_text(errors="replace").splitlines()
        return "\n".join(ln[:300] for ln in lines[-n:])

    def start(self, name: str, cmd: list[str]) -> None:
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        self.procs.append(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([str(self.assets / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
                           input=input, capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr}")
        return r

    def get(self, *args: str):
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def stop(self, keep: bool = False) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    if not ASSETS or not all(Path(ASSETS, b).exists() for b in (*NEEDED, MONITOR_CRD)):
        msg = f"envtest binaries missing in KUBEBUILDER_ASSETS={ASSETS!r}: run `make test-operator` (or `make envtest`)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    cp = ControlPlane(Path(ASSETS), [ROOT / "crds" / "cpumodelserver.yaml", Path(ASSETS, MONITOR_CRD)])
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def operator(cluster):
    """One standalone operator for the namespace `default`, resyncing every second, with an
    8 s grace for NotReady nodes (300 s in production) and its metrics on `proc.metrics`."""
    log = open(cluster.dir / "operator.log", "w")
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), CPUSERVE_OPERATOR_RESYNC="1",
               CPUSERVE_NODE_LOST_GRACE="8")
    metrics = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cpuserve_operator.main", "--standalone", "--namespace", "default",
                             "--liveness", f"http://127.0.0.1:{free_port()}/healthz", "--metrics-port", str(metrics)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.metrics = f"http://127.0.0.1:{metrics}/metrics"
    yield proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    text = (cluster.dir / "operator.log").read_text()
    (cluster.dir.parent / "cpuserve-operator-test.log").write_text(text)  # kept for a failed run
    print(text[-5000:])
