"""The engine command line exactly as a generated pod gives it (command, args,
env), run as a local process: it must serve /health and /v1/models. Volume
mount paths are mapped to local directories; nothing else is changed."""
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.engine.entrypoints.openai.conftest import free_port
from cpuserve_operator import builders as b
from cpuserve_operator.placement import NumaNode, Node, parse_spec, plan


def test_pod_command_serves_health_and_models(tmp_path):
    port = free_port()
    spec = parse_spec("local", {"model": {"source": "packaged://smollm2", "servedName": "smollm2"},
                                "engine": {"kvCacheGiB": 0.5, "maxModelLen": 512}, "service": {"port": port},
                                "placement": {"reservedCPUs": 0}})
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    (pl,) = plan(spec, [Node("here", "amd64", (NumaNode(0, cpus, 8 << 30),))]).placements
    pod = b.build_pod({"metadata": {"name": "local", "namespace": "default", "uid": "1"}}, spec, pl)
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    for m in c["volumeMounts"]:
        if m["mountPath"] != "/dev/shm":
            for k, v in env.items():
                if v.startswith(m["mountPath"]):
                    env[k] = str(tmp_path / m["name"]) + v[len(m["mountPath"]):]
    bindir = str(Path(sys.executable).parent)
    full_env = {**os.environ, **env, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    log = open(tmp_path / "engine.log", "w")
    proc = subprocess.Popen(c["command"] + c["args"], env=full_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "engine did not become healthy"
            time.sleep(0.5)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["smollm2"]
        text = (tmp_path / "engine.log").read_text()
        assert "binding (auto)" in text  # VLLM_CPU_OMP_THREADS_BIND=auto from the pod spec
    finally:
        proc.terminate()
        proc.wait(30)
