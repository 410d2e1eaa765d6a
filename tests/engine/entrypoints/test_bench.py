"""`cpuserve bench`: the bound arithmetic, and a decode step's profile on the real model
(every category measured, the step's time accounted for, the timers removed afterwards)."""
import pytest
import torch

from cpuserve.entrypoints import bench


def test_bounds():
    b = bench.bounds(weight_bytes=500_000_000, params=125_000_000, read_gbs=25.0, gflops=250.0)
    assert b["batch1_ms"] == pytest.approx(20.0)          # 0.5 GB at 25 GB/s
    assert b["compute_tok_s"] == pytest.approx(1000.0)    # 250 GFLOP/s / 0.25 GFLOP a token


def test_profile_of_a_decode_step(llm_f32):
    from cpuserve.model_executor import ops
    linear = ops.linear
    weight_bytes, params = bench.model_size(llm_f32)
    # SmolLM2-135M's matrices in the GGUF's blocks: Q4_1 layers (5 bits), the Q8_0 head (8.5 bits)
    assert 120e6 < params < 140e6 and 0.65 * params < weight_bytes < 0.75 * params
    step, prof = bench.decode_steps(llm_f32, batch=4, tokens=4)
    assert {"GEMM", "attention", "sampler", "Python and scheduling", "rms_norm"} <= set(prof)
    assert all(v >= 0 for v in prof.values()) and prof["GEMM"] > prof["sampler"]
    assert ops.linear is linear  # the timers are gone
    assert not llm_f32.engine.core.has_unfinished()


def test_the_fused_gate_up_counts_as_gemm():
    """The gate/up projection with its SiLU-and-mul in one kernel (ops.linear_silu) is GEMM time,
    not 'Python and scheduling'."""
    import torch
    from cpuserve.model_executor import ops
    linear_silu = ops.linear_silu
    w = ops.PackedWeight(torch.randn(256, 64))
    with bench.StepProfile() as prof:
        ops.linear_silu(torch.randn(4, 64), w)
    assert prof.spent["GEMM"] > 0 and set(prof.spent) == {"GEMM"}
    assert ops.linear_silu is linear_silu


def test_the_report_sets_our_kernel_beside_torch_on_the_same_shape():
    """The machine line names torch's GEMM on the model's own shape next to ours (and reads a
    report from before that figure existed)."""
    machine = {"threads": 2, "read_gbs": 29.4, "torch_gflops": {"float32": 169.0, "bfloat16": 0.0},
               "kernel_gflops": {"float32": 115.0}}
    engine = {"weight_bytes": 540 << 20, "params": 134_000_000, "read_gbs": 29.4, "batch1_ms": 20.0,
              "batch1_bound_ms": 18.0, "batch1_of_bound": 0.9, "batch64_tok_s": 300.0, "batch64_gflops": 80.0,
              "batch64_of_kernel_peak": 0.7, "batch64_of_best_peak": 0.5, "profile": {}}
    old = bench.format_report({"machine": machine, "engines": {"float32": engine}})
    assert "cpuserve kernel [64 x hidden] x [hidden x ffn] float32 115" in old and "F.linear" not in old
    new = bench.format_report({"machine": {**machine, "torch_shape_gflops": {"float32": 76.4, "bfloat16": 31.0}},
                               "engines": {"float32": engine}})
    assert "float32 115; torch's F.linear on that shape float32 76, bfloat16 31" in new


def test_torch_on_the_same_shape_is_measured():
    assert bench.torch_linear_gflops(torch.float32, 8, 64, 96, repeats=2) > 0
