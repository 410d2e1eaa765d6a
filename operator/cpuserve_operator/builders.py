"""Kubernetes objects for a CPUModelServer: one pod per placement, a Service, a
PodDisruptionBudget, an optional Ingress and an optional ServiceMonitor. Pure functions of the spec and the placement; names are
deterministic (server, spec hash, replica index) so that a reconcile that runs
twice creates nothing twice."""
from __future__ import annotations

from cpuserve_operator.placement import NODE_LOST_TOLERATIONS, GiB, Placement, ServerSpec

GROUP, VERSION, PLURAL, KIND = "cpuserve.dev", "v1alpha1", "cpumodelservers", "CPUModelServer"
SERVICE_MONITOR = ("monitoring.coreos.com", "v1", "servicemonitors")  # the Prometheus Operator's
L_SERVER, L_REPLICA, L_HASH = "cpuserve.dev/server", "cpuserve.dev/replica", "cpuserve.dev/spec-hash"
A_SLOT, A_CPUS = "cpuserve.dev/slot", "cpuserve.dev/cpus"
A_ASSIGNED = "cpuserve.dev/assigned"  # the node agent: {"cpus", "memoryNodes"} the kubelet gave the engine
A_BOUND = "cpuserve.dev/bound"        # the node agent: {"cpus", "memoryNodes"} the engine bound to (its /topology)
SHM_BYTES_PER_RANK = 2 * 4 << 20      # the engine's all-reduce slots (2 parities x 4 MiB per rank)
MODEL_MOUNT = "/models"


def owner_ref(cr: dict) -> dict:
    meta = cr["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def selector(name: str) -> dict:
    return {L_SERVER: name}


def pod_name(spec: ServerSpec, index: int) -> str:
    return f"{spec.name}-{spec.hash()[:6]}-{index}"


def engine_args(spec: ServerSpec) -> list[str]:
    args = ["serve"]
    source = spec.model_source
    if source.startswith("file://"):
        args.append(source[len("file://"):])
    elif source.startswith("pvc://"):
        claim, _, path = source[len("pvc://"):].partition("/")
        args.append(f"{MODEL_MOUNT}/{claim}/{path}".rstrip("/"))
    elif source.startswith("image://"):  # an OCI image (or artifact) of the model, mounted read-only
        args.append(f"{MODEL_MOUNT}/image/{spec.model_path}".rstrip("/"))
    elif fetched(spec):  # downloaded and verified by the init container
        args.append(fetched(spec))
    # packaged://...: the image's default model, no argument
    args += ["--host", "0.0.0.0", "--port", str(spec.port), "--served-model-name", spec.served_name,
             "--dtype", spec.dtype, "--max-num-seqs", str(spec.max_num_seqs),
             "--tensor-parallel-size", str(spec.ranks)]
    if spec.max_model_len:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.root_path:  # the Ingress's prefix, which reaches the server as clients sent it
        args += ["--root-path", spec.root_path]
    if spec.lora_adapters:
        args += ["--enable-lora", "--max-loras", str(len(spec.lora_adapters)), "--max-lora-rank",
                 str(spec.max_lora_rank), "--lora-modules", *(f"{a[0]}={lora_dir(a)}" for a in spec.lora_adapters)]
    return args + list(spec.extra_args)


def lora_dir(adapter: tuple[str, str, str]) -> str:
    """Where a LoRA adapter is in the engine container: its image volume's mount, or the file:// path."""
    name, source, path = adapter
    if source.startswith("file://"):
        return source[len("file://"):]
    return f"{MODEL_MOUNT}/lora/{name}/{path}".rstrip("/")


def engine_env(spec: ServerSpec, p: Placement) -> list[dict]:
    # the reference's own defaults, made explicit: none with one rank, one core per rank with several
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0" if spec.ranks == 1 else "1", "CPUSERVE_CACHE": "/var/cache/cpuserve"}
    if spec.kv_cache_gib is not None:  # else the engine sizes it from the pod's memory limit (and logs how)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{spec.kv_cache_gib:g}"
    if p.rank_cpus:  # the engine binds itself to its slot (placement.engine_binds says when)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cpus)) for cpus in p.rank_cpus)
        env["CPU_VISIBLE_MEMORY_NODES"] = ",".join(map(str, p.slot.numa))
    else:  # the kubelet's static managers give the pod its cpuset and memory nodes; bind inside them
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    out = [{"name": k, "value": v} for k, v in env.items()]
    if spec.api_key_secret:  # the bearer token the API asks for; /health (the probes) stays open
        name, key = spec.api_key_secret
        out.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return out


def container_security(spec: ServerSpec) -> dict:
    """Nothing but what the engine needs: no capability under a Localhost profile (it must allow
    the NUMA calls itself, as the chart's cpuserve/numa.json does: Pod Security `restricted`),
    else CAP_SYS_NICE, which RuntimeDefault wants before it allows mbind and set_mempolicy
    (`baseline` forbids that capability: such namespaces need `privileged`)."""
    caps = {"drop": ["ALL"]}
    if spec.seccomp_type != "Localhost":
        caps["add"] = ["SYS_NICE"]
    return {"capabilities": caps, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True}


def _probe(port_name: str, **kw) -> dict:
    return {"httpGet": {"path": "/health", "port": port_name}, **kw}


def tolerations(node_lost_grace_s: float) -> list[dict]:
    """The taint manager evicts the pod once its node has been NotReady or unreachable this
    long (the operator's grace for a lost node: both act at the same time, not at once)."""
    return [{**t, "tolerationSeconds": int(node_lost_grace_s)} for t in NODE_LOST_TOLERATIONS]


def fetched(spec: ServerSpec) -> str | None:
    """Where an http(s):// or s3:// model lands in the pod (its file name under the fetch volume)."""
    if not spec.model_source.startswith(("http://", "https://", "s3://")):
        return None
    name = spec.model_source.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1] or "model"
    return f"{MODEL_MOUNT}/fetched/{name}"


def fetch_container(spec: ServerSpec, resources: dict) -> dict:
    """The init container that downloads the model into the pod's model volume and verifies
    its SHA-256 (`cpuserve fetch`): the engine starts only on a verified file."""
    return {"name": "fetch-model", "image": spec.image, "imagePullPolicy": spec.pull_policy,
            "command": ["cpuserve", "fetch", spec.model_source, "--sha256", spec.model_sha256, "--dest", fetched(spec)],
            "resources": {"requests": dict(resources), "limits": dict(resources)},
            "securityContext": {"capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True, "runAsNonRoot": True},
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [{"name": "model", "mountPath": f"{MODEL_MOUNT}/fetched"},
                             {"name": "tmp", "mountPath": "/tmp"}]}


def model_claim(spec: ServerSpec) -> str | None:
    return spec.model_source[len("pvc://"):].partition("/")[0] if spec.model_source.startswith("pvc://") else None


def claim_rule(access_modes: list[str] | None, replicas: int) -> tuple[bool, str | None]:
    """(all replicas on one node, refusal) for a pvc:// model claim with these access modes
    (None: the claim does not exist). Pure."""
    modes = set(access_modes or [])
    if access_modes is None:
        return False, "not found"
    if modes & {"ReadOnlyMany", "ReadWriteMany"}:
        return False, None
    if modes == {"ReadWriteOncePod"}:
        return False, None if replicas <= 1 else "is ReadWriteOncePod: one pod only; give replicas a ReadOnlyMany claim"
    return True, None  # ReadWriteOnce: one node can mount it, so every replica runs there


def pod_volumes(spec: ServerSpec) -> tuple[list[dict], list[dict]]:
    """The engine pod's volumes and the engine container's mounts of them: shared memory for the
    ranks' channels, writable cache and /tmp beside a read-only root filesystem, and the model."""
    shm = SHM_BYTES_PER_RANK * spec.ranks + (64 << 20)
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm)}},
               {"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": "/var/cache/cpuserve"},
              {"name": "tmp", "mountPath": "/tmp"}]
    if spec.model_source.startswith("pvc://"):
        claim = spec.model_source[len("pvc://"):].partition("/")[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{MODEL_MOUNT}/{claim}", "readOnly": True})
    elif spec.model_source.startswith("image://"):  # Kubernetes image volumes: pulled like images, read-only
        volumes.append({"name": "model", "image": {"reference": spec.model_source[len("image://"):],
                                                   "pullPolicy": spec.pull_policy}})
        mounts.append({"name": "model", "mountPath": f"{MODEL_MOUNT}/image", "readOnly": True})
    elif fetched(spec):  # the init container's download: kept across container restarts, not pod replacements
        volumes.append({"name": "model", "emptyDir": {"sizeLimit": f"{int(spec.size_gib * 1.25 * 1024) + 64}Mi"}})
        mounts.append({"name": "model", "mountPath": f"{MODEL_MOUNT}/fetched", "readOnly": True})
    for i, (name, source, _) in enumerate(spec.lora_adapters):  # image:// adapters: image volumes too
        if source.startswith("image://"):
            volumes.append({"name": f"lora-{i}", "image": {"reference": source[len("image://"):],
                                                           "pullPolicy": spec.pull_policy}})
            mounts.append({"name": f"lora-{i}", "mountPath": f"{MODEL_MOUNT}/lora/{name}", "readOnly": True})
    return volumes, mounts


def engine_container(spec: ServerSpec, p: Placement, resources: dict, mounts: list[dict]) -> dict:
    return {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.pull_policy,
        "command": ["cpuserve"],
        "args": engine_args(spec),
        "env": engine_env(spec, p),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        # a failed start's last log lines become its termination message, read into status
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": dict(resources), "limits": dict(resources)},  # Guaranteed QoS
        "securityContext": container_security(spec),
        "startupProbe": _probe("http", periodSeconds=5, failureThreshold=120, timeoutSeconds=3),
        "readinessProbe": _probe("http", periodSeconds=5, failureThreshold=2, timeoutSeconds=3),
        "livenessProbe": _probe("http", periodSeconds=10, failureThreshold=3, timeoutSeconds=5),
        "volumeMounts": mounts,
    }


def build_pod(cr: dict, spec: ServerSpec, p: Placement, node_lost_grace_s: float = 300) -> dict:
    name = pod_name(spec, p.index)
    resources = {"cpu": str(p.cpus), "memory": str(p.memory)}
    seccomp = {"type": spec.seccomp_type}
    if spec.seccomp_type == "Localhost":
        seccomp["localhostProfile"] = spec.seccomp_localhost
    volumes, mounts = pod_volumes(spec)
    annotations = {A_SLOT: p.slot.key}
    if p.rank_cpus:
        annotations[A_CPUS] = "|".join(",".join(map(str, c)) for c in p.rank_cpus)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": cr["metadata"]["namespace"],
            "labels": {"app.kubernetes.io/name": "cpuserve", "app.kubernetes.io/instance": spec.name,
                       "app.kubernetes.io/managed-by": "cpuserve-operator", L_SERVER: spec.name,
                       L_REPLICA: str(p.index), L_HASH: spec.hash()},
            "annotations": annotations,
            "ownerReferences": [owner_ref(cr)],
        },
        "spec": {
            # The operator is the placer: it knows NUMA slots the scheduler does not. The
            # kubelet still admits the pod (and may reject it: OutOfcpu, TopologyAffinityError).
            "nodeName": p.slot.node,
            "nodeSelector": {"kubernetes.io/arch": p.arch, **dict(p.isa_labels)},
            "restartPolicy": "Always",
            "tolerations": tolerations(node_lost_grace_s) + [dict(t) for t in spec.tolerations],
            "terminationGracePeriodSeconds": 30,
            # the engine image's user; the root filesystem stays read-only (cache and /tmp are volumes)
            "securityContext": {"seccompProfile": seccomp, "runAsNonRoot": True, "runAsUser": 1000,
                                "runAsGroup": 1000, "fsGroup": 1000},
            **({"imagePullSecrets": [{"name": s} for s in spec.pull_secrets]} if spec.pull_secrets else {}),
            **({"initContainers": [fetch_container(spec, resources)]} if fetched(spec) else {}),
            "containers": [engine_container(spec, p, resources, mounts)],
            "volumes": volumes,
        },
    }


def build_service(cr: dict, spec: ServerSpec) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": spec.name, "namespace": cr["metadata"]["namespace"],
                     "labels": {"app.kubernetes.io/name": "cpuserve", L_SERVER: spec.name},
                     "ownerReferences": [owner_ref(cr)]},
        "spec": {"type": spec.service_type, "selector": selector(spec.name),
                 "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}]},
    }


def build_pdb(cr: dict, spec: ServerSpec) -> dict:
    """At most one of the server's pods evicted at a time (a node drain, a cluster autoscaler's
    scale-down): with replicas on several NUMA nodes of one machine, a drain would otherwise take
    them all at once. Pods that are not ready may go regardless (AlwaysAllow), so a crash-looping
    replica never blocks a drain. The operator's own rolls delete pods and are not held by it."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": spec.name, "namespace": cr["metadata"]["namespace"],
                     "labels": {"app.kubernetes.io/name": "cpuserve", L_SERVER: spec.name},
                     "ownerReferences": [owner_ref(cr)]},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(spec.name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def build_ingress(cr: dict, spec: ServerSpec) -> dict | None:
    ing = spec.ingress
    if not ing.get("enabled"):
        return None
    rule = {"http": {"paths": [{"path": ing.get("path", "/"), "pathType": "Prefix",
                                "backend": {"service": {"name": spec.name, "port": {"number": spec.port}}}}]}}
    if ing.get("host"):
        rule["host"] = ing["host"]
    body = {"rules": [rule]}
    if ing.get("className"):
        body["ingressClassName"] = ing["className"]
    if ing.get("tls"):
        body["tls"] = [{"hosts": [ing["host"]], "secretName": f"{spec.name}-tls"}]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {"name": spec.name, "namespace": cr["metadata"]["namespace"],
                     "labels": {"app.kubernetes.io/name": "cpuserve", L_SERVER: spec.name},
                     "ownerReferences": [owner_ref(cr)]},
        "spec": body,
    }


def build_service_monitor(cr: dict, spec: ServerSpec) -> dict | None:
    """monitoring.serviceMonitor: Prometheus scrapes every pod behind the Service on its port's
    /metrics (the engine's, open without the API key), at the spec's interval; the spec's labels
    are the ones a Prometheus selects its monitors by."""
    sm = spec.service_monitor
    if sm is None:
        return None
    return {
        "apiVersion": f"{SERVICE_MONITOR[0]}/{SERVICE_MONITOR[1]}", "kind": "ServiceMonitor",
        "metadata": {"name": spec.name, "namespace": cr["metadata"]["namespace"],
                     "labels": {**sm["labels"], "app.kubernetes.io/name": "cpuserve", L_SERVER: spec.name},
                     "ownerReferences": [owner_ref(cr)]},
        "spec": {"selector": {"matchLabels": {L_SERVER: spec.name}},
                 "endpoints": [{"port": "http", "path": "/metrics", "interval": sm["interval"]}]},
    }


def endpoint(cr: dict, spec: ServerSpec) -> str:
    if spec.ingress.get("enabled") and spec.ingress.get("host"):
        scheme = "https" if spec.ingress.get("tls") else "http"
        return f"{scheme}://{spec.ingress['host']}{spec.ingress.get('path', '/').rstrip('/')}/v1"
    return f"http://{spec.name}.{cr['metadata']['namespace']}.svc:{spec.port}/v1"


def memory_gib(p: Placement) -> float:
    return p.memory / GiB
