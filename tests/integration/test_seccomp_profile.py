"""The chart's Localhost seccomp profile (RuntimeDefault plus the NUMA calls, generated from
containerd's own default), loaded through libseccomp as runc loads it and enforced on real
processes: the NUMA calls work under it (memory binding effective, the engine generates), and
what RuntimeDefault refuses a container without capabilities stays refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.live_topology import NUMA_FORBIDDEN, numa_calls_allowed

ROOT = Path(__file__).resolve().parents[2]
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "s390x": "s390x"}.get(os.uname().machine, os.uname().machine)
PROFILE = ROOT / "charts" / "cpuserve" / "files" / "seccomp" / f"numa-{ARCH}.json"
RUNNER = str(ROOT / "tests" / "engine" / "platform" / "seccomp_profile.py")

UNSHARE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.unshare(0x00020000)  # CLONE_NEWNS: root may, the profile may not
print("unshare", rc, os.strerror(ctypes.get_errno()) if rc else "ok")
rc = libc.syscall(163, None)  # acct (x86_64): in no rule, denied by default
print("acct", rc, os.strerror(ctypes.get_errno()) if rc else "ok")
"""


def run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, RUNNER, str(PROFILE), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_numa_calls_allowed_under_the_profile():
    if not numa_calls_allowed():
        pytest.skip(NUMA_FORBIDDEN)
    r = run("-m", "cpuserve", "topology", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["memory_binding"]["effective"] is True


def test_refused_calls_are_refused(tmp_path):
    script = tmp_path / "unshare.py"
    script.write_text(UNSHARE)
    r = run(str(script))
    assert r.returncode == 0, r.stderr
    assert "unshare -1 Operation not permitted" in r.stdout
    if ARCH == "amd64":
        assert "acct -1 Operation not permitted" in r.stdout
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if os.geteuid() == 0:  # without the profile, root may: the refusal above is the profile's doing
        assert "unshare 0 ok" in plain.stdout


def test_engine_generates_under_the_profile():
    r = run("-m", "cpuserve", "generate", "--prompt", "Hi", "--max-tokens", "4", "--kv-cache-space", "0.5",
            "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NUMA memory binding is not in effect" not in r.stderr


def test_profiles_are_runtime_default_plus_the_numa_calls():
    """The committed profiles are what hack/seccomp/generate.py makes from containerd's
    DefaultProfile for each engine architecture (built with Go, run under qemu-user)."""
    import shutil

    if not shutil.which("go"):
        if os.environ.get("CI"):
            pytest.fail("Go is needed to check the seccomp profiles")
        pytest.skip("no Go toolchain: the profiles cannot be regenerated here")
    r = subprocess.run([sys.executable, str(ROOT / "hack" / "seccomp" / "generate.py"), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = json.loads(PROFILE.read_text())
    assert prof["defaultAction"] == "SCMP_ACT_ERRNO"  # deny by default
    assert prof["syscalls"][-1]["names"] == ["get_mempolicy", "mbind", "migrate_pages", "move_pages",
                                             "set_mempolicy", "set_mempolicy_home_node"]
    allowed = {n for rule in prof["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for n in rule["names"]}
    assert not allowed & {"mount", "unshare", "setns", "bpf", "kexec_load", "init_module", "keyctl"}
