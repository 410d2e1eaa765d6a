"""PEERS.md's table of where cpuserve's served levels went: its server's step counters and the API
process's CPU, only for the rows that have them (a peer's server has neither)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peers  # noqa: E402
import serving  # noqa: E402


def kinds(decode, mixed=(0, 0.0, 0), prefill=(0, 0.0, 0)):
    return {k: {"steps": v[0], "seconds": v[1], "tokens": v[2]}
            for k, v in (("decode", decode), ("mixed", mixed), ("prefill", prefill))}


def level(c, steps, cpu):
    return {"concurrency": c, "output_len": 128, "engine_steps": steps, "api_cpu_us_per_token": cpu}


def test_only_levels_with_step_counters_are_listed_with_their_api_cpu():
    p = serving.step_profile(kinds((0, 0.0, 0)), kinds((240, 5.16, 3768), (16, 2.2, 4160)), wall=8.0)
    res = {"cpuserve float32": {"levels": [level(16, p, 122.4)]},
           "vLLM float32": {"levels": [level(16, None, None)]},
           "cpuserve Q4_1": {"error": "server exited"}}
    lines = peers.served_steps_table(res)
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| engine")]
    assert rows == ["| cpuserve float32 | 16 | 92% | 240 / 21.5 / 15.7 | 16 / 137.5 / 260.0 | 0 | 122 |"]


def test_no_table_without_step_counters():
    assert peers.served_steps_table({"llama.cpp Q4_1": {"levels": [level(1, None, None)]}}) == []
