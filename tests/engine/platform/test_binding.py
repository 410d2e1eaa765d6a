"""Binding plans on recorded /sys trees (tests/topology/sysfs_trees.py), and the
`cpuserve topology` command. Reading the trees is tested in tests/topology."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpuserve.platform.binding import BindingError, env_settings, plan_binding
from cpuserve_topology import format_cpulist, parse_cpulist, read_topology

TREES = Path(__file__).resolve().parents[2] / "topology" / "trees"


def topo(name):
    return read_topology(TREES / name)


def cpus_of(plan):
    return [list(r.cpus) for r in plan.ranks]


# -- the four machine shapes ---------------------------------------------------------------
def test_one_node_recorded_vm():
    t = topo("one_node_epyc_2c")
    p = plan_binding(t, 1)
    assert cpus_of(p) == [[0, 1]] and p.ranks[0].mem_node == 0 and p.reserved_cpus == ()
    p2 = plan_binding(t, 2)  # one core per rank, sharing the node: nothing left to reserve
    assert cpus_of(p2) == [[0], [1]] and p2.reserved_cpus == ()
    assert any("share" in w for w in p2.warnings)
    with pytest.raises(BindingError, match="2 usable physical core.*too few for 3 ranks"):
        plan_binding(t, 3)


def test_two_sockets_four_nodes_smt():
    t = topo("xeon_2s_snc2_smt")
    p1 = plan_binding(t, 1)  # one thread per physical core, first thread of each, node 0
    assert cpus_of(p1) == [[0, 1, 2, 3]] and p1.reserved_cpus == ()
    assert any("stay unused" in w for w in p1.warnings)
    p2 = plan_binding(t, 2)  # one CPU per rank reserved by default (with its SMT sibling)
    assert cpus_of(p2) == [[0, 1, 2], [4, 5, 6]]
    assert [r.mem_node for r in p2.ranks] == [0, 1]
    assert p2.reserved_cpus == (3, 7, 19, 23)
    p4 = plan_binding(t, 4, reserved=0)
    assert cpus_of(p4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert p4.ranks[3].mem_bytes == 48 << 30
    p8 = plan_binding(t, 8, reserved=0)  # two ranks per node
    assert cpus_of(p8)[:2] == [[0, 1], [2, 3]] and p8.ranks[1].mem_node == 0
    vis = plan_binding(t, 2, visible_nodes=[3, 1])
    assert [r.mem_node for r in vis.ranks] == [3, 1] and cpus_of(vis) == [[12, 13, 14], [4, 5, 6]]


def test_arm64_without_smt():
    t = topo("arm64_2node_nosmt")
    p = plan_binding(t, 2)
    assert cpus_of(p) == [list(range(7)), list(range(8, 15))] and p.reserved_cpus == (7, 15)
    p = plan_binding(t, 1, reserved=2)
    assert cpus_of(p) == [list(range(6))] and p.reserved_cpus == (6, 7)


def test_cpuset_subset():
    t = topo("xeon_2s_snc2_smt_cpuset")
    p1 = plan_binding(t, 1)  # the first node with allowed CPUs; only the allowed cores
    assert cpus_of(p1) == [[6, 7]] and p1.ranks[0].mem_node == 1
    p2 = plan_binding(t, 2)
    assert cpus_of(p2) == [[6], [8, 9, 10]] and [r.mem_node for r in p2.ranks] == [1, 2]
    assert p2.reserved_cpus == (7, 11, 23, 27)
    with pytest.raises(BindingError, match="tensor_parallel_size 3"):
        plan_binding(t, 3)
    # a rank on CPUs whose node's memory the cpuset does not allow: bound CPUs, unbound memory
    t2 = read_topology(TREES / "xeon_2s_snc2_smt", status="Cpus_allowed_list:\t0-31\nMems_allowed_list:\t1\n")
    p = plan_binding(t2, 1)
    assert p.ranks[0].mem_node is None and any("no memory this process may use" in w for w in p.warnings)


# -- explicit lists and their refusals ---------------------------------------------------------
def test_explicit_lists():
    t = topo("xeon_2s_snc2_smt")
    p = plan_binding(t, 2, bind="0-3|4-7")
    assert p.mode == "list" and cpus_of(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r.mem_node for r in p.ranks] == [0, 1]
    assert 8 in p.reserved_cpus and 0 not in p.reserved_cpus  # the rest goes to the API process
    smt = plan_binding(t, 1, bind="0,16")
    assert any("SMT siblings" in w for w in smt.warnings)


@pytest.mark.parametrize("tree,world,bind,message", [
    ("xeon_2s_snc2_smt", 1, "0-7", "span NUMA nodes"),
    ("xeon_2s_snc2_smt", 2, "0-3|3-5", "given to rank 0 and rank 1"),
    ("xeon_2s_snc2_smt", 2, "0-3", "gives 1 CPU list"),
    ("xeon_2s_snc2_smt", 1, "0-40", "not in this process's allowed CPUs"),
    ("xeon_2s_snc2_smt_cpuset", 1, "0-3", "not in this process's allowed CPUs"),
    ("xeon_2s_snc2_smt", 2, "0-1|", "empty"),
    ("xeon_2s_snc2_smt", 1, "zero", "bad CPU list"),
])
def test_invalid_lists_refused(tree, world, bind, message):
    with pytest.raises(BindingError, match=message):
        plan_binding(topo(tree), world, bind=bind)


@pytest.mark.parametrize("kwargs,message", [
    (dict(visible_nodes=[7]), "names NUMA node 7"),
    (dict(visible_nodes=[0, 0]), "twice"),
    (dict(reserved=4), "leaves rank 0 no core"),
])
def test_invalid_auto_settings_refused(kwargs, message):
    with pytest.raises(BindingError, match=message):
        plan_binding(topo("xeon_2s_snc2_smt"), 1, **kwargs)


def test_visible_node_outside_cpuset_refused():
    with pytest.raises(BindingError, match="none of its CPUs"):
        plan_binding(topo("xeon_2s_snc2_smt_cpuset"), 1, visible_nodes=[0])


def test_nobind_and_oversubscription():
    t = topo("xeon_2s_snc2_smt")
    p = plan_binding(t, 2, bind="nobind", omp_num_threads=8)
    assert [r.cpus for r in p.ranks] == [None, None] and [r.num_threads for r in p.ranks] == [8, 8]
    assert p.warnings == ()
    over = plan_binding(t, 2, bind="nobind", omp_num_threads=40)
    assert any("oversubscribe" in w for w in over.warnings)
    default = plan_binding(t, 2, bind="nobind")
    assert [r.num_threads for r in default.ranks] == [8, 8]  # physical cores / ranks


def _with_cgroup(tmp_path, name, files: dict) -> Path:
    root = tmp_path / name
    shutil.copytree(TREES / "one_node_epyc_2c", root)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return root


def test_cpu_quota_sets_the_thread_count(tmp_path):
    """A 1.5-CPU quota pays for one thread: the engine runs one, on one core, and the other
    core is left to the API process; an explicit list is kept but warned about."""
    t = read_topology(_with_cgroup(tmp_path, "v2", {"sys/fs/cgroup/cpu.max": "150000 100000"}))
    assert t.cpu_quota == 1.5
    p = plan_binding(t, 1)
    assert cpus_of(p) == [[0]] and p.ranks[0].num_threads == 1 and p.reserved_cpus == (1,)
    assert any("quota of 1.5 CPUs" in w and "runs 1 thread" in w for w in p.warnings)
    assert plan_binding(t, 1, bind="nobind").ranks[0].num_threads == 1
    assert plan_binding(t, 1, bind="nobind", omp_num_threads=2).ranks[0].num_threads == 2  # asked for: kept
    listed = plan_binding(t, 1, bind="0-1")
    assert cpus_of(listed) == [[0, 1]] and any("throttled" in w for w in listed.warnings)
    assert cpus_of(plan_binding(read_topology(_with_cgroup(tmp_path, "two", {
        "sys/fs/cgroup/cpu.max": "200000 100000"})), 1)) == [[0, 1]]  # two CPUs paid for: both used


def test_cpu_quota_read_from_the_process_own_cgroup_v1_and_v2(tmp_path):
    v1 = _with_cgroup(tmp_path, "v1", {"proc/self/cgroup": "4:cpu,cpuacct:/kubepods/pod1/c1\n2:memory:/x",
                                        "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1/cpu.cfs_quota_us": "50000",
                                        "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1/cpu.cfs_period_us": "100000",
                                        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert read_topology(v1).cpu_quota == 0.5
    v2 = _with_cgroup(tmp_path, "v2own", {"proc/self/cgroup": "0::/kubepods.slice/pod2",
                                           "sys/fs/cgroup/kubepods.slice/pod2/cpu.max": "300000 100000",
                                           "sys/fs/cgroup/cpu.max": "max 100000"})
    assert read_topology(v2).cpu_quota == 3.0
    none = _with_cgroup(tmp_path, "none", {"proc/self/cgroup": "0::/", "sys/fs/cgroup/cpu.max": "max 100000"})
    assert read_topology(none).cpu_quota is None


def test_env_settings():
    s = env_settings({"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7", "VLLM_CPU_NUM_OF_RESERVED_CPU": "2",
                      "CPU_VISIBLE_MEMORY_NODES": "1,0", "OMP_NUM_THREADS": "6"})
    assert s == dict(bind="0-3|4-7", reserved=2, visible_nodes=[1, 0], omp_num_threads=6)
    assert env_settings({})["bind"] == "auto"
    for env, msg in [({"VLLM_CPU_NUM_OF_RESERVED_CPU": "x"}, "whole number"),
                     ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "-1"}, ">= 0"),
                     ({"CPU_VISIBLE_MEMORY_NODES": "a,b"}, "comma-separated")]:
        with pytest.raises(BindingError, match=msg):
            env_settings(env)


# -- the command -------------------------------------------------------------
def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cpuserve", "topology", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120)


def test_topology_command_json_and_table():
    r = run_cli("--json", "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["allowed_cpus"] == format_cpulist(os.sched_getaffinity(0))
    assert out["memory_binding"]["effective"] in (True, False) and out["memory_binding"]["detail"]
    assert len(out["binding_plan"]["ranks"]) == 2
    table = run_cli("--root", str(TREES / "xeon_2s_snc2_smt_cpuset"), "-tp", "2",
                    env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert table.returncode == 0, table.stderr
    assert "rank 1: 3 threads on CPUs 8-10, memory node 2" in table.stdout
    assert "(memory not allowed)" in table.stdout
    bad = run_cli("-tp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"})
    assert bad.returncode == 2 and "must not share CPUs" in bad.stdout
