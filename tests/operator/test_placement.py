"""The placement plan and the object builders, on many cluster shapes (pure)."""
import json

import pytest

from cpuserve_operator import builders as b
from cpuserve_operator.placement import (DEFAULT_ENGINE_IMAGE, GiB, Node, NumaNode, Slot, Taint, engine_image,
                                        node_from_api, parse_spec, plan, tolerates)


def tainted(node, *taints):
    return Node(node.name, node.arch, node.numa, taints=tuple(taints))


def machine(name, numa=2, cpus_per_numa=16, mem_gib=64, smt=2, isa=(), labels=None, ready=True, arch="amd64"):
    nodes = []
    for i in range(numa):
        first = list(range(i * cpus_per_numa // smt, (i + 1) * cpus_per_numa // smt))
        cpus = first + [c + numa * cpus_per_numa // smt for c in first] if smt == 2 else first
        nodes.append(NumaNode(i, tuple(cpus), mem_gib * GiB, smt))
    return Node(name, arch, tuple(nodes), frozenset(isa), labels or {}, ready)


def spec(**kw):
    s = {"model": {"source": "packaged://smollm2", "servedName": "smollm2", "sizeGiB": 1},
         "engine": {"kvCacheGiB": 4}, "replicas": 1}
    for k, v in kw.items():
        section, _, key = k.partition("__")
        if key:
            s.setdefault(section, {})[key] = v
        else:
            s[section] = v
    return parse_spec("llm", s)


def test_per_numa_node_spreads_over_machines_first():
    p = plan(spec(replicas=3), [machine("b"), machine("a")])
    assert [pl.slot.key for pl in p.placements] == ["a/0", "b/0", "a/1"]
    pl = p.placements[0]
    assert pl.cpus == 16 - 1 * 2  # the NUMA node's 16 CPUs minus one reserved core (2 threads)
    assert pl.memory == (1 + 4 + 1) * GiB and p.unplaced == 0


def test_more_replicas_than_slots_reports_what_is_missing():
    p = plan(spec(replicas=5), [machine("a"), machine("b")])
    assert len(p.placements) == 4 and p.unplaced == 1
    assert p.reason_code == "InsufficientNUMASlots" and "1 of 5 replicas" in p.reason


def test_tensor_parallel_takes_numa_nodes_of_one_machine():
    s = spec(placement__strategy="TensorParallel", placement__tensorParallelSize=2, replicas=3)
    p = plan(s, [machine("a", numa=4), machine("b", numa=2)])
    assert [pl.slot.key for pl in p.placements] == ["a/0,1", "b/0,1", "a/2,3"]
    assert p.placements[0].cpus == 2 * (16 - 2) and p.placements[0].memory == (1 + 2 * 4 + 1) * GiB
    single = plan(s, [machine("c", numa=1)])
    assert single.placements == [] and single.unplaced == 3


def test_memory_is_passed_through_and_the_engine_sizes_the_kv_cache():
    """engine.memoryGiB is the pod's memory as given, and without kvCacheGiB no KV size is set:
    the engine sizes it from the limit. Neither given: the pod is sized for vLLM's 4 GiB per rank."""
    given = spec(engine={"memoryGiB": 2.5})
    (pl,) = plan(given, [machine("a")]).placements
    assert pl.memory == int(2.5 * GiB)
    env = {e["name"]: e["value"] for e in b.build_pod(CR, given, pl)["spec"]["containers"][0]["env"]}
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    both = spec(engine={"memoryGiB": 3, "kvCacheGiB": 1})  # explicit KV: passed on, checked by the engine at start
    (pl,) = plan(both, [machine("a")]).placements
    env = {e["name"]: e["value"] for e in b.build_pod(CR, both, pl)["spec"]["containers"][0]["env"]}
    assert pl.memory == 3 * GiB and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    tp = spec(engine={}, placement__strategy="TensorParallel", placement__tensorParallelSize=2)
    assert plan(tp, [machine("a")]).placements[0].memory == (1 + 2 * 4 + 1) * GiB
    assert given.hash() != spec(engine={"memoryGiB": 3}).hash()  # a new size rolls the pods
    big = plan(spec(engine={"memoryGiB": 100}), [machine("a", mem_gib=32)])
    assert big.reason_code == "DoesNotFitNUMANode" and "engine.memoryGiB 100 / 1 ranks" in big.reason


def test_refuses_what_cannot_fit_a_numa_node():
    p = plan(spec(engine__kvCacheGiB=100), [machine("a", mem_gib=32)])
    assert p.placements == [] and p.reason_code == "DoesNotFitNUMANode"
    assert "102.0 GiB" in p.reason and "32.0 GiB" in p.reason


def test_eligibility_isa_selector_readiness():
    nodes = [machine("plain"), machine("amx", isa={"amx_bf16", "avx512f"}, labels={"pool": "llm"}),
             machine("down", isa={"amx_bf16"}, ready=False)]
    p = plan(spec(placement__requiredISA=["amx_bf16"], replicas=2), nodes)
    assert {pl.slot.node for pl in p.placements} == {"amx"}
    p = plan(spec(placement__nodeSelector={"pool": "llm"}, replicas=4), nodes)
    assert len(p.placements) == 2 and p.unplaced == 2 and "plain: label pool!=llm" in p.reason
    assert "down: not Ready" in p.reason


@pytest.mark.parametrize("tol, taint, want", [
    ({"key": "k", "value": "v", "effect": "NoSchedule"}, Taint("k", "v", "NoSchedule"), True),
    ({"key": "k", "operator": "Equal", "value": "v"}, Taint("k", "v", "NoExecute"), True),  # no effect: every one
    ({"key": "k", "value": "w"}, Taint("k", "v", "NoSchedule"), False),
    ({"key": "k", "operator": "Exists", "effect": "NoSchedule"}, Taint("k", "anything", "NoSchedule"), True),
    ({"key": "k", "operator": "Exists", "effect": "NoSchedule"}, Taint("k", "", "NoExecute"), False),
    ({"operator": "Exists"}, Taint("any", "x", "NoExecute"), True),  # empty key with Exists: every taint
    ({"key": "other", "operator": "Exists"}, Taint("k", "", "NoSchedule"), False),
    ({"key": "k"}, Taint("k", "", "NoSchedule"), True),  # Equal to an empty value
])
def test_toleration_matches_taint_as_kubernetes_does(tol, taint, want):
    assert tolerates(tol, taint) is want


def test_prefer_no_schedule_nodes_are_filled_last():
    """PreferNoSchedule is the scheduler's soft taint: its nodes take replicas only once the others
    are full, the fewest such taints first; a toleration makes the node an equal again, and a
    replica already there stays (the taint never evicts)."""
    soft = Taint("spot", "", "PreferNoSchedule")
    nodes = [tainted(machine("a"), soft, Taint("old", "", "PreferNoSchedule")), tainted(machine("b"), soft),
             machine("c")]
    p = plan(spec(replicas=5), nodes)
    assert [pl.slot.key for pl in p.placements] == ["c/0", "c/1", "b/0", "b/1", "a/0"]
    tol = [{"key": "spot", "operator": "Exists"}]
    p = plan(spec(replicas=3, placement__tolerations=tol), nodes)
    assert [pl.slot.key for pl in p.placements] == ["b/0", "c/0", "b/1"]
    kept = plan(spec(replicas=2), nodes, current={0: Slot("a", (1,))})
    assert [pl.slot.key for pl in kept.placements] == ["a/1", "c/0"]


def test_taints_keep_pods_off_unless_tolerated():
    """The operator binds pods by nodeName, past the scheduler's taint checks: it honours NoSchedule
    and NoExecute taints itself (PreferNoSchedule does not keep it off, nor the node lifecycle's
    own taints, which mirror the Ready condition it reads), and the pods carry the tolerations."""
    cp = machine("cp")
    cp = Node(cp.name, cp.arch, cp.numa, taints=(Taint("node-role.kubernetes.io/control-plane", "", "NoSchedule"),))
    pool = machine("pool")
    pool = Node(pool.name, pool.arch, pool.numa, taints=(Taint("dedicated", "llm", "NoExecute"),
                                                         Taint("soft", "", "PreferNoSchedule"),
                                                         Taint("node.kubernetes.io/not-ready", "", "NoSchedule")))
    p = plan(spec(replicas=4), [cp, pool])
    assert not p.placements and p.unplaced == 4
    assert "cp: taint node-role.kubernetes.io/control-plane:NoSchedule not tolerated" in p.reason
    assert "pool: taint dedicated=llm:NoExecute not tolerated" in p.reason
    tol = [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"}]
    s = spec(replicas=4, placement__tolerations=tol)
    p = plan(s, [cp, pool])
    assert {pl.slot.node for pl in p.placements} == {"pool"} and p.unplaced == 2
    pod = b.build_pod(CR, s, p.placements[0], 300)
    assert tol[0] in pod["spec"]["tolerations"]
    assert {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
            "tolerationSeconds": 300} in pod["spec"]["tolerations"]
    assert s.hash() != spec(replicas=4).hash()  # new tolerations roll the pods
    api = {"metadata": {"name": "t"}, "spec": {"taints": [{"key": "a", "effect": "NoExecute"},
                                                          {"key": "b", "value": "c", "effect": "NoSchedule"}]},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert node_from_api(api).taints == (Taint("a", "", "NoExecute"), Taint("b", "c", "NoSchedule"))


def test_engine_pinning_lists_and_exclusive_slots():
    s = spec(placement__pinning="Engine", replicas=2)
    p = plan(s, [machine("a")], taken={"a/0": "ml/other-server"})
    assert [pl.slot.key for pl in p.placements] == ["a/1"] and p.unplaced == 1
    (pl,) = p.placements
    assert pl.rank_cpus == (tuple(range(8, 15)),)  # NUMA 1's first threads 8-15, the last core reserved
    unknown = Node("bare", "amd64", (NumaNode(0, tuple(range(8)), 64 * GiB),), known_topology=False)
    p = plan(s, [unknown])
    assert p.placements == [] and "CPU ids unknown" in p.reason
    assert plan(spec(replicas=1), [unknown]).placements[0].cpus == 7  # Kubelet pinning: counts suffice


def test_existing_replicas_stay_where_they_are():
    nodes = [machine("a"), machine("b")]
    first = plan(spec(replicas=2), nodes)
    current = {pl.index: pl.slot for pl in first.placements}
    current[1] = Slot("b", (1,))  # replica 1 was placed elsewhere earlier: keep it
    again = plan(spec(replicas=3), nodes, current=current)
    assert {pl.index: pl.slot.key for pl in again.placements} == {0: "a/0", 1: "b/1", 2: "b/0"}
    gone = plan(spec(replicas=2), [machine("a")], current=current)  # node b lost: replica 1 re-placed
    assert {pl.index: pl.slot.key for pl in gone.placements} == {0: "a/0", 1: "a/1"}
    assert plan(spec(replicas=0), nodes).placements == []


def test_spec_hash_tracks_what_the_pods_are_made_of():
    base = spec().hash()
    assert spec(replicas=7).hash() == base and spec(service__port=9000).hash() != base
    assert spec(engine__dtype="bfloat16").hash() != base
    assert spec(ingress__enabled=True).hash() == base
    assert spec(ingress__enabled=True, ingress__path="/llm").hash() != base  # the engine's --root-path
    assert spec(ingress__path="/llm").hash() == base  # no Ingress: no prefix
    assert spec(service__apiKeySecret={"name": "k"}).hash() != base


def test_node_topology_from_api_objects():
    ann = {"numaNodes": [{"id": 1, "cpus": "8-15", "memory": 32 * GiB}, {"id": 0, "cpus": "0-7", "memory": 32 * GiB}],
           "threadsPerCore": 2}
    node = {"metadata": {"name": "n1", "labels": {"kubernetes.io/arch": "arm64", "cpuserve.dev/isa.sve": "true",
                                                  "feature.node.kubernetes.io/cpu-cpuid.ASIMD": "true"},
                         "annotations": {"cpuserve.dev/topology": json.dumps(ann)}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    n = node_from_api(node)
    assert n.arch == "arm64" and [x.id for x in n.numa] == [0, 1] and n.numa[1].cpus == tuple(range(8, 16))
    assert n.isa == {"sve", "asimd"} and n.ready and n.known_topology
    nrt = {"zones": [{"name": "node-0", "type": "Node", "resources": [{"name": "cpu", "capacity": "24"},
                                                                       {"name": "memory", "capacity": "96Gi"}]},
                     {"name": "node-1", "type": "Node", "resources": [{"name": "cpu", "capacity": "24"},
                                                                       {"name": "memory", "capacity": "96Gi"}]}]}
    bare = {"metadata": {"name": "n2"}, "spec": {"unschedulable": True},
            "status": {"allocatable": {"cpu": "4", "memory": "16Gi"}, "conditions": []}}
    m = node_from_api(bare, nrt)
    assert [len(x.cpus) for x in m.numa] == [24, 24] and m.numa[0].memory == 96 * GiB
    assert not m.ready and not m.schedulable
    f = node_from_api(bare)
    assert not f.known_topology and len(f.numa[0].cpus) == 4 and f.numa[0].memory == 16 * GiB


# -- builders ----------------------------------------------------------------------------
CR = {"metadata": {"name": "llm", "namespace": "ml", "uid": "1234"}}


def test_pod_is_guaranteed_pinned_and_probed():
    s = spec(placement__pinning="Engine", engine__extraArgs=["--block-size", "64"])
    (pl,) = plan(s, [machine("a")]).placements
    pod = b.build_pod(CR, s, pl)
    c = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == f"llm-{s.hash()[:6]}-0" == b.pod_name(s, 0)
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "14", "memory": str(6 * GiB)}
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_NICE"]}
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["nodeName"] == "a" and pod["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3,4,5,6" and env["CPU_VISIBLE_MEMORY_NODES"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert c["command"] == ["cpuserve"] and c["args"][-2:] == ["--block-size", "64"]
    amx = spec(placement__requiredISA=["amx_bf16"])
    (apl,) = plan(amx, [machine("x", isa={"amx_bf16"})]).placements
    assert b.build_pod(CR, amx, apl)["spec"]["nodeSelector"]["cpuserve.dev/isa.amx_bf16"] == "true"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert pod["metadata"]["labels"][b.L_HASH] == s.hash()


def test_engine_image_defaults_overrides_and_pull_secrets():
    default = "registry.example:5000/team/cpuserve-engine:0.1.0"
    assert engine_image({}, default) == default
    assert engine_image({"tag": "0.2.0"}, default) == "registry.example:5000/team/cpuserve-engine:0.2.0"
    assert engine_image({"repository": "my/engine"}, default) == "my/engine"
    assert engine_image({"repository": "my/engine", "tag": "v1"}, default) == "my/engine:v1"
    assert spec().image == DEFAULT_ENGINE_IMAGE
    s = spec(image={"repository": "my/engine", "tag": "v1", "pullSecrets": ["regcred"], "pullPolicy": "Always"})
    (pl,) = plan(s, [machine("a")]).placements
    pod = b.build_pod(CR, s, pl)
    c = pod["spec"]["containers"][0]
    assert (c["image"], c["imagePullPolicy"]) == ("my/engine:v1", "Always")
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "imagePullSecrets" not in b.build_pod(CR, spec(), plan(spec(), [machine("a")]).placements[0])["spec"]
    assert s.hash() != spec().hash()  # a new image rolls the pods


def test_pod_runs_the_image_user_on_a_read_only_root():
    (pl,) = plan(spec(), [machine("a")]).placements
    pod = b.build_pod(CR, spec(), pl)
    sc, c = pod["spec"]["securityContext"], pod["spec"]["containers"][0]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == 1000 and c["securityContext"]["readOnlyRootFilesystem"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/var/cache/cpuserve", "/dev/shm"}


def test_kubelet_pinning_and_tensor_parallel_env():
    s = spec(placement__strategy="TensorParallel", placement__tensorParallelSize=2,
             seccompProfile={"type": "Localhost", "localhostProfile": "cpuserve/numa.json"},
             model={"source": "pvc://weights/llama/8b", "servedName": "llama"})
    (pl,) = plan(s, [machine("a")]).placements
    pod = b.build_pod(CR, s, pl)
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "CPU_VISIBLE_MEMORY_NODES" not in env
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert c["args"][:2] == ["serve", "/models/weights/llama/8b"] and "--tensor-parallel-size" in c["args"]
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "Localhost",
                                                                "localhostProfile": "cpuserve/numa.json"}
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert claim["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_service_and_ingress():
    s = spec()
    svc = b.build_service(CR, s)
    assert svc["spec"]["selector"] == {b.L_SERVER: "llm"} and svc["spec"]["ports"][0]["port"] == 8000
    assert b.build_ingress(CR, s) is None
    assert b.endpoint(CR, s) == "http://llm.ml.svc:8000/v1"
    s = spec(ingress={"enabled": True, "host": "llm.example.com", "className": "nginx", "tls": True})
    ing = b.build_ingress(CR, s)
    assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"][0]["hosts"] == ["llm.example.com"]
    assert ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"] == {"name": "llm",
                                                                               "port": {"number": 8000}}
    assert b.endpoint(CR, s) == "https://llm.example.com/v1"
    pdb = b.build_pdb(CR, s)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": svc["spec"]["selector"]},
                           "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "1234"


def test_a_service_monitor_only_where_asked_and_never_in_the_pods_hash():
    s = spec()
    assert b.build_service_monitor(CR, s) is None
    m = spec(monitoring={"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    sm = b.build_service_monitor(CR, m)
    assert sm["metadata"]["labels"]["release"] == "prom" and sm["metadata"]["labels"][b.L_SERVER] == "llm"
    assert sm["spec"] == {"selector": {"matchLabels": {b.L_SERVER: "llm"}},
                          "endpoints": [{"port": "http", "path": "/metrics", "interval": "30s"}]}
    assert m.hash() == s.hash()  # monitoring rolls no pod
    assert spec(monitoring={"serviceMonitor": {"enabled": False, "labels": {"a": "b"}}}).service_monitor is None


def test_lora_adapters_are_mounted_and_named_to_the_engine():
    plain = spec()
    s = spec(model__loraAdapters=[{"name": "sql", "source": "image://reg.example/lora/sql:1", "path": "/adapter/"},
                                  {"name": "chat", "source": "file:///opt/lora/chat"}], engine__maxLoRARank=32)
    args = b.engine_args(s)
    i = args.index("--enable-lora")
    assert args[i:i + 8] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--lora-modules",
                             "sql=/models/lora/sql/adapter", "chat=/opt/lora/chat"]
    assert "--enable-lora" not in b.engine_args(plain)
    volumes, mounts = b.pod_volumes(s)
    assert {"name": "lora-0", "image": {"reference": "reg.example/lora/sql:1", "pullPolicy": "IfNotPresent"}} in volumes
    assert {"name": "lora-0", "mountPath": "/models/lora/sql", "readOnly": True} in mounts
    assert not any(v["name"] == "lora-1" for v in volumes)  # file://: in the engine image
    assert s.hash() != plain.hash()  # adapters roll the pods
    assert spec(engine__maxLoRARank=32).hash() == plain.hash()  # the rank alone, without adapters, does not


def test_an_ingress_prefix_is_the_engines_root_path():
    """An Ingress passes /llm/v1/... on as the client sent it: the engine serves under the prefix
    (and at the root, for the Service's clients), and the endpoint names it."""
    assert "--root-path" not in b.engine_args(spec(ingress={"enabled": True, "host": "h"}))
    s = spec(ingress={"enabled": True, "host": "llm.example.com", "path": "/llm/"})
    args = b.engine_args(s)
    assert args[args.index("--root-path") + 1] == "/llm"
    assert b.build_ingress(CR, s)["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/llm/"
    assert b.endpoint(CR, s) == "http://llm.example.com/llm/v1"
    assert "--root-path" not in b.engine_args(spec(ingress={"enabled": False, "path": "/llm"}))


def test_the_api_key_comes_from_a_secret():
    (pl,) = plan(spec(), [machine("a")]).placements
    assert "VLLM_API_KEY" not in {e["name"] for e in b.build_pod(CR, spec(), pl)["spec"]["containers"][0]["env"]}
    for ref, key in (({"name": "llm-key"}, "api-key"), ({"name": "llm-key", "key": "token"}, "token")):
        s = spec(service__apiKeySecret=ref)
        (pl,) = plan(s, [machine("a")]).placements
        env = {e["name"]: e for e in b.build_pod(CR, s, pl)["spec"]["containers"][0]["env"]}
        assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-key", "key": key}}


@pytest.mark.parametrize("source,arg", [("packaged://smollm2", None), ("file:///srv/m.gguf", "/srv/m.gguf")])
def test_engine_args_per_source(source, arg):
    args = b.engine_args(spec(model={"source": source, "servedName": "m"}))
    assert args[0] == "serve" and (args[1] == arg if arg else args[1] == "--host")


@pytest.mark.parametrize("pinning", ["Kubelet", "Engine"])
@pytest.mark.parametrize("kubelet", ["static", "none", ""])
def test_two_replicas_bind_to_different_numa_nodes(pinning, kubelet):
    """On a two-NUMA-node machine, two replicas end on different nodes whoever pins: the
    engine told its slot (no static CPU manager), or the kubelet's cpusets (static, with the
    single-numa-node topology policy) inside which the engine binds ("auto")."""
    from dataclasses import replace

    node = replace(machine("m"), cpu_manager=kubelet)
    s = spec(replicas=2, placement__pinning=pinning)
    pls = plan(s, [node]).placements
    envs = [{e["name"]: e["value"] for e in b.engine_env(s, p)} for p in pls]
    assert [p.slot.numa for p in pls] == [(0,), (1,)]
    if kubelet == "static":  # the kubelet chooses; lists of ours would fall outside its cpuset
        assert all(e["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "CPU_VISIBLE_MEMORY_NODES" not in e for e in envs)
        assert all(p.kubelet_pins for p in pls)
    elif kubelet == "none" or pinning == "Engine":
        assert [e["CPU_VISIBLE_MEMORY_NODES"] for e in envs] == ["0", "1"]
        first, second = (set(map(int, e["VLLM_CPU_OMP_THREADS_BIND"].split(","))) for e in envs)
        assert first <= set(node.numa[0].cpus) and second <= set(node.numa[1].cpus)
    else:  # pinning Kubelet, policy not reported: never lists that might lie outside an unknown cpuset
        assert all(e["VLLM_CPU_OMP_THREADS_BIND"] == "auto" for e in envs)


def test_kubelet_policies_from_the_agents_annotation():
    n = node_from_api({"metadata": {"name": "n", "annotations": {
        "cpuserve.dev/kubelet": json.dumps({"cpuManagerPolicy": "static", "memoryManagerPolicy": "Static"})}},
        "status": {"allocatable": {"cpu": "4", "memory": "8Gi"}}})
    assert n.cpu_manager == "static"
    assert node_from_api({"metadata": {"name": "n"}, "status": {}}).cpu_manager == ""


def test_isa_known_only_from_node_feature_discovery():
    """NFD spells flags its way (AVX512VNNI, AMXBF16): they satisfy requiredISA, and the pod's
    nodeSelector names the label the node really has, so the kubelet admits it."""
    n = node_from_api({"metadata": {"name": "nfd", "labels": {
        "feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI": "true", "feature.node.kubernetes.io/cpu-cpuid.AMXBF16": "true",
        "cpuserve.dev/isa.avx2": "true"}, "annotations": {"cpuserve.dev/topology": json.dumps(
            {"numaNodes": [{"id": 0, "cpus": "0-7", "memory": 64 << 30}]})}}, "status": {"conditions": [
                {"type": "Ready", "status": "True"}]}})
    s = spec(placement__requiredISA=["avx512_vnni", "amx_bf16", "avx2"])
    (pl,) = plan(s, [n]).placements
    assert b.build_pod(CR, s, pl)["spec"]["nodeSelector"] == {
        "kubernetes.io/arch": "amd64", "feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI": "true",
        "feature.node.kubernetes.io/cpu-cpuid.AMXBF16": "true", "cpuserve.dev/isa.avx2": "true"}
    assert plan(spec(placement__requiredISA=["avx512f"]), [n]).unplaced == 1


def test_node_resource_topology_gives_counts_not_cpu_ids():
    """A node known only from a NodeResourceTopology object: slots and sizes from its zones,
    but no CPU lists (its CPU ids are unknown): pinning Engine refuses it, Kubelet binds "auto"."""
    nrt = {"zones": [{"name": f"node-{i}", "type": "Node", "resources": [
        {"name": "cpu", "capacity": "16"}, {"name": "memory", "capacity": "64Gi"}]} for i in range(2)]}
    n = node_from_api({"metadata": {"name": "nrt"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                      nrt)
    assert [x.id for x in n.numa] == [0, 1] and not n.lists_possible
    engine = plan(spec(placement__pinning="Engine"), [n])
    assert engine.placements == [] and "CPU ids unknown" in engine.reason
    kubelet = plan(spec(replicas=2), [n])
    assert [p.slot.numa for p in kubelet.placements] == [(0,), (1,)] and all(not p.rank_cpus
                                                                            for p in kubelet.placements)


@pytest.mark.parametrize("modes,replicas,one_node,refused", [
    (["ReadOnlyMany"], 4, False, None), (["ReadWriteMany", "ReadWriteOnce"], 4, False, None),
    (["ReadWriteOnce"], 4, True, None), (["ReadWriteOncePod"], 1, False, None),
    (["ReadWriteOncePod"], 2, False, "ReadWriteOncePod"), (None, 1, False, "not found")])
def test_model_claim_access_modes(modes, replicas, one_node, refused):
    got_one, why = b.claim_rule(modes, replicas)
    assert got_one == one_node and (why is None if refused is None else refused in why)


def test_read_write_once_claim_keeps_replicas_on_one_node():
    s = spec(replicas=3, model={"source": "pvc://weights/m"})
    spread = plan(s, [machine("a"), machine("b")])
    assert {p.slot.node for p in spread.placements} == {"a", "b"}
    one = plan(s, [machine("a"), machine("b", numa=4)], one_node=True)  # the machine with room for most
    assert {p.slot.node for p in one.placements} == {"b"} and len(one.placements) == 3
    stay = plan(s, [machine("a"), machine("b", numa=4)], current={0: Slot("a", (1,))}, one_node=True)
    assert {p.slot.node for p in stay.placements} == {"a"} and stay.unplaced == 1  # where replica 0 runs


def test_image_volume_model():
    s = spec(model={"source": "image://registry.example/models/llama:8b-q4", "path": "gguf/model.gguf"})
    (pl,) = plan(s, [machine("a")]).placements
    pod = b.build_pod(CR, s, pl)
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert vol["image"] == {"reference": "registry.example/models/llama:8b-q4", "pullPolicy": "IfNotPresent"}
    c = pod["spec"]["containers"][0]
    assert c["args"][1] == "/models/image/gguf/model.gguf"
    assert {"name": "model", "mountPath": "/models/image", "readOnly": True} in c["volumeMounts"]


def test_http_model_fetched_and_verified_by_an_init_container():
    digest = "ab" * 32
    s = spec(model={"source": "https://models.example.com/llama/8b-q4.gguf?sig=x", "sha256": digest, "sizeGiB": 4})
    (pl,) = plan(s, [machine("a")]).placements
    pod = b.build_pod(CR, s, pl)
    (init,) = pod["spec"]["initContainers"]
    assert init["command"] == ["cpuserve", "fetch", "https://models.example.com/llama/8b-q4.gguf?sig=x", "--sha256",
                               digest, "--dest", "/models/fetched/8b-q4.gguf"]
    assert init["resources"] == pod["spec"]["containers"][0]["resources"]  # the pod stays Guaranteed
    assert pod["spec"]["containers"][0]["args"][1] == "/models/fetched/8b-q4.gguf"
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert vol["emptyDir"]["sizeLimit"] == f"{int(4 * 1.25 * 1024) + 64}Mi"
    assert spec(model={"source": "s3://b/k.gguf", "sha256": digest}).hash() != \
        spec(model={"source": "s3://b/k.gguf", "sha256": "cd" * 32}).hash()  # a new checksum rolls the pods
