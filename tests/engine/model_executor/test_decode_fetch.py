"""How decode GEMVs fetch their weights (csrc/kernels/prefetch.hpp DecodeFetch): chosen for the
CPU's vendor, overridden by CPUSERVE_DECODE_FETCH (an unknown name refused with the names it
takes), and either way the same tokens and log-probabilities on the real model in float32, one
and two sequences a step (the 4- and 2-panel decode kernels that fetch ahead)."""
import os
import subprocess
import sys

import pytest

from cpuserve import LLM, SamplingParams, _C
from tests.engine.conftest import PROMPTS

PRINT_FETCH = "from cpuserve.model_executor import ops; from cpuserve import _C; print(_C.decode_fetch())"


def _python(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRINT_FETCH], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_vendor_choice():
    assert _C.decode_fetch_for("GenuineIntel") == "l2"
    assert _C.decode_fetch_for("AuthenticAMD") == "nta"
    assert _C.decode_fetch_for("") == "nta"


@pytest.mark.parametrize("name", ["nta", "l2"])
def test_environment_overrides(name):
    out = _python({"CPUSERVE_DECODE_FETCH": name})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == name


def test_unknown_name_refused():
    out = _python({"CPUSERVE_DECODE_FETCH": "t0"})
    assert out.returncode != 0
    assert "CPUSERVE_DECODE_FETCH='t0'" in out.stderr and "not one of: nta, l2" in out.stderr
    with pytest.raises(ValueError, match="not one of"):
        _C.set_decode_fetch("t0")


@pytest.fixture
def fetch():
    before = _C.decode_fetch()
    yield _C.set_decode_fetch
    _C.set_decode_fetch(before)


def test_same_tokens_and_logprobs_either_way(fetch):
    llm = LLM(dtype="float32", quantization="none", block_size=16, kv_cache_space=0.25)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = []
    for name in ("nta", "l2"):
        fetch(name)
        one = [llm.generate(p, params)[0].outputs[0] for p in PROMPTS[:2]]  # batch 1
        two = [o.outputs[0] for o in llm.generate(PROMPTS[2:4], params)]  # batch 2
        runs.append([(c.token_ids, c.logprobs) for c in one + two])
    assert runs[0] == runs[1]
