"""`make bench-peers`' roofline table: each system's offline GFLOP/s against the best GEMM peak, and
the float32 and bfloat16 rows against the arithmetic peak of their own instructions."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peers  # noqa: E402

ENGINE = {"weight_bytes": 256 << 20, "params": 134_000_000, "batch64_tok_s": 1200.0, "batch64_gflops": 320.0,
          "batch64_of_kernel_peak": 0.8, "batch64_of_best_peak": 0.8, "profile": {}, "read_gbs": 35.0,
          "batch1_ms": 9.0, "batch1_bound_ms": 7.7, "batch1_of_bound": 0.85}
MACHINE = {"threads": 2, "read_gbs": 35.0, "torch_gflops": {"float32": 196.0, "bfloat16": 420.0},
           "kernel_gflops": {"float32": 228.0, "bfloat16": 405.0}}
OFFLINE = {"cpuserve bfloat16": {"offline_tok_s": [640.0, 644.7], "batch1_ms": [8.9, 9.0], "read_gbs": [34.0, 35.0]},
           "vLLM W8A8": {"offline_tok_s": [580.0, 590.0], "batch1_ms": [6.0, 6.2], "read_gbs": [34.0, 35.0]}}


def roofline(machine: dict) -> str:
    roof = {"machine": machine, "engines": {"bfloat16": ENGINE, "w8a8": {**ENGINE, "weight_bytes": 156 << 20}}}
    return "\n".join(peers.roofline_section(roof, OFFLINE))


def test_the_dtype_rows_are_set_against_their_arithmetic_peak():
    text = roofline({**MACHINE, "arith_gflops": {"float32": 231.0, "bfloat16": 462.0}})
    assert "(multiply-add chains in registers: float32 231, bfloat16 462 GFLOP/s)" in text
    assert "| cpuserve bfloat16 | 256 | 35.0 | 85% | 173 | 41% | 37% |" in text   # 644.7 tok/s x 2 x 134M
    assert "| vLLM W8A8 | 156 | 35.0 | 75% | 158 | 38% | – |" in text


def test_a_run_from_before_the_arithmetic_peak_says_so():
    assert "not measured in this run" in roofline(MACHINE)
