"""The kubelet's pod-resources API (k8s.io/kubelet/pkg/apis/podresources/v1): which CPUs
and which NUMA nodes' memory the static CPU and memory managers gave each container.
The node agent reads it on its node and records the engine container's share on the pod,
so that the CR's status shows the CPUs the pod really has, not only how many it asked for.

The response is decoded here from the protobuf wire format (five nested messages, the
fields below), so the agent needs grpcio for the transport but no generated code."""
from __future__ import annotations

from dataclasses import dataclass, field

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST = "/v1.PodResourcesLister/List"
ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"


@dataclass
class ContainerResources:
    name: str = ""
    cpu_ids: list[int] = field(default_factory=list)
    memory_numa: dict[str, list[int]] = field(default_factory=dict)  # memory type -> NUMA node ids


@dataclass
class PodResources:
    name: str = ""
    namespace: str = ""
    containers: list[ContainerResources] = field(default_factory=list)


@dataclass
class Allocatable:
    """What the kubelet's managers may hand out exclusively: no CPU ids means the CPU manager
    policy is `none` (nothing is exclusive), no memory means the memory manager's is `None`."""
    cpu_ids: list[int] = field(default_factory=list)
    memory_numa: dict[str, list[int]] = field(default_factory=dict)


# -- protobuf wire format (https://protobuf.dev/programming-guides/encoding) -------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        result |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return result, i
        shift += 7


def fields(buf: bytes):
    """(field number, wire type, value) for each field: ints for varints, bytes for
    length-delimited fields; fixed 32/64-bit fields are skipped (none are used here)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
            if i > len(buf):
                raise ValueError("truncated field")
        elif wt in (1, 5):
            i += 8 if wt == 1 else 4
            continue
        else:
            raise ValueError(f"unsupported wire type {wt}")
        yield num, wt, v


def _int64s(wt: int, v) -> list[int]:
    """A repeated int64: packed (one length-delimited run) or one varint per element."""
    if wt == 0:
        return [v - (1 << 64) if v >> 63 else v]
    out, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        out.append(x - (1 << 64) if x >> 63 else x)
    return out


def _memory(buf: bytes) -> tuple[str, list[int]]:
    kind, nodes = "", []
    for num, _, v in fields(buf):
        if num == 1:
            kind = v.decode()
        elif num == 3:  # TopologyInfo { repeated NUMANode nodes = 1 } ; NUMANode { int64 ID = 1 }
            for n, _, node in fields(v):
                if n == 1:  # proto3 leaves out a zero ID: an empty NUMANode is node 0
                    ids = [i for k, wt, x in fields(node) if k == 1 for i in _int64s(wt, x)]
                    nodes += ids[-1:] or [0]
    return kind, sorted(nodes)


def _fill(into, buf: bytes, cpu_field: int, memory_field: int, name_field: int | None = None):
    """A message's CPU ids and NUMA memory (and name) into `into`: ContainerResources and
    AllocatableResourcesResponse carry the same things under different field numbers."""
    for num, wt, v in fields(buf):
        if num == name_field:
            into.name = v.decode()
        elif num == cpu_field:
            into.cpu_ids += _int64s(wt, v)
        elif num == memory_field:
            kind, nodes = _memory(v)
            into.memory_numa[kind] = sorted(set(into.memory_numa.get(kind, []) + nodes))
    into.cpu_ids.sort()
    return into


def _container(buf: bytes) -> ContainerResources:
    """ContainerResources { name = 1; devices = 2; repeated int64 cpu_ids = 3; repeated ContainerMemory memory = 4 }."""
    return _fill(ContainerResources(), buf, cpu_field=3, memory_field=4, name_field=1)


def decode_list(buf: bytes) -> list[PodResources]:
    """ListPodResourcesResponse { repeated PodResources pod_resources = 1 }."""
    pods = []
    for num, _, v in fields(buf):
        if num != 1:
            continue
        p = PodResources()
        for n, _, x in fields(v):
            if n == 1:
                p.name = x.decode()
            elif n == 2:
                p.namespace = x.decode()
            elif n == 3:
                p.containers.append(_container(x))
        pods.append(p)
    return pods


def decode_allocatable(buf: bytes) -> Allocatable:
    """AllocatableResourcesResponse { devices = 1; repeated int64 cpu_ids = 2; repeated ContainerMemory memory = 3 }."""
    return _fill(Allocatable(), buf, cpu_field=2, memory_field=3)


def allocatable_resources(socket: str = SOCKET, timeout: float = 10) -> Allocatable:
    import grpc

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        call = ch.unary_unary(ALLOCATABLE, request_serializer=lambda _: b"", response_deserializer=decode_allocatable)
        return call(None, timeout=timeout)


def list_pod_resources(socket: str = SOCKET, timeout: float = 10) -> list[PodResources]:
    import grpc

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        call = ch.unary_unary(LIST, request_serializer=lambda _: b"", response_deserializer=decode_list)
        return call(None, timeout=timeout)
