"""A one-node Kubernetes cluster on this machine for `make e2e`: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler (the envtest binaries, KUBEBUILDER_ASSETS),
containerd 2 with runc and Debian's CNI plugins, the kubelet with cpuserve's drop-in
(charts/cpuserve/files/kubelet/10-cpuserve.conf, verbatim) and kube-proxy, all from
binaries built here (hack/e2e/install.sh). Nothing is pulled: the images come from the
OCI archives `make images` writes.

The control plane and the pods meet on one bridge that exists only on this machine
(BRIDGE, NODE_IP): the API server listens there, not on an outside interface. Config
files are pure functions of paths and addresses; `Cluster` starts and stops processes,
and `Cluster.stop` undoes everything `start` did (containers, mounts, cgroups, network),
keeping the logs under STATE for the failure message."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CPUSERVE_E2E_CACHE", Path.home() / ".cache" / "cpuserve-e2e"))
STATE = CACHE / "run"                    # this run's certificates, configs, logs
KUBELET_ROOT = Path("/var/lib/kubelet")  # the default: the chart installs seccomp profiles under it
DROP_IN = ROOT / "charts" / "cpuserve" / "files" / "kubelet" / "10-cpuserve.conf"
BRIDGE, NODE_IP, POD_CIDR = "cpuserve0", "10.244.0.1", "10.244.0.0/24"
SERVICE_CIDR, API_SERVICE_IP = "10.96.0.0/16", "10.96.0.1"
NODE_NAME = "cpuserve-e2e"
API_PORT = 6443
CGROUP = Path("/sys/fs/cgroup")


# -- configuration (pure) ----------------------------------------------------------------------
def kubeconfig(server: str, ca: Path, user: str, token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "e2e",
            "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user, "namespace": "default"}}]}


def kubelet_config(ca: Path, containerd_sock: Path, resolv: Path) -> dict:
    """What is particular to this machine; the product's settings are the drop-in."""
    return {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",   # no systemd here
            "failCgroupV1": False,        # this kernel mounts cgroup v1 (README, "Deploy on Kubernetes")
            "containerRuntimeEndpoint": f"unix://{containerd_sock}",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(ca)}},
            "authorization": {"mode": "Webhook"},
            "address": NODE_IP, "healthzBindAddress": "127.0.0.1", "readOnlyPort": 0,
            "resolvConf": str(resolv), "clusterDomain": "cluster.local",
            "failSwapOn": False, "serializeImagePulls": False,
            # a shared test machine's disk may be 85% full: the default imagefs threshold (15%)
            # would evict every pod. Maps merge key by key with the drop-in's memory.available.
            "evictionHard": {"nodefs.available": "2Gi", "imagefs.available": "2Gi", "nodefs.inodesFree": "1%",
                             "imagefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,  # never evict the imported images
            "evictionPressureTransitionPeriod": "30s", "syncFrequency": "10s",
            "fileCheckFrequency": "5s", "nodeStatusUpdateFrequency": "5s"}


def containerd_config(root: Path, state: Path, sock: Path, cni_conf: Path, sandbox_image: str, runc: Path,
                      restrict_oom: bool) -> str:
    return f"""version = 3
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{sandbox_image}"
[plugins."io.containerd.cri.v1.runtime"]
  enable_selinux = false
  # Root here lacks CAP_SYS_RESOURCE, so a negative oom_score_adj (the kubelet asks -998 for
  # sandboxes, -997 for Guaranteed containers) is refused; clamp to containerd's own (0).
  restrict_oom_score_adj = {str(restrict_oom).lower()}
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni_conf}"
"""


def cni_config(ipam_dir: Path) -> dict:
    """Debian's bridge + host-local plugins on the pre-made bridge; no masquerade (nothing
    leaves this machine), hairpin so that a pod reaches itself through its Service."""
    return {"cniVersion": "1.0.0", "name": "cpuserve-e2e", "plugins": [
        {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(ipam_dir), "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"}]}


def kube_proxy_config(kubeconfig_path: Path) -> dict:
    return {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "mode": "iptables", "clientConnection": {"kubeconfig": str(kubeconfig_path)},
            "clusterCIDR": POD_CIDR, "bindAddress": NODE_IP, "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "conntrack": {"maxPerCore": 0},  # leave the host's conntrack table size alone
            "hostnameOverride": NODE_NAME}


def can_lower_oom_score() -> bool:
    """Whether this process may set a negative oom_score_adj (CAP_SYS_RESOURCE, bit 24)."""
    caps = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> 24 & 1)


def iptables_cleanup(save: str) -> list[list[str]]:
    """Arguments (after `iptables`) that remove the KUBE-* chains of an `iptables-save` dump
    and the rules jumping to them: what the kubelet and kube-proxy leave behind."""
    cmds, chains, table = [], [], ""
    for line in save.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":KUBE-"):
            chains.append((table, line[1:].split()[0]))
        elif line.startswith("-A ") and not line.split()[1].startswith("KUBE-") and " -j KUBE-" in line:
            cmds.append(["-t", table, "-D", *shlex.split(line)[1:]])
    return cmds + [["-t", t, "-F", c] for t, c in chains] + [["-t", t, "-X", c] for t, c in chains]


# -- processes and the host (a thin shell) ----------------------------------------------------
def run(*cmd, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r


def wait_for(check, timeout: float, what: str, interval: float = 0.5, alive=lambda: None):
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        alive()
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s (last error: {last})")


def make_pki(d: Path) -> None:
    """A cluster CA, the API server's serving certificate (every name pods and the host use)
    and its client certificate towards the kubelet."""
    d.mkdir(parents=True, exist_ok=True)
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", d / "ca.key", "-out", d / "ca.crt",
        "-days", "2", "-subj", "/CN=cpuserve-e2e-ca")
    sans = ",".join([f"IP:{API_SERVICE_IP}", f"IP:{NODE_IP}", "IP:127.0.0.1", "DNS:localhost", "DNS:kubernetes",
                     "DNS:kubernetes.default", "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"])
    for name, subj, ext in (("apiserver", "/CN=kube-apiserver", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth"),
                            ("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
                             "extendedKeyUsage=clientAuth")):
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr",
            "-subj", subj)
        (d / f"{name}.ext").write_text(ext + "\n")
        run("openssl", "x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", d / f"{name}.ext", "-out", d / f"{name}.crt")
    run("openssl", "genrsa", "-out", d / "sa.key", "2048")
    run("openssl", "rsa", "-in", d / "sa.key", "-pubout", "-out", d / "sa.pub")


class Cluster:
    """start() brings the node up; stop() takes everything down again, also after a failed start."""

    def __init__(self, assets: Path, node_bin: Path, images: list[Path], state: Path = STATE):
        self.assets, self.bin, self.images, self.dir = assets, node_bin, images, state
        self.logs = state / "logs"
        self.procs: dict[str, subprocess.Popen] = {}
        self.server = f"https://{NODE_IP}:{API_PORT}"
        self.ctrd_sock = Path("/run/cpuserve-e2e/containerd/containerd.sock")
        self.admin = state / "admin.kubeconfig"
        self.made_kubelet_root = False
        self.started_proxy = False
        self.made_cni_dir = False
        self.preexisting: set[str] = set()

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        self.preflight()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self.host_network()
        self.control_plane()
        self.containerd()
        self.kubelet()
        self.start_proc("kube-proxy", [self.bin / "kube-proxy", "--config", self.write("kube-proxy.yaml",
                        kube_proxy_config(self.kubeconfig_for("kube-proxy", "system:kube-proxy")))])
        wait_for(lambda: run("curl", "-sf", "http://127.0.0.1:10256/healthz", check=False).returncode == 0,
                 60, "kube-proxy healthy", alive=self.alive)

    def preflight(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("make e2e runs a kubelet and a container runtime: it needs root")
        if run("pgrep", "-x", "kubelet", check=False).returncode == 0:
            raise RuntimeError("a kubelet is already running on this machine; make e2e needs the node to itself")
        missing = [p for p in [*(self.assets / b for b in ("etcd", "kube-apiserver", "kube-controller-manager",
                                                           "kubectl", "helm")),
                               *(self.bin / b for b in ("kubelet", "kube-proxy", "kube-scheduler", "containerd")),
                               *self.images] if not p.exists()]
        if missing:
            raise RuntimeError(f"missing {', '.join(map(str, missing))}: run `make e2e` (it builds them)")
        self.preexisting = self.our_processes()
        self.made_kubelet_root = not KUBELET_ROOT.exists()
        self.had_netns_mount = self.mounted("/run/netns")
        self.made_cni_dir = not Path("/var/lib/cni").exists()
        if "KUBE-" in run("iptables-save", check=False).stdout:
            raise RuntimeError("iptables has KUBE-* chains already (another kubelet or kube-proxy, or a run "
                               "stopped with kill -9): remove them, or run make e2e on a clean node")

    def host_network(self) -> None:
        run("mount", "--make-rshared", "/")
        for key in ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables"):
            Path("/proc/sys", key).write_text("1\n")
        if run("ip", "link", "show", BRIDGE, check=False).returncode:
            run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "replace", f"{NODE_IP}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")

    def control_plane(self) -> None:
        pki = self.dir / "pki"
        make_pki(pki)
        self.tokens = {u: os.urandom(16).hex() for u in ("admin", "system:kube-controller-manager",
                                                            "system:kube-scheduler", "system:kube-proxy",
                                                            f"system:node:{NODE_NAME}")}
        groups = {"admin": "system:masters", f"system:node:{NODE_NAME}": "system:nodes"}
        (pki / "tokens.csv").write_text("".join(f'{t},{u},{u},"{groups.get(u, "")}"\n' for u, t in self.tokens.items()))
        self.start_proc("etcd", [self.assets / "etcd", "--data-dir", self.dir / "etcd", "--unsafe-no-fsync",
                                 "--listen-client-urls", "http://127.0.0.1:23790",
                                 "--advertise-client-urls", "http://127.0.0.1:23790",
                                 "--listen-peer-urls", "http://127.0.0.1:23800",
                                 "--initial-advertise-peer-urls", "http://127.0.0.1:23800",
                                 "--initial-cluster", "default=http://127.0.0.1:23800"])
        self.start_proc("kube-apiserver", [
            self.assets / "kube-apiserver", "--etcd-servers", "http://127.0.0.1:23790",
            "--bind-address", NODE_IP, "--advertise-address", NODE_IP, "--secure-port", API_PORT,
            "--tls-cert-file", pki / "apiserver.crt", "--tls-private-key-file", pki / "apiserver.key",
            "--client-ca-file", pki / "ca.crt", "--token-auth-file", pki / "tokens.csv",
            "--kubelet-client-certificate", pki / "apiserver-kubelet-client.crt",
            "--kubelet-client-key", pki / "apiserver-kubelet-client.key",
            "--kubelet-preferred-address-types", "InternalIP",
            "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", pki / "sa.pub", "--service-account-signing-key-file", pki / "sa.key",
            "--service-cluster-ip-range", SERVICE_CIDR, "--allow-privileged=true"])
        self.admin.write_text(json.dumps(kubeconfig(self.server, pki / "ca.crt", "admin", self.tokens["admin"])))
        wait_for(lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, 120,
                 "kube-apiserver ready", alive=self.alive)
        kcm = self.kubeconfig_for("kube-controller-manager", "system:kube-controller-manager")
        self.start_proc("kube-controller-manager", [
            self.assets / "kube-controller-manager", "--kubeconfig", kcm, "--authentication-kubeconfig", kcm,
            "--authorization-kubeconfig", kcm, "--leader-elect=false", "--bind-address", "127.0.0.1",
            "--secure-port", "10257", "--root-ca-file", pki / "ca.crt", "--use-service-account-credentials",
            "--service-account-private-key-file", pki / "sa.key", "--service-cluster-ip-range", SERVICE_CIDR,
            "--node-monitor-grace-period", "40s"])
        sched = self.kubeconfig_for("kube-scheduler", "system:kube-scheduler")
        self.start_proc("kube-scheduler", [
            self.bin / "kube-scheduler", "--kubeconfig", sched, "--authentication-kubeconfig", sched,
            "--authorization-kubeconfig", sched, "--leader-elect=false", "--bind-address", "127.0.0.1",
            "--secure-port", "10259"])

    def containerd(self) -> None:
        d = self.dir / "containerd"
        (self.dir / "cni").mkdir()
        (self.dir / "cni" / "10-cpuserve-e2e.conflist").write_text(json.dumps(cni_config(self.dir / "ipam")))
        # the content store and snapshots survive runs (CACHE/containerd): an image is unpacked once
        cfg = containerd_config(CACHE / "containerd", self.ctrd_sock.parent / "state", self.ctrd_sock,
                                self.dir / "cni", "localhost/cpuserve-pause:3.10", self.bin / "runc",
                                not can_lower_oom_score())
        d.mkdir()
        (d / "config.toml").write_text(cfg)
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}"}  # the shim next to containerd
        self.start_proc("containerd", [self.bin / "containerd", "--config", d / "config.toml"], env=env)
        wait_for(lambda: self.ctr("version", check=False).returncode == 0, 60, "containerd up", alive=self.alive)
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
        for archive in self.images:  # this machine's platform, unpacked into the CRI's snapshotter
            self.ctr("images", "import", "--platform", f"linux/{arch}", "--snapshotter", "overlayfs", archive)

    def kubelet(self) -> None:
        cfg = self.write("kubelet.yaml", kubelet_config(self.dir / "pki" / "ca.crt", self.ctrd_sock,
                                                         self.resolv_conf()))
        drop_in = self.dir / "kubelet.conf.d"
        drop_in.mkdir()
        shutil.copy(DROP_IN, drop_in / DROP_IN.name)
        kc = self.kubeconfig_for("kubelet", f"system:node:{NODE_NAME}")
        self.start_proc("kubelet", [self.bin / "kubelet", "--config", cfg, "--config-dir", drop_in,
                                    "--kubeconfig", kc, "--hostname-override", NODE_NAME, "--node-ip", NODE_IP,
                                    "--root-dir", KUBELET_ROOT, "--v", "2"])
        wait_for(lambda: self.node_ready(), 180, f"node {NODE_NAME} Ready", interval=1, alive=self.alive)

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Everything start() made, in reverse; each step runs even when an earlier one failed."""
        steps = [lambda: self.terminate("kubelet"), self.remove_containers, lambda: self.terminate("containerd"),
                 self.kill_leftovers, lambda: self.terminate("kube-proxy"), self.proxy_cleanup, self.remove_iptables,
                 *(lambda n=n: self.terminate(n) for n in ("kube-scheduler", "kube-controller-manager",
                                                           "kube-apiserver", "etcd")),
                 self.unmount, self.remove_cgroups, self.remove_network, self.remove_files]
        errors = []
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the rest of the teardown still runs
                errors.append(f"{getattr(step, '__name__', step)}: {e}")
        errors += self.leftovers()
        if errors:
            raise RuntimeError("e2e teardown incomplete: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """What a finished teardown must not leave: our processes, mounts, cgroups, chains, links."""
        out = []
        procs = self.stray_processes()
        if procs:
            out.append(f"processes {procs}")
        roots = (str(KUBELET_ROOT), str(self.ctrd_sock.parent), str(CACHE / "containerd"))
        mounts = [m for m in (ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines())
                  if m.startswith(roots)]
        if mounts:
            out.append(f"mounts {mounts[:5]}")
        if any((c / "kubepods").exists() for c in CGROUP.iterdir()):
            out.append("cgroups kubepods")
        if self.started_proxy and "KUBE-" in run("iptables-save", check=False).stdout:
            out.append("iptables KUBE-* chains")
        if run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            out.append(f"link {BRIDGE}")
        return out

    def our_processes(self) -> set[str]:
        """Pids of the binaries this cluster runs (from its node and control-plane directories)."""
        return {p.name for p in Path("/proc").iterdir() if p.name.isdigit() and self._ours(p)}

    def stray_processes(self) -> list[str]:
        """Our binaries still running, but for those that ran before start() (another run's, say
        an envtest control plane whose test was killed): not this cluster's to stop."""
        return sorted(self.our_processes() - self.preexisting, key=int)

    def _ours(self, proc: Path, *prefixes: str) -> bool:
        try:
            return os.readlink(proc / "exe").startswith(prefixes or (str(self.bin), str(self.assets)))
        except OSError:
            return False

    def terminate(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def remove_containers(self) -> None:
        """The pods' containers and sandboxes, with the kubelet gone (containerd still up)."""
        if "containerd" not in self.procs:
            return
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for t in tasks:
            self.ctr("tasks", "kill", "-s", "SIGKILL", t, check=False)
        for t in tasks:
            wait_for(lambda t=t: self.ctr("tasks", "rm", "-f", t, check=False).returncode == 0
                     or t not in self.ctr("tasks", "ls", "-q", check=False).stdout.split(), 20, f"task {t} removed")
        for c in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "rm", c, check=False)
        for ns in run("ip", "netns", "list", check=False).stdout.split("\n"):
            if ns.startswith("cni-"):
                run("ip", "netns", "delete", ns.split()[0], check=False)

    def kill_leftovers(self) -> None:
        """Shims (they outlive containerd by design) and anything still in the pods' cgroups."""
        pids = set()
        shim = str(self.bin / "containerd-shim-runc-v2")
        pids.update(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and self._ours(p, shim))
        for tasks in (CGROUP / "cpuset" / "kubepods").rglob("tasks") if (CGROUP / "cpuset" / "kubepods").exists() else []:
            pids.update(int(x) for x in tasks.read_text().split())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def proxy_cleanup(self) -> None:
        if not self.started_proxy:
            return
        run(self.bin / "kube-proxy", "--cleanup", check=False, timeout=60)

    def remove_iptables(self) -> None:
        if not self.started_proxy:
            return
        for tool in ("iptables", "ip6tables"):
            save = run(f"{tool}-save", check=False).stdout
            for args in iptables_cleanup(save):
                run(tool, *args, check=False)

    def unmount(self) -> None:
        roots = (str(KUBELET_ROOT), str(self.ctrd_sock.parent), str(CACHE / "containerd"), "/run/netns", "/var/run/netns")
        mounts = [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines()]
        for m in sorted((m for m in mounts if m.startswith(roots) and m not in ("/run/netns", "/var/run/netns")),
                        key=len, reverse=True):
            run("umount", "-l", m, check=False)
        if not getattr(self, "had_netns_mount", True) and self.mounted("/run/netns"):  # made for the pods' netns
            run("umount", "/run/netns", check=False)

    @staticmethod
    def mounted(path: str) -> bool:
        return any(ln.split()[1] == path for ln in Path("/proc/self/mounts").read_text().splitlines())

    def remove_cgroups(self) -> None:
        for controller in CGROUP.iterdir():
            top = controller / "kubepods"
            if top.is_dir():
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                    d.rmdir()
                top.rmdir()

    def remove_network(self) -> None:
        if run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            run("ip", "link", "delete", BRIDGE)

    def remove_files(self) -> None:
        shutil.rmtree(self.ctrd_sock.parent.parent, ignore_errors=True)
        if self.made_cni_dir:  # containerd's CNI result cache
            shutil.rmtree("/var/lib/cni", ignore_errors=True)
        if self.made_kubelet_root:
            shutil.rmtree(KUBELET_ROOT, ignore_errors=True)
        for name in ("etcd", "pki", "ipam"):  # the logs and configs stay for the failure message
            shutil.rmtree(self.dir / name, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------
    def start_proc(self, name: str, cmd: list, env: dict | None = None) -> None:
        self.started_proxy |= name == "kube-proxy"
        log = (self.logs / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.tail(name)}")

    def tail(self, name: str, n: int = 25) -> str:
        lines = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(ln[:400] for ln in lines[-n:])

    def write(self, name: str, obj: dict) -> Path:
        path = self.dir / name
        path.write_text(json.dumps(obj, indent=1))
        return path

    def kubeconfig_for(self, name: str, user: str) -> Path:
        return self.write(f"{name}.kubeconfig", kubeconfig(self.server, self.dir / "pki" / "ca.crt", user,
                                                            self.tokens[user]))

    def resolv_conf(self) -> Path:
        """The host's resolver for pods (no cluster DNS runs here); an empty one if it has none."""
        path = self.dir / "resolv.conf"
        host = Path("/etc/resolv.conf")
        path.write_text(host.read_text() if host.exists() else "")
        return path

    def ctr(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return run(self.bin / "ctr", "--address", self.ctrd_sock, "-n", "k8s.io", *args, check=check, timeout=600)

    def kubectl(self, *args, check: bool = True, input: str | None = None, timeout: float = 120):
        return run(self.assets / "kubectl", "--kubeconfig", self.admin, *args, check=check, input=input,
                   timeout=timeout)

    def get(self, *args) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def node_ready(self) -> bool:
        node = self.get("node", NODE_NAME)
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
