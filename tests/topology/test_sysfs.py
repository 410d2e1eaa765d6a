"""Reading topology from recorded /sys trees (see sysfs_trees.py) and from the
live machine: NUMA nodes, physical cores and SMT siblings, ISA flags, and what a
cpuset allows. Binding plans built on these trees are tested in
tests/engine/platform/test_binding.py."""
import os
from pathlib import Path

import pytest

from cpuserve_topology import format_cpulist, parse_cpulist, read_topology

TREES = Path(__file__).parent / "trees"


def topo(name):
    return read_topology(TREES / name)


@pytest.mark.parametrize("text,cpus", [("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), ("", []),
                                        ("0-6:2", [0, 2, 4, 6]), (" 1 , 0 ", [0, 1])])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "1-", "1,,2", "-1"])
def test_parse_cpulist_rejects(bad):
    with pytest.raises(ValueError, match="CPU"):
        parse_cpulist(bad)


def test_real_two_socket_machine_with_interleaved_numbering():
    """HP ProLiant SL390s G7 as hwloc recorded it (trees/hp_sl390s_g7_2s_6c2t/SOURCE): the two
    sockets' CPUs alternate, each core's sibling is 12 higher, core ids are 0,8,2,10,1,9."""
    t = topo("hp_sl390s_g7_2s_6c2t")
    assert [n.id for n in t.nodes] == [0, 1] and t.packages == [0, 1] and t.smt
    assert t.nodes[0].cpus == tuple(range(0, 24, 2)) and t.nodes[1].cpus == tuple(range(1, 24, 2))
    assert t.physical_cores(t.nodes[0].cpus) == [0, 2, 4, 6, 8, 10] and t.threads_of(2) == [2, 14]
    assert round(t.nodes[1].mem_total / (1 << 30)) == 18 and "avx2" not in t.isa  # Westmere: SSE4.2 at most


def test_real_four_node_machine():
    """IBM x3950 M2 (trees/ibm_x3950_m2_4n_24c/SOURCE): four NUMA nodes of 24 cores, no SMT."""
    t = topo("ibm_x3950_m2_4n_24c")
    assert [len(n.cpus) for n in t.nodes] == [24] * 4 and not t.smt
    assert t.nodes[2].cpus == tuple(range(48, 72))


def test_adjacent_siblings():
    t = topo("epyc_1s_adjacent_smt")
    assert t.physical_cores(t.nodes[0].cpus) == list(range(0, 16, 2)) and t.threads_of(3) == [2, 3]


def test_one_node_recorded_vm():
    t = topo("one_node_epyc_2c")
    assert [n.id for n in t.nodes] == [0] and t.nodes[0].cpus == (0, 1)
    assert not t.smt and t.packages == [0]
    assert t.physical_cores(t.allowed_cpus) == [0, 1]
    assert "avx2" in t.isa and "avx512f" not in t.isa
    assert t.nodes[0].mem_total > 1 << 30


def test_two_sockets_four_nodes_smt():
    t = topo("xeon_2s_snc2_smt")
    assert len(t.nodes) == 4 and t.packages == [0, 1] and t.smt
    # core ids repeat across packages: cores are (package, core_id), 4 per node
    for n in t.nodes:
        assert len(t.physical_cores(n.cpus)) == 4 and len(n.cpus) == 8
    assert t.threads_of(0) == [0, 16]
    assert {"avx512f", "avx512_bf16", "amx_bf16"} <= set(t.isa)


def test_arm64_without_smt():
    t = topo("arm64_2node_nosmt")
    assert t.arch == "aarch64" and not t.smt and len(t.nodes) == 2
    assert {"asimd", "asimddp"} <= set(t.isa) and "sve" not in t.isa


def test_cpuset_subset():
    t = topo("xeon_2s_snc2_smt_cpuset")
    assert t.allowed_cpus == frozenset(parse_cpulist("6-11,22-27")) and t.allowed_mems == {1, 2}
    assert t.allowed_in(0) == [] and t.allowed_in(1) == [6, 7, 22, 23]
    assert t.allowed_in(2) == [8, 9, 10, 11, 24, 25, 26, 27]


def test_live_topology_matches_the_kernel():
    t = read_topology()
    assert t.allowed_cpus == frozenset(os.sched_getaffinity(0))
    assert sum(len(n.cpus) for n in t.nodes) == os.cpu_count()
    assert all(c in t.cpus for c in t.allowed_cpus)
