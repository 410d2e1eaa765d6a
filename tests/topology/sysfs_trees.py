"""Recorded /sys trees for the topology tests.

`record(dst)` copies, from the live machine, exactly the files cpuserve's
topology reader uses (run `python tests/platform/sysfs_trees.py record DIR` on a
machine to add its shape). `one_node_epyc_2c` was recorded that way on the CI
VM. The other trees are written by `write_machine` with the layout the kernel
gives those machines (CPU numbering, per-package core ids, sibling lists, node
meminfo), because no such machine is reachable from here:

- `xeon_2s_snc2_smt`: two Xeon sockets in SNC2 mode (4 NUMA nodes), 4 cores per
  node, Hyper-Threading: first threads 0-15, siblings 16-31, per-package core ids
  that are not contiguous (0,1,2,3,8,9,10,11) as on real Xeons.
- `arm64_2node_nosmt`: an arm64 server (Kunpeng 920-like), 2 NUMA nodes of 8
  cores, no SMT, `Features` instead of `flags`.
- `xeon_2s_snc2_smt_cpuset`: the Xeon tree seen from a container whose cpuset is
  6-11,22-27 with memory nodes 1-2 (parts of two NUMA nodes).
- `epyc_1s_adjacent_smt`: one socket whose SMT siblings are numbered next to each other
  (0/1, 2/3, ...), as some firmware enumerates them: the first half of a node's CPUs is
  *not* one thread per core there.

And trees of real multi-socket machines, converted from hwloc's recordings (`RECORDED`
below; each tree's `SOURCE` file says which): an HP ProLiant SL390s G7 (two Westmere
sockets whose CPUs alternate between the NUMA nodes: node 0 has the even ones), a
Supermicro X9DRG-HF (two Sandy Bridge sockets, siblings at +16) and an IBM x3950 M2 (four
NUMA nodes of 24 cores).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent / "trees"

XEON_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr "
              "sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 pcid "
              "sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch avx2 bmi1 "
              "bmi2 erms avx512f avx512dq rdseed adx avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 "
              "amx_tile amx_int8")
ARM_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma dcpop asimddp asimdfhm"


def record(dst: Path, src: Path = Path("/")) -> None:
    """Copies the files the topology reader uses from `src` into `dst`."""
    import platform

    sysdev = src / "sys/devices/system"
    files = [sysdev / "cpu/online", sysdev / "node/online"]
    files += [p / f for p in (sysdev / "node").glob("node[0-9]*") for f in ("cpulist", "meminfo")]
    for cpu in (sysdev / "cpu").glob("cpu[0-9]*"):
        files += [cpu / "topology" / f for f in ("physical_package_id", "core_id", "thread_siblings_list")]
    for f in files:
        if f.exists():
            out = dst / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out)
    (dst / "proc/self").mkdir(parents=True, exist_ok=True)
    status = [ln for ln in (src / "proc/self/status").read_text().splitlines()
              if ln.startswith(("Cpus_allowed_list", "Mems_allowed_list"))]
    (dst / "proc/self/status").write_text("\n".join(status) + "\n")
    cpuinfo = (src / "proc/cpuinfo").read_text().split("\n\n")[0]  # the first processor is enough
    (dst / "proc/cpuinfo").write_text(cpuinfo + "\n")
    (dst / "arch").write_text(platform.machine() + "\n")


def write_machine(dst: Path, arch: str, nodes: list[list[tuple[int, int, list[int]]]], mem_gib: list[float],
                  cpuinfo: str, allowed: str, mems: str, node_ids: list[int] | None = None) -> None:
    """nodes[i] = [(package, core_id, [thread cpu ids]), ...] for NUMA node node_ids[i] (default i)."""
    node_ids = node_ids or list(range(len(nodes)))
    sysdev = dst / "sys/devices/system"
    all_cpus = sorted(c for node in nodes for _, _, threads in node for c in threads)
    (sysdev / "cpu").mkdir(parents=True, exist_ok=True)
    (sysdev / "cpu/online").write_text(f"0-{max(all_cpus)}\n")
    (sysdev / "node").mkdir(parents=True, exist_ok=True)
    from cpuserve_topology import format_cpulist

    (sysdev / "node/online").write_text(format_cpulist(node_ids) + "\n")
    for i, node in enumerate(nodes):
        nid = node_ids[i]
        d = sysdev / f"node/node{nid}"
        d.mkdir(parents=True, exist_ok=True)
        cpus = sorted(c for _, _, threads in node for c in threads)
        (d / "cpulist").write_text(format_cpulist(cpus) + "\n")
        kb = int(mem_gib[i] * 1024 * 1024)
        (d / "meminfo").write_text(f"Node {nid} MemTotal:       {kb} kB\nNode {nid} MemFree:        {kb * 9 // 10} kB\n"
                                   f"Node {nid} MemUsed:        {kb // 10} kB\n")
        for pkg, core, threads in node:
            for c in threads:
                t = sysdev / f"cpu/cpu{c}/topology"
                t.mkdir(parents=True, exist_ok=True)
                (t / "physical_package_id").write_text(f"{pkg}\n")
                (t / "core_id").write_text(f"{core}\n")
                (t / "thread_siblings_list").write_text(format_cpulist(threads) + "\n")
    (dst / "proc/self").mkdir(parents=True, exist_ok=True)
    (dst / "proc/self/status").write_text(f"Cpus_allowed_list:\t{allowed}\nMems_allowed_list:\t{mems}\n")
    (dst / "proc/cpuinfo").write_text(cpuinfo)
    (dst / "arch").write_text(arch + "\n")


def _hwloc_set(text: str | None) -> set[int]:
    """An hwloc bitmap ("0x00555555", or 32-bit words "0x...,0x..." with empty words for 0)."""
    out, bit = set(), 0
    for word in reversed((text or "").split(",")):
        v = int(word, 16) if word else 0
        out |= {bit + i for i in range(max(32, v.bit_length())) if v >> i & 1}
        bit += 32
    return out


def from_hwloc(xml_text: str) -> tuple[list[list[tuple[int, int, list[int]]]], list[float], list[int], dict]:
    """A machine as `lstopo --of xml` recorded it: per NUMA node (by its cpuset) the cores
    (package, core id, thread CPU ids), each node's memory in GiB, the node ids, and the DMI info."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml_text)
    machine = root.find("object")
    info = {i.get("name"): i.get("value") for i in machine.findall("info")}
    cores: list[tuple[int, int, list[int]]] = []

    def walk(o, pkg):
        if o.get("type") == "Package":
            pkg = int(o.get("os_index"))
        if o.get("type") == "Core":
            cores.append((pkg, int(o.get("os_index")), sorted(int(p.get("os_index")) for p in o.iter("object")
                                                              if p.get("type") == "PU")))
            return
        for child in o.findall("object"):
            walk(child, pkg)
    walk(machine, 0)
    numa = sorted((int(o.get("os_index")), _hwloc_set(o.get("cpuset")), int(o.get("local_memory") or 0))
                  for o in root.iter("object") if o.get("type") == "NUMANode")
    nodes = [sorted((c for c in cores if set(c[2]) <= cpus), key=lambda c: min(c[2])) for _, cpus, _ in numa]
    return nodes, [mem / (1 << 30) for _, _, mem in numa], [nid for nid, _, _ in numa], info


# Machines recorded by hwloc's developers (`lstopo` XML exports of real machines, from their DMI
# data) in github.com/open-mpi/hwloc tests/hwloc/xml at commit 3b37b024aa3f: only the topology
# is taken (CPU numbering, cores, sockets, NUMA nodes, memory). The XML has no CPU flags: the
# cpuinfo written is the CPU generation's usual flags, named as such in each tree's SOURCE.
RECORDED = {
    "hp_sl390s_g7_2s_6c2t": ("24em64t-2n6c2t-pci.xml", "Xeon 5600 (Westmere-EP)",
                             "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx "
                             "fxsr sse sse2 ht syscall nx pdpe1gb rdtscp lm pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 "
                             "popcnt aes lahf_lm"),
    "supermicro_x9drg_2s_8c2t": ("32em64t-2n8c2t-pci-noio.xml", "Xeon E5-2600 (Sandy Bridge-EP)",
                                 "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush "
                                 "mmx fxsr sse sse2 ht syscall nx pdpe1gb rdtscp lm pni pclmulqdq ssse3 cx16 sse4_1 "
                                 "sse4_2 x2apic popcnt aes xsave avx lahf_lm"),
    "ibm_x3950_m2_4n_24c": ("96em64t-4n4d3ca2co-pci.xml", "Xeon 7400 (Dunnington)",
                            "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
                            "sse sse2 ht syscall nx lm pni ssse3 cx16 sse4_1 lahf_lm"),
}


def write_recorded(name: str, xml_text: str) -> None:
    source, cpu, flags = RECORDED[name]
    nodes, mem, ids, info = from_hwloc(xml_text)
    cpuinfo = f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) {cpu}\nflags\t\t: {flags}\n"
    from cpuserve_topology import format_cpulist

    every = sorted(c for n in nodes for _, _, t in n for c in t)
    dst = HERE / name
    write_machine(dst, "x86_64", nodes, mem, cpuinfo, format_cpulist(every), format_cpulist(ids), ids)
    (dst / "SOURCE").write_text(
        f"{info.get('DMIProductName') or name} ({info.get('DMISysVendor') or info.get('DMIBoardVendor') or '?'}), "
        f"recorded by hwloc's developers: github.com/open-mpi/hwloc tests/hwloc/xml/{source} at commit "
        f"3b37b024aa3f. Topology from that file; cpuinfo flags are the usual ones of a {cpu}, not recorded.\n")


def write_all() -> None:
    core_ids = [0, 1, 2, 3, 8, 9, 10, 11]  # per package, as a Xeon reports them
    xeon = []
    for node in range(4):
        pkg = node // 2
        cores = []
        for i in range(4):
            first = node * 4 + i
            cores.append((pkg, core_ids[(node % 2) * 4 + i], [first, first + 16]))
        xeon.append(cores)
    flags = f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: {XEON_FLAGS}\n"
    write_machine(HERE / "xeon_2s_snc2_smt", "x86_64", xeon, [48, 48, 48, 48], flags, "0-31", "0-3")
    write_machine(HERE / "xeon_2s_snc2_smt_cpuset", "x86_64", xeon, [48, 48, 48, 48], flags, "6-11,22-27", "1-2")
    arm = [[(0, n * 8 + i, [n * 8 + i]) for i in range(8)] for n in range(2)]
    features = f"processor\t: 0\nBogoMIPS\t: 200.00\nFeatures\t: {ARM_FEATURES}\nCPU implementer\t: 0x48\n"
    write_machine(HERE / "arm64_2node_nosmt", "aarch64", arm, [64, 64], features, "0-15", "0-1")
    epyc = [[(0, i, [2 * i, 2 * i + 1]) for i in range(8)]]
    amd = f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: {XEON_FLAGS.split(' avx512f')[0]}\n"
    write_machine(HERE / "epyc_1s_adjacent_smt", "x86_64", [epyc[0]], [64], amd, "0-15", "0")


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["hwloc"]:  # sysfs_trees.py hwloc NAME FILE.xml (a RECORDED machine)
        write_recorded(sys.argv[2], Path(sys.argv[3]).read_text())
    elif sys.argv[1:2] == ["synthetic"]:
        write_all()
    else:
        sys.exit("usage: sysfs_trees.py record DIR | synthetic | hwloc NAME FILE.xml")
