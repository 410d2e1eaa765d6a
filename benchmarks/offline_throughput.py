"""`make bench`, offline part: throughput and latency of the engine on the default
model, next to transformers `generate` measured in the same run.

Workload (as the reference figures): 64 prompts of 128 random token ids, 128
greedy output tokens each (ignore_eos). Every case runs in a fresh process so
that its peak RSS and start-up time are its own. This machine is a shared VM
whose speed drifts by tens of percent, so engine cases run REPEATS times and
the table gives the median and the range. Writes docs/bench/offline.{md,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import readme_tables

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench"
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 128
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


def prompts():
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 49000, (INPUT_LEN,), generator=g).tolist() for _ in range(NUM_PROMPTS)]


def case_engine(dtype: str) -> dict:
    """dtype "gguf": the default GGUF in its Q4_1 blocks ("gguf-int8": on int8 dot products, the
    activations quantized per block); "w8a8": its weights as an INT8 W8A8
    checkpoint (made once into the cache, before the clock starts); float32 / bfloat16: every
    weight widened."""
    from cpuserve.entrypoints.bench import engine_llm
    from cpuserve.entrypoints.quantize import default_w8a8
    if dtype == "w8a8":
        default_w8a8()
    t0 = time.perf_counter()
    from cpuserve import SamplingParams
    llm = engine_llm(dtype)
    ready = time.perf_counter() - t0
    runner = llm.engine.runner
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate({"prompt_token_ids": ps[0]}, SamplingParams(temperature=0, max_tokens=2))  # warm up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    total = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # batch 1: time to first token, then per-token decode latency
    eng = llm.engine
    eng.add_request("b1", ps[1], params)
    t = time.perf_counter()
    eng.step()
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    decode_ms = (time.perf_counter() - t) / steps * 1e3
    weights = runner.weight_bytes
    bs_tokens = runner.block_size
    per_token_kv = runner.kv_cache[0, 0, 0].numel() // bs_tokens * runner.kv_cache.element_size() \
        * runner.kv_cache.shape[0] * 2
    kv_touched = per_token_kv * NUM_PROMPTS * (INPUT_LEN + OUTPUT_LEN)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(dtype=dtype, ready_s=ready, load_s=runner.load_seconds, total_s=total, output_tokens=n_out,
                tok_per_s=n_out / total, ttft_ms=ttft * 1e3, decode_ms=decode_ms, weights_bytes=weights,
                kv_touched_bytes=kv_touched, kv_allocated_bytes=runner.kv_cache.numel() * runner.kv_cache.element_size(),
                peak_rss_bytes=rss, isa=__import__("cpuserve.model_executor.ops", fromlist=["KERNELS"]).KERNELS.isa)


def case_transformers() -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from cpuserve.loading.model_loader import default_model_path
    torch.set_num_threads(os.cpu_count() or 1)
    p = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    ids = torch.tensor(prompts())
    with torch.inference_mode():
        model.generate(ids[:2, :8], max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                             min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    n_out = (out.shape[1] - INPUT_LEN) * out.shape[0]
    return dict(dtype="float32", total_s=total, output_tokens=n_out, tok_per_s=n_out / total)


def case_cold_start() -> dict:
    """First start on a machine: GGUF converted into the cache, then loaded."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, CPUSERVE_CACHE=d)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "from cpuserve import LLM; LLM(dtype='float32')"], env=env,
                       check=True, capture_output=True)
        return dict(cold_start_s=time.perf_counter() - t)


def run_case(name: str) -> dict:
    r = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench case {name} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in runs]
    return statistics.median(vals), min(vals), max(vals)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    a = ap.parse_args()
    if a.case:
        fn = {"q4_1": lambda: case_engine("gguf"), "q4_1_i8": lambda: case_engine("gguf-int8"),
              "w8a8": lambda: case_engine("w8a8"),
              "f32": lambda: case_engine("float32"),
              "bf16": lambda: case_engine("bfloat16"),
              "hf": case_transformers, "cold": case_cold_start}[a.case]
        print(json.dumps(fn()))
        return

    OUT.mkdir(parents=True, exist_ok=True)
    results = {"q4_1": [], "q4_1_i8": [], "w8a8": [], "f32": [], "bf16": []}
    for i in range(REPEATS):
        for name in results:
            results[name].append(run_case(name))
            r = results[name][-1]
            print(f"[{name} run {i + 1}/{REPEATS}] {r['tok_per_s']:.1f} tok/s, batch-1 {r['decode_ms']:.2f} ms/token",
                  flush=True)
    hf = run_case("hf")
    print(f"[transformers] {hf['tok_per_s']:.1f} tok/s", flush=True)
    cold = run_case("cold")
    write_report(results, hf, cold)


def write_report(results: dict, hf: dict, cold: dict) -> None:
    rows = []
    for name, label in (("q4_1", "Q4_1 blocks"), ("q4_1_i8", "Q4_1 blocks, int8 activations"), ("w8a8", "INT8 W8A8"),
                        ("f32", "float32"), ("bf16", "bfloat16")):
        runs = results[name]
        tps, tps_lo, tps_hi = summarize(runs, "tok_per_s")
        dec, dec_lo, dec_hi = summarize(runs, "decode_ms")
        ttft, _, _ = summarize(runs, "ttft_ms")
        ready, _, _ = summarize(runs, "ready_s")
        r0 = runs[0]
        overhead = (max(r["peak_rss_bytes"] for r in runs) - r0["weights_bytes"] - r0["kv_touched_bytes"]) / 2**20
        rows.append(dict(label=label, tps=tps, tps_lo=tps_lo, tps_hi=tps_hi, dec=dec, dec_lo=dec_lo, dec_hi=dec_hi,
                         ttft=ttft, ready=ready, weights_mb=r0["weights_bytes"] / 2**20,
                         kv_mb=r0["kv_touched_bytes"] / 2**20, rss_mb=max(r["peak_rss_bytes"] for r in runs) / 2**20,
                         overhead_mb=overhead, ratio_hf=tps / hf["tok_per_s"],
                         total=summarize(runs, "total_s")[0], isa=r0["isa"]))
    cpu = readme_tables.cpu_name()
    lines = [
        "# Offline throughput and latency (`make bench`)",
        "",
        f"Machine: {cpu}, {os.cpu_count()} CPUs, kernels: {rows[0]['isa']}; {readme_tables.run_stamp()}. "
        f"Workload: {NUM_PROMPTS} prompts x "
        f"{INPUT_LEN} random input tokens, {OUTPUT_LEN} greedy output tokens each, default model "
        "(SmolLM2-135M-Instruct). Median of "
        f"{REPEATS} runs, range in brackets (this VM's speed drifts by tens of percent between runs).",
        "",
        "| engine | dtype | output tok/s | total s | vs transformers | batch-1 decode ms/token "
        "| batch-1 TTFT ms (128-token prompt) | ready s (warm) | weights MiB | KV used MiB | peak RSS MiB | RSS - weights - KV MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| cpuserve | {r['label']} | **{r['tps']:.1f}** [{r['tps_lo']:.1f}-{r['tps_hi']:.1f}] | {r['total']:.1f} | "
            f"{r['ratio_hf']:.2f}x | **{r['dec']:.2f}** [{r['dec_lo']:.2f}-{r['dec_hi']:.2f}] | "
            f"{r['ttft']:.0f} | {r['ready']:.2f} | {r['weights_mb']:.0f} | {r['kv_mb']:.0f} | {r['rss_mb']:.0f} | "
            f"{r['overhead_mb']:.0f} |")
    lines.append(f"| transformers generate (batch 64) | float32 | {hf['tok_per_s']:.1f} | {hf['total_s']:.1f} | 1.00x "
                 "| | | | | | | |")
    lines += ["", f"Cold start (GGUF converted into the cache, then loaded): {cold['cold_start_s']:.1f} s; later starts "
              "load the converted directory.", "",
              "vLLM's CPU backend and llama.cpp on the same workloads and machine, run side by side with cpuserve: "
              "`make bench-peers` (docs/bench/PEERS.md).", ""]
    (OUT / "offline.md").write_text("\n".join(lines))
    readme_tables.update("offline", lines[2:])
    (OUT / "offline.json").write_text(json.dumps({"engine": results, "transformers": hf, "cold": cold}, indent=2))
    plot(rows, hf)
    print("\n".join(lines))


def plot(rows: list[dict], hf: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"cpuserve\n{r['label']}" for r in rows] + ["transformers\nfloat32"]
    vals = [r["tps"] for r in rows] + [hf["tok_per_s"]]
    errs = [[r["tps"] - r["tps_lo"] for r in rows] + [0], [r["tps_hi"] - r["tps"] for r in rows] + [0]]
    colors = ["#2ca02c", "#8c564b", "#1f77b4", "#4a9be0", "#999999", "#d62728"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(labels, vals, yerr=errs, color=colors, capsize=4)
    for i, v in enumerate(vals):
        ax.text(i, v + 4, f"{v:.0f}", ha="center")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Offline throughput, {NUM_PROMPTS}x{INPUT_LEN} in / {OUTPUT_LEN} out, SmolLM2-135M, "
                 f"{os.cpu_count()} CPUs")
    fig.tight_layout()
    fig.savefig(OUT / "offline.png", dpi=110)


if __name__ == "__main__":
    main()
