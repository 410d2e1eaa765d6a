"""Tensor parallelism on the real model: TP=2 (one core per rank on this
machine) gives the same greedy tokens as TP=1 in float32; a dead rank stops the
engine with an error naming it; a rank that cannot fit its NUMA node is refused.
Each engine runs in its own process with the default `auto` binding."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpuserve import SamplingParams
from tests.engine.conftest import PROMPTS
from tests.engine.live_topology import NUMA_FORBIDDEN, allowed, allowed_nodes, core_of, node_of, numa_calls_allowed

SCRIPT = str(Path(__file__).parent / "tp_script.py")


def run(mode, tp, prompts=None, timeout=300, kv_cache_dtype="auto", model=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TP_KV_CACHE_DTYPE=kv_cache_dtype,
               TP_MODEL=str(model or ""))
    args = [sys.executable, SCRIPT, mode, str(tp)] + ([json.dumps(prompts)] if prompts is not None else [])
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, r.stdout + r.stderr[-3000:]
    return json.loads(line[7:]), r.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_tp2_greedy_tokens_equal_tp1(llm_f32):
    want = [o.outputs[0].token_ids for o in
            llm_f32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))]
    got, log = run("generate", 2, PROMPTS)
    assert got["tokens"] == want
    assert all(calls > 0 and 0 <= wait <= secs for secs, calls, wait in got["comm"])  # both ranks took part
    # each thread on its own allowed CPU, the ranks on cores of their own, each rank on one NUMA node
    # (a node each where there are two), memory bound to it: what the kernel says of this machine
    ranks = [r["thread_cpus"] for r in got["ranks"]]
    assert all(ranks) and all(len(set(t)) == len(t) and set(t) <= set(allowed()) for t in ranks)
    assert not {core_of(c) for c in ranks[0]} & {core_of(c) for c in ranks[1]}
    nodes = [{node_of(c) for c in t} for t in ranks]
    assert all(len(n) == 1 for n in nodes) and (len(allowed_nodes()) < 2 or nodes[0] != nodes[1])
    if not numa_calls_allowed():
        pytest.skip(NUMA_FORBIDDEN)
    assert [r["membind"] for r in got["ranks"]] == [f"bound to node {min(n)}" for n in nodes]


def test_dead_rank_stops_the_engine():
    got, _ = run("kill-rank", 2, PROMPTS[:2])
    assert got["error"] is not None
    assert "rank 1" in got["error"] and ("exited with code -9" in got["error"] or "has died" in got["error"])


def test_rank_that_does_not_fit_its_node_is_refused():
    got, _ = run("too-big", 2)
    msg = got["error"]
    assert "does not fit its NUMA node 0" in msg and "KV cache" in msg and "GiB" in msg
    assert "VLLM_CPU_KVCACHE_SPACE" in msg


def test_a_rank_refusing_the_configuration_raises_what_rank_0_would():
    """Which rank checks its node first is a race: either way the caller gets a ValueError."""
    from cpuserve.worker.tp_ranks import RankFailure, rank_failure
    refused = rank_failure("tensor-parallel rank 1 failed to start", "ValueError: rank 1 does not fit its NUMA node 0")
    crashed = rank_failure("tensor-parallel rank 1 failed", "RuntimeError: comm closed")
    assert isinstance(refused, ValueError) and isinstance(refused, RankFailure)
    assert not isinstance(crashed, ValueError) and isinstance(crashed, RankFailure)
