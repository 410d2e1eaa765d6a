"""`make bench`, structured-output part: what the grammar costs a decode step at batch 32.

32 sequences decode 64 tokens each, greedy, twice in one process: free, then each under a
regex of lower-case words that never completes, so both runs decode 64 steps of 32 rows
(a bounded pattern such as `[a-z ]{64}` would not: its tokens hold several characters, and
each sequence ends on EOS as soon as its pattern is complete). Reports the median step time of each and the grammar's own share (mask fill and
apply, timed inside the sampler). Writes docs/bench/structured.{md,json}.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from readme_tables import cpu_name, run_stamp

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench"
BATCH, TOKENS = 32, 64


def run(llm, spec) -> tuple[float, float]:
    """(median step seconds, seconds per step spent in the grammar's masks)."""
    from cpuserve import SamplingParams
    from cpuserve.worker import sampler as sampler_mod

    spent = [0.0]
    original = sampler_mod.Sampler._constrain

    def timed(self, *a):
        t0 = time.perf_counter()
        original(self, *a)
        spent[0] += time.perf_counter() - t0

    sampler_mod.Sampler._constrain = timed
    params = SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True, structured=spec)
    core, steps = llm.engine.core, []
    try:
        for i in range(BATCH):
            core.add_request(f"r{i}-{spec is not None}", [1, 504, 3458, 314, 216 + i], params)
        while core.has_unfinished():
            t0 = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t0)
    finally:
        sampler_mod.Sampler._constrain = original
    decode = steps[1:]  # the first step is the prefill
    assert len(decode) == TOKENS - 1, f"{len(steps)} steps: not every sequence decoded {TOKENS} tokens together"
    return statistics.median(decode), spent[0] / len(steps)


def main() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from cpuserve import LLM
    from cpuserve.structured.spec import GrammarSpec

    llm = LLM(dtype="float32", kv_cache_space=1.0)
    run(llm, None)  # warm-up
    free, _ = run(llm, None)
    spec = GrammarSpec("regex", "[a-z ,.]*")
    constrained, masks = run(llm, spec)
    res = {"cpu": cpu_name(), "cores": os.cpu_count(), "when": run_stamp(), "batch": BATCH, "free_step_ms": free * 1e3,
           "constrained_step_ms": constrained * 1e3, "mask_ms_per_step": masks * 1e3,
           "overhead_pct": 100 * (constrained / free - 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "structured.json").write_text(json.dumps(res, indent=1) + "\n")
    md = (f"Structured output at batch {BATCH} (`python benchmarks/structured_output.py`), {res['cpu']}, "
          f"{res['cores']} CPUs ({res['when']}), float32, SmolLM2-135M:\n\n| decode step | median ms |\n|---|---|\n"
          f"| free | {res['free_step_ms']:.1f} |\n| every row under a regex | {res['constrained_step_ms']:.1f} |\n"
          f"| of which the grammar's masks (fill + apply) | {res['mask_ms_per_step']:.1f} |\n\n"
          f"Cost of the constraint: {res['overhead_pct']:+.0f}% per step.\n")
    (OUT / "structured.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
