"""The node agent: /sys trees into labels and an annotation the planner reads
back, and publishing them on a Node of the real API server."""
import json
import os
import subprocess
import sys
from pathlib import Path

from cpuserve_operator.agent import describe
from cpuserve_operator.placement import node_from_api, parse_spec, plan

TREES = Path(__file__).resolve().parents[1] / "topology" / "trees"


def test_recorded_machines_round_trip_into_the_planner():
    labels, ann = describe(str(TREES / "xeon_2s_snc2_smt"))
    assert labels["cpuserve.dev/numa-nodes"] == "4" and labels["cpuserve.dev/smt"] == "true"
    assert labels["cpuserve.dev/isa.amx_bf16"] == "true"
    node = node_from_api({"metadata": {"name": "xeon", "labels": {**labels, "kubernetes.io/arch": "amd64"},
                                       "annotations": ann},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert [n.cpus for n in node.numa][0] == (0, 1, 2, 3, 16, 17, 18, 19) and node.numa[0].threads_per_core == 2
    spec = parse_spec("x", {"model": {"source": "packaged://m"}, "replicas": 4, "engine": {"kvCacheGiB": 8},
                            "placement": {"pinning": "Engine", "requiredISA": ["amx_bf16"]}})
    p = plan(spec, [node])
    assert len(p.placements) == 4 and p.placements[1].rank_cpus == ((4, 5, 6),)  # first threads, one reserved
    assert p.placements[0].cpus == 8 - 2
    arm_labels, _ = describe(str(TREES / "arm64_2node_nosmt"))
    assert arm_labels["cpuserve.dev/smt"] == "false" and arm_labels["cpuserve.dev/isa.asimd"] == "true"


def test_agent_publishes_on_a_node(cluster):
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node",
                                                          "metadata": {"name": "agent-node"}}))
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    r = subprocess.run([sys.executable, "-m", "cpuserve_operator.agent", "--node-name", "agent-node", "--once",
                        "--root", str(TREES / "arm64_2node_nosmt")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    node = cluster.get("node", "agent-node")
    assert node["metadata"]["labels"]["cpuserve.dev/numa-nodes"] == "2"
    topo = json.loads(node["metadata"]["annotations"]["cpuserve.dev/topology"])
    assert [n["cpus"] for n in topo["numaNodes"]] == ["0-7", "8-15"] and topo["arch"] == "aarch64"
    cluster.kubectl("delete", "node", "agent-node")


def test_engine_topology_recorded_as_the_bound_annotation():
    """The agent asks a Ready engine pod where it runs (GET /topology, here a real HTTP server
    answering as the engine does) and records the union of its ranks."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cpuserve_operator.agent import bound, engine_topology

    answer = {"ranks": [{"rank": 0, "cpus": "1-3", "memoryNode": 0, "membind": "bound to node 0"},
                        {"rank": 1, "cpus": "9-11", "memoryNode": None, "membind": "refused: set_mempolicy EPERM"}]}

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(answer).encode() if self.path == "/topology" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    pod = {"metadata": {"namespace": "llm", "name": "p"},
           "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": srv.server_port}]}]},
           "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    try:
        topo = engine_topology(pod)
        assert topo == answer
        assert json.loads(bound(topo)) == {"cpus": "1-3,9-11", "memoryNodes": [0]}
        pod["status"]["conditions"][0]["status"] = "False"
        assert engine_topology(pod) is None  # only Ready engines are asked
    finally:
        srv.shutdown()


def node_of_tree(name):
    labels, ann = describe(str(TREES / name))
    return node_from_api({"metadata": {"name": name, "labels": {**labels, "kubernetes.io/arch": "amd64"},
                                       "annotations": ann},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}]}})


def test_real_multi_socket_machines_place_one_thread_per_core():
    """Trees of real machines (hwloc's recordings, see each tree's SOURCE) through the agent and
    the planner: pinning Engine gives each replica the first thread of each core of its node,
    one core reserved, however the machine numbers its CPUs."""
    spec = parse_spec("x", {"model": {"source": "packaged://m"}, "replicas": 4, "engine": {"kvCacheGiB": 4},
                            "placement": {"pinning": "Engine"}})
    sl390 = plan(spec, [node_of_tree("hp_sl390s_g7_2s_6c2t")])  # NUMA node 0: the even CPUs, siblings +12
    assert [p.rank_cpus for p in sl390.placements] == [((0, 2, 4, 6, 8),), ((1, 3, 5, 7, 9),)]
    assert sl390.unplaced == 2 and [p.cpus for p in sl390.placements] == [10, 10]
    x9 = plan(spec, [node_of_tree("supermicro_x9drg_2s_8c2t")])  # siblings +16
    assert [p.rank_cpus for p in x9.placements] == [(tuple(range(7)),), (tuple(range(8, 15)),)]
    ibm = plan(spec, [node_of_tree("ibm_x3950_m2_4n_24c")])  # four nodes of 24 cores, no SMT
    assert [p.slot.numa for p in ibm.placements] == [(0,), (1,), (2,), (3,)]
    assert all(len(p.rank_cpus[0]) == 23 for p in ibm.placements)


def test_adjacent_sibling_numbering_is_read_not_assumed():
    """Siblings numbered 0/1, 2/3, ...: the agent publishes each node's cores, so the engine's
    list is one thread per core (0,2,...), not the first half of the node's CPUs (0-7)."""
    node = node_of_tree("epyc_1s_adjacent_smt")
    assert node.numa[0].cores == tuple(range(0, 16, 2))
    spec = parse_spec("x", {"model": {"source": "packaged://m"}, "engine": {"kvCacheGiB": 4},
                            "placement": {"pinning": "Engine"}})
    (pl,) = plan(spec, [node]).placements
    assert pl.rank_cpus == (tuple(range(0, 14, 2)),) and pl.cpus == 16 - 2


def test_topology_policy_from_the_kubelets_config_and_drop_ins(tmp_path):
    """Read as the kubelet reads them: the --config file, then the --config-dir's *.conf in name
    order, later keys winning; the kubelet's defaults where unset; nothing when unreadable."""
    from cpuserve_operator.agent import topology_policy

    cfg = tmp_path / "config.yaml"
    cfg.write_text("kind: KubeletConfiguration\ntopologyManagerPolicy: best-effort\n")
    d = tmp_path / "conf.d"
    d.mkdir()
    (d / "20-late.conf").write_text("topologyManagerScope: pod\n")
    (d / "10-cpuserve.conf").write_text("topologyManagerPolicy: single-numa-node\ntopologyManagerScope: container\n")
    (d / "ignored.yaml").write_text("topologyManagerPolicy: none\n")
    assert topology_policy([str(cfg), str(d)]) == {"topologyManagerPolicy": "single-numa-node",
                                                   "topologyManagerScope": "pod"}
    cfg.write_text("kind: KubeletConfiguration\n")
    assert topology_policy([str(cfg)]) == {"topologyManagerPolicy": "none", "topologyManagerScope": "container"}
    assert topology_policy([str(tmp_path / "missing.yaml")]) == {}


def test_tensor_parallel_skips_single_numa_node_kubelets():
    """A TP pod spans NUMA nodes: a static kubelet with single-numa-node would reject it
    (TopologyAffinityError), so the planner places it on a `restricted` node instead."""
    from dataclasses import replace

    from test_placement import machine

    strict = replace(machine("strict", numa=4), cpu_manager="static", topology_policy="single-numa-node")
    loose = replace(machine("loose", numa=4), cpu_manager="static", topology_policy="restricted")
    tp = parse_spec("tp", {"model": {"source": "packaged://m"}, "engine": {"kvCacheGiB": 2},
                           "placement": {"strategy": "TensorParallel", "tensorParallelSize": 2}, "replicas": 3})
    p = plan(tp, [strict, loose])
    assert [pl.slot.node for pl in p.placements] == ["loose", "loose"] and p.unplaced == 1
    assert "single-numa-node" in p.reason
    single = parse_spec("one", {"model": {"source": "packaged://m"}, "engine": {"kvCacheGiB": 2}, "replicas": 8})
    assert len(plan(single, [strict, loose]).placements) == 8  # one NUMA node each: both fit
