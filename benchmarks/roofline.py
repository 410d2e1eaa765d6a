"""`make bench`, roofline part: this machine's read bandwidth and GEMM peaks, where the default
model's decode sits against them (batch 1: the bandwidth bound; 64 sequences: the compute
bound), and the profile of a decode step. Writes docs/bench/roofline.{md,json}; the same
report is `cpuserve bench` on a user's own machine."""
from __future__ import annotations

import json
import os
from pathlib import Path

from readme_tables import cpu_name, run_stamp

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench"


def main() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from cpuserve.entrypoints import bench
    from cpuserve.model_executor.ops import KERNELS

    r = bench.run(batch=64, tokens=32)
    r.update(cpu=cpu_name(), cores=os.cpu_count(), isa=KERNELS.isa, when=run_stamp())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "roofline.json").write_text(json.dumps(r, indent=1) + "\n")
    md = (f"# Roofline and decode-step profile (`make bench`, or `cpuserve bench` on your machine)\n\n"
          f"Machine: {r['cpu']}, {r['cores']} CPUs, kernels: {r['isa']}; {r['when']}. "
          "Default model (SmolLM2-135M).\n\n"
          "```\n" + bench.format_report(r) + "\n```\n")
    (OUT / "roofline.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
