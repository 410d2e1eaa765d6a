"""The kubelet's pod-resources response, decoded by our wire-format reader: checked against
messages encoded by Google's protobuf runtime from the v1 API's field numbers, over a real
gRPC server on a unix socket, and turned into the pod annotations the agent writes."""
import json
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from cpuserve_operator.agent import assignments, kubelet_policies
from cpuserve_operator.podresources import (ALLOCATABLE, LIST, allocatable_resources, decode_allocatable, decode_list,
                                            list_pod_resources)

# k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, the messages List returns
PROTO = {
    "ListPodResourcesResponse": [("pod_resources", 1, "PodResources", True)],
    "PodResources": [("name", 1, str, False), ("namespace", 2, str, False),
                     ("containers", 3, "ContainerResources", True)],
    "ContainerResources": [("name", 1, str, False), ("devices", 2, "ContainerDevices", True),
                           ("cpu_ids", 3, int, True), ("memory", 4, "ContainerMemory", True)],
    "ContainerDevices": [("resource_name", 1, str, False), ("device_ids", 2, str, True),
                         ("topology", 3, "TopologyInfo", False)],
    "ContainerMemory": [("memory_type", 1, str, False), ("size", 2, "uint64", False),
                        ("topology", 3, "TopologyInfo", False)],
    "TopologyInfo": [("nodes", 1, "NUMANode", True)],
    "AllocatableResourcesResponse": [("devices", 1, "ContainerDevices", True), ("cpu_ids", 2, int, True),
                                     ("memory", 3, "ContainerMemory", True)],
    "NUMANode": [("ID", 1, int, False)],
}


@pytest.fixture(scope="module")
def messages():
    F = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="podresources_v1_test.proto", package="v1", syntax="proto3")
    for msg, fields in PROTO.items():
        m = f.message_type.add(name=msg)
        for name, num, typ, repeated in fields:
            fd = m.field.add(name=name, number=num,
                             label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
            if typ is str:
                fd.type = F.TYPE_STRING
            elif typ is int:
                fd.type = F.TYPE_INT64
            elif typ == "uint64":
                fd.type = F.TYPE_UINT64
            else:
                fd.type, fd.type_name = F.TYPE_MESSAGE, f".v1.{typ}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}")) for name in PROTO}


def response(m) -> bytes:
    r = m["ListPodResourcesResponse"]()
    p = r.pod_resources.add(name="smollm2-abc-0", namespace="llm")
    p.containers.add(name="sidecar")
    eng = p.containers.add(name="engine", cpu_ids=[33, 2, 3, 32])
    eng.devices.add(resource_name="example.com/nic", device_ids=["a"]).topology.nodes.add(ID=1)
    mem = eng.memory.add(memory_type="memory", size=6 << 30)
    mem.topology.nodes.add(ID=1)
    mem.topology.nodes.add(ID=0)
    eng.memory.add(memory_type="hugepages-2Mi", size=0).topology.nodes.add(ID=1)
    r.pod_resources.add(name="shared", namespace="llm").containers.add(name="engine")
    r.pod_resources.add(name="other", namespace="kube-system").containers.add(name="c", cpu_ids=[7])
    return r.SerializeToString()


def test_decodes_what_protobuf_encodes(messages):
    pods = decode_list(response(messages))
    assert [(p.namespace, p.name) for p in pods] == [("llm", "smollm2-abc-0"), ("llm", "shared"), ("kube-system", "other")]
    eng = pods[0].containers[1]
    assert eng.name == "engine" and eng.cpu_ids == [2, 3, 32, 33]
    assert eng.memory_numa == {"memory": [0, 1], "hugepages-2Mi": [1]}
    assert pods[1].containers[0].cpu_ids == [] and pods[2].containers[0].cpu_ids == [7]
    assert decode_list(b"") == []


def test_rejects_truncated_input(messages):
    with pytest.raises(ValueError):
        decode_list(response(messages)[:-3])


def test_annotations_only_for_the_engine_containers_of_the_given_pods(messages):
    pods = [{"metadata": {"namespace": "llm", "name": n}} for n in ("smollm2-abc-0", "shared", "gone")]
    out = assignments(pods, decode_list(response(messages)))
    assert json.loads(out[("llm", "smollm2-abc-0")]) == {"cpus": "2-3,32-33", "memoryNodes": [0, 1]}
    assert out[("llm", "shared")] == ""        # no exclusive CPUs: the shared pool
    assert ("llm", "gone") not in out          # the kubelet does not know it (yet)


def allocatable(m, cpus=(), mem_nodes=()) -> bytes:
    r = m["AllocatableResourcesResponse"](cpu_ids=list(cpus))
    for n in mem_nodes:
        r.memory.add(memory_type="memory", size=30 << 30).topology.nodes.add(ID=n)
    return r.SerializeToString()


def test_kubelet_policies_from_what_it_can_allocate(messages):
    static = decode_allocatable(allocatable(messages, [9, 1, 2, 3, 8], [1, 0]))
    assert static.cpu_ids == [1, 2, 3, 8, 9] and static.memory_numa == {"memory": [0, 1]}
    assert kubelet_policies(static) == {"cpuManagerPolicy": "static", "memoryManagerPolicy": "Static",
                                        "exclusiveCPUs": "1-3,8-9", "memoryNodes": [0, 1]}
    none = kubelet_policies(decode_allocatable(allocatable(messages)))
    assert (none["cpuManagerPolicy"], none["memoryManagerPolicy"]) == ("none", "None")
    cpu_only = kubelet_policies(decode_allocatable(allocatable(messages, [1])))
    assert (cpu_only["cpuManagerPolicy"], cpu_only["memoryManagerPolicy"]) == ("static", "None")


def test_list_over_grpc_on_a_unix_socket(messages, tmp_path):
    sock = tmp_path / "kubelet.sock"
    body = response(messages)
    alloc = allocatable(messages, [1, 2, 3], [0])
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(lambda req, ctx: body, request_deserializer=lambda b: b,
                                                    response_serializer=lambda b: b),
        "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: alloc, request_deserializer=lambda b: b, response_serializer=lambda b: b)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), handlers=[handler])
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        assert LIST == "/v1.PodResourcesLister/List"
        pods = list_pod_resources(str(sock))
        assert pods[0].containers[1].cpu_ids == [2, 3, 32, 33]
        assert ALLOCATABLE == "/v1.PodResourcesLister/GetAllocatableResources"
        assert allocatable_resources(str(sock)).cpu_ids == [1, 2, 3]
    finally:
        server.stop(None)
