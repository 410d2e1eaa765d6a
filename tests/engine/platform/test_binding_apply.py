"""Applying a binding plan for real: threads land on their CPUs, memory policy
is bound, and a container that forbids the NUMA syscalls (a seccomp filter as
Docker's default profile) gets one clear warning, not a crash."""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.live_topology import NUMA_FORBIDDEN, allowed_nodes, node_cpus, numa_calls_allowed

HERE = Path(__file__).parent
SECCOMP = str(HERE / "seccomp_numa.py")

APPLY = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from cpuserve.platform.binding import RankBinding
from cpuserve.platform.pinning import apply_rank_binding
from cpuserve import _C
cpus, node = tuple(json.loads(sys.argv[1])), int(sys.argv[2])
r = apply_rank_binding(RankBinding(0, cpus, len(cpus), node, 1 << 30), [node])
r2 = apply_rank_binding(RankBinding(0, cpus, len(cpus), node, 1 << 30), [node])  # again: still one warning
print("RESULT", json.dumps(dict(threads=r.thread_cpus, membind=r.membind, effective=r.membind_effective,
                                policy=_C.get_mempolicy())))
"""


def run(args, cpus, node):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, *args, json.dumps(cpus), str(node)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    return result, r.stderr


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "apply.py"
    p.write_text(APPLY)
    return str(p)


def test_threads_pinned_and_memory_bound(script):
    node = allowed_nodes()[-1]  # the last node this process may use (the only one on most machines)
    cpus = node_cpus(node)[::-1]  # reversed: thread i must follow cpus[i], not CPU order
    if not numa_calls_allowed():
        pytest.skip(NUMA_FORBIDDEN)
    result, log = run([script], cpus, node)
    assert result["threads"] == cpus
    assert result["effective"] and result["membind"] == f"bound to node {node}"
    err, mode, nodes = result["policy"]
    assert err == 0 and mode == 2 and nodes == [node]  # MPOL_BIND to that node
    assert "WARNING" not in log


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64", "s390x"), reason="no syscall table")
def test_forbidden_numa_syscalls_give_one_warning(script):
    node = allowed_nodes()[0]
    cpus = node_cpus(node)
    result, log = run([SECCOMP, script], cpus, node)
    assert result["threads"] == cpus              # thread pinning still works
    assert not result["effective"] and "EPERM" in result["membind"]
    warnings = [ln for ln in log.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1, log
    assert "CAP_SYS_NICE" in warnings[0] and "seccomp" in warnings[0]


def test_topology_command_reports_forbidden_binding():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, SECCOMP, "-m", "cpuserve", "topology", "--json"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    mb = json.loads(r.stdout)["memory_binding"]
    assert mb["effective"] is False and "EPERM" in mb["detail"]
    r = subprocess.run([sys.executable, "-m", "cpuserve", "topology"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert "memory binding: effective" in r.stdout


def test_tcmalloc_preload(tmp_path):
    from cpuserve.platform.pinning import preload_tcmalloc_for_children

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    env = {"LD_PRELOAD": "/x/libother.so"}
    assert preload_tcmalloc_for_children(env, dirs=[str(tmp_path)]) == str(lib)
    assert env["LD_PRELOAD"] == f"{lib}:/x/libother.so"
    assert preload_tcmalloc_for_children(env, dirs=[]) == str(lib)  # already there: kept, not doubled
    assert env["LD_PRELOAD"].split(":").count(str(lib)) == 1
    off = {"CPUSERVE_TCMALLOC": "0"}
    assert preload_tcmalloc_for_children(off, dirs=[str(tmp_path)]) is None and "LD_PRELOAD" not in off
    assert preload_tcmalloc_for_children({}, dirs=[str(tmp_path / "none")]) is None


TWO_ENGINES = r"""
import json
from cpuserve import LLM
first = LLM(kv_cache_space=0.05).engine.runner.binding.thread_cpus
second = LLM(kv_cache_space=0.05).engine.runner.binding.thread_cpus
print("RESULT", json.dumps(dict(first=first, second=second)))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_second_engine_in_one_process_gets_every_cpu(tmp_path):
    """The first binding leaves the main thread on one CPU; the next engine of the same process
    (tests, `cpuserve bench`) must still plan over all the CPUs the process started with."""
    p = tmp_path / "two.py"
    p.write_text(TWO_ENGINES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), VLLM_CPU_OMP_THREADS_BIND="auto")
    r = subprocess.run([sys.executable, str(p)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    assert len(got["first"]) >= 2 and got["second"] == got["first"], got
