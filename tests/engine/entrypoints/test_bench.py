"""`cpuserve bench`: the bound arithmetic, and a decode step's profile on the real model
(every category measured, the step's time accounted for, the timers removed afterwards)."""
import pytest
import torch

from cpuserve.entrypoints import bench


def test_each_window_is_set_against_its_own_bandwidth():
    """0.5 GB a token: a window at 25 GB/s taking 25 ms is at 80% of its 20 ms bound; a window at
    50 GB/s taking 12.5 ms is at 80% too. Crossing them (the fast probe against the slow window)
    would give 40%; the median window is reported with the range."""
    r = bench.paired_fractions(500_000_000, [(25.0, 0.025), (50.0, 0.0125), (40.0, 0.0125)])
    assert r["batch1_of_bound"] == pytest.approx(0.8)
    assert r["batch1_of_bound_range"] == pytest.approx([0.8, 1.0])   # 12.5 ms bound at 40 GB/s, 12.5 ms taken
    assert r["batch1_ms"] == pytest.approx(12.5) and r["read_gbs"] == pytest.approx(40.0)
    assert r["batch1_bound_ms"] == pytest.approx(12.5) and r["read_gbs_range"] == pytest.approx([25.0, 50.0])
    with pytest.raises(ValueError, match="no windows"):
        bench.paired_fractions(1, [])


def test_batch1_windows_probe_around_each_run(llm_f32, monkeypatch):
    probes = iter([30.0, 33.0, 50.0, 41.0])
    monkeypatch.setattr(bench, "read_bandwidth", lambda **kw: next(probes))
    monkeypatch.setattr(bench, "line_transfer_ns", lambda: 42.0)
    windows = bench.batch1_windows(llm_f32, tokens=3, windows=2, probe_gib=0.001)
    assert [g for g, _, _ in windows] == [33.0, 50.0]   # the faster probe of each pair: the strict bound
    assert all(0 < step < 10 and ns == 42.0 for _, step, ns in windows)
    assert not llm_f32.engine.core.has_unfinished()


def test_profile_of_a_decode_step(llm_f32):
    """Timed inside the native decoder stack (the run the engine makes): its kernels by category,
    the LM head's GEMM and the sampler from Python's timers, the rest Python and scheduling."""
    from cpuserve.model_executor import ops
    linear = ops.linear
    weight_bytes, params = bench.model_size(llm_f32)
    # SmolLM2-135M's matrices in the GGUF's blocks: Q4_1 layers (5 bits), the Q8_0 head (8.5 bits)
    assert 120e6 < params < 140e6 and 0.65 * params < weight_bytes < 0.75 * params
    step, prof = bench.decode_steps(llm_f32, batch=4, tokens=4)
    assert {"GEMM", "attention", "sampler", "Python and scheduling", "rms_norm", "reshape_and_cache",
            "rotary", "fused_add_rms_norm"} <= set(prof)
    assert all(v >= 0 for v in prof.values()) and prof["GEMM"] > prof["sampler"]
    assert ops.linear is linear  # the timers are gone
    assert bench._native_stack(llm_f32).timings() == {}  # the stack's timing is off and emptied
    assert not llm_f32.engine.core.has_unfinished()


def test_profile_through_the_python_layers_where_they_run(llm_f32, monkeypatch):
    from cpuserve.model_executor import native_step
    monkeypatch.setattr(native_step, "ENABLED", False)
    assert bench._native_stack(llm_f32) is None
    _, prof = bench.decode_steps(llm_f32, batch=2, tokens=3, prompt_len=16)
    assert {"GEMM", "attention", "reshape_and_cache", "sampler", "Python and scheduling"} <= set(prof)


def test_timing_starts_after_the_whole_prefill():
    """Prompts longer than one step's token budget take several prefill steps (the first
    requests decoding beside the others' chunks); the timed steps are decode steps only: each
    request has its first token and one token left to compute."""
    from cpuserve import LLM, SamplingParams
    llm = LLM(dtype="float32", block_size=16, kv_cache_space=0.1, max_num_batched_tokens=64)
    core = llm.engine.core
    for i in range(3):
        core.add_request(f"p{i}", list(range(100 + i, 300 + i)), SamplingParams(max_tokens=16, ignore_eos=True))
    bench._prefill(core, 3)
    running = core.scheduler.running
    assert len(running) == 3 and all(s.num_output_tokens >= 1 and s.num_uncomputed == 1 for s in running)
    assert min(s.num_output_tokens for s in running) == 1  # the last prompt's prefill just ended


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
    assert "20.00 ms/token against a bound of 18.00 at 29.4 GB/s probed alongside (90%)" in old


def test_the_report_says_where_and_at_which_contexts_the_profile_was_timed():
    machine = {"threads": 2, "read_gbs": 35.0, "torch_gflops": {"float32": 196.0}, "kernel_gflops": {"bfloat16": 427.0}}
    engine = {"weight_bytes": 256 << 20, "params": 134_000_000, "batch64_tok_s": 900.0, "batch64_gflops": 240.0,
              "batch64_of_kernel_peak": 0.56, "batch64_of_best_peak": 0.56,
              **bench.paired_fractions(256 << 20, [(35.0, 0.0090)]), "batch1_windows": [[35.0, 9.0]],
              "profile": {"64": {"GEMM": 0.048, "attention": 0.015, "Python and scheduling": 0.001}}}
    old = bench.format_report({"machine": machine, "engines": {"bfloat16": engine}})
    assert "(134M params); batch 1:" in old and "decode step at batch 64 through the Python layers: 64.00 ms" in old
    new = bench.format_report({"machine": machine, "engines": {"bfloat16": {
        **engine, "profile_where": "native decoder stack", "contexts": [128, 160]}}})
    assert "(134M params); decoding after 128-token prompts; batch 1:" in new
    assert ("decode step at batch 64 (contexts 128-160), timed inside the native decoder stack: 64.00 ms = "
            "GEMM 48.00 ms (75%), attention 15.00 ms (23%), Python and scheduling 1.00 ms (2%)") in new


def test_the_report_gives_the_windows():
    machine = {"threads": 2, "read_gbs": 35.0, "torch_gflops": {"float32": 196.0}, "kernel_gflops": {"bfloat16": 427.0}}
    engine = {"weight_bytes": 256 << 20, "params": 134_000_000, "batch64_tok_s": 1200.0, "batch64_gflops": 320.0,
              "batch64_of_kernel_peak": 0.75, "batch64_of_best_peak": 0.75, "profile": {},
              **bench.paired_fractions(256 << 20, [(34.0, 0.0092), (55.0, 0.0060), (35.0, 0.0090)]),
              "batch1_windows": [[34.0, 9.2], [55.0, 6.0], [35.0, 9.0]]}
    text = bench.format_report({"machine": machine, "engines": {"bfloat16": engine}})
    assert "batch 1: 9.00 ms/token (median of 3 windows), each window 85% of its own bandwidth bound" in text
    assert "(median; 81-86%; read 34.0-55.0 GB/s around the windows, bound 7.67 ms at the median 35.0)" in text
    assert "cache line" not in text   # a report from before the threads' line transfer was measured


def test_the_report_gives_the_threads_line_transfer():
    machine = {"threads": 2, "read_gbs": 35.0, "torch_gflops": {"float32": 196.0}, "kernel_gflops": {"bfloat16": 427.0},
               "line_ns": 163.2}
    windows = [(34.0, 0.0092, 31.0), (55.0, 0.0060, 162.0), (35.0, 0.0090, None)]
    engine = {"weight_bytes": 256 << 20, "params": 134_000_000, "batch64_tok_s": 1200.0, "batch64_gflops": 320.0,
              "batch64_of_kernel_peak": 0.75, "batch64_of_best_peak": 0.75, "profile": {},
              **bench.paired_fractions(256 << 20, windows), "batch1_windows": [[g, s * 1e3, ns] for g, s, ns in windows]}
    text = bench.format_report({"machine": machine, "engines": {"bfloat16": engine}})
    assert "427; a cache line between the threads 163 ns\n" in text
    assert "bound 7.67 ms at the median 35.0; a cache line between the threads 31-162 ns)" in text


def test_the_report_sets_each_dtype_against_its_arithmetic_peak():
    machine = {"threads": 2, "read_gbs": 35.0, "torch_gflops": {"float32": 196.0}, "kernel_gflops": {"bfloat16": 405.0},
               "arith_gflops": {"float32": 231.0, "bfloat16": 462.0}}
    engine = {"weight_bytes": 256 << 20, "params": 134_000_000, "batch64_tok_s": 1200.0, "batch64_gflops": 346.5,
              "batch64_of_kernel_peak": 0.86, "batch64_of_best_peak": 0.86, "batch64_of_arith_peak": 0.75,
              "profile": {}, **bench.paired_fractions(256 << 20, [(35.0, 0.0090)])}
    text = bench.format_report({"machine": machine, "engines": {"bfloat16": engine}})
    assert "; arithmetic peak (multiply-add chains in registers) float32 231, bfloat16 462\n" in text
    assert "86% of the best GEMM peak, 75% of the arithmetic peak" in text
    old = bench.format_report({"machine": {k: v for k, v in machine.items() if k != "arith_gflops"},
                               "engines": {"bfloat16": {k: v for k, v in engine.items() if "arith" not in k}}})
    assert "arithmetic" not in old   # a report from before the peak was measured


def test_the_arithmetic_peaks_cover_both_dtypes():
    peaks = bench.arith_peaks()
    assert set(peaks) == {"float32", "bfloat16"} and peaks["bfloat16"] >= 0.5 * peaks["float32"] > 0


def test_torch_on_the_same_shape_is_measured():
    assert bench.torch_linear_gflops(torch.float32, 8, 64, 96, repeats=2) > 0


def test_the_cli_passes_the_prompt_length_and_refuses_what_cannot_be_measured(monkeypatch, capsys):
    from cpuserve.entrypoints import cli
    calls = []
    monkeypatch.setattr(bench, "run", lambda *a: calls.append(a) or {"engines": {}})
    assert cli.main(["bench", "--dtype", "bfloat16", "--prompt-len", "512", "--tokens", "8", "--json"]) == 0
    assert calls == [(("bfloat16",), 64, 8, 512)]
    for argv, got in ((["--tokens", "1"], "got 128, 64 and 1"), (["--prompt-len", "0"], "got 0, 64 and 32")):
        with pytest.raises(SystemExit) as refused:
            cli.main(["bench", *argv])
        assert refused.value.code == 2
        assert "cpuserve bench: error: --prompt-len and --batch must be >= 1 and --tokens >= 2" in \
            capsys.readouterr().err
    assert len(calls) == 1
