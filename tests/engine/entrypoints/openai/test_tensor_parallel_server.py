"""`cpuserve serve --tensor-parallel-size 2`: the same greedy completions as the
single-rank server, the API process pinned as planned, and a dead rank taking
the whole server down (non-zero exit, error in the log) rather than hanging."""
import os
import time

import httpx
import psutil
import pytest

from tests.engine.conftest import PROMPTS
from cpuserve_topology import format_cpulist

from tests.engine.live_topology import allowed, allowed_nodes, core_of, node_cpus, node_of, threads_of_core
from tests.engine.entrypoints.openai.conftest import Server

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


def completions(server, prompts):
    out = []
    for p in prompts:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "smollm2", "prompt": p, "max_tokens": 32, "temperature": 0,
                             "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["text"], choice["logprobs"]["tokens"]))
    return out


def tp_workers(server):
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "cpuserve.worker.tp_worker" in " ".join(p.cmdline())]


def test_tp2_server_matches_tp1_and_dies_with_a_rank(server):
    want = completions(server, PROMPTS)
    core = None
    s = Server("--served-model-name", "smollm2", "--tensor-parallel-size", "2")
    try:
        assert completions(s, PROMPTS) == want
        workers = tp_workers(s)
        assert len(workers) == 1  # rank 1, on CPUs of one NUMA node that rank 0 (the engine core) does not use
        rank1 = set(workers[0].cpu_affinity())
        assert rank1 <= set(allowed()) and len({node_of(c) for c in rank1}) == 1
        ranks = httpx.get(s.url + "/topology").json()["ranks"]  # what the engine reports: the same CPUs
        assert [r["rank"] for r in ranks] == [0, 1] and ranks[1]["cpus"] == format_cpulist(rank1)
        core = workers[0].parent()  # rank 0, the engine core
        workers[0].kill()
        assert s.proc.wait(60) != 0
        log = s.output()
        assert "tensor-parallel rank 1" in log, log[-3000:]
    finally:
        s.stop()
    deadline = time.monotonic() + 10  # nothing left behind
    while core is not None and core.is_running() and core.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine core outlived its server"
        time.sleep(0.2)


def test_api_process_pinned_to_reserved_cpus():
    node = node_cpus(allowed_nodes()[0])  # one rank: the first node it may use
    reserved = threads_of_core(max(node, key=core_of))  # its last core, all that core's threads
    s = Server("--served-model-name", "smollm2", env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    try:
        api = psutil.Process(s.proc.pid)
        core = [p for p in api.children() if "spawn_main" in " ".join(p.cmdline())][0]
        assert sorted(api.cpu_affinity()) == reserved  # the reserved core: the last of the node
        assert set(core.cpu_affinity()) <= set(node) - set(reserved)  # engine threads on the rest
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200
        assert "API process pinned to reserved CPUs" in s.output()
    finally:
        s.stop()
