"""One engine's offline workloads, run by `benchmarks/peers.py` in that engine's own
interpreter (cpuserve's and transformers' in the project's .venv, vLLM's in its own
virtualenv), so it imports nothing of cpuserve at module level. Prints one JSON line:

- ready_s: start of this process to the engine constructed (the model already converted);
- offline_tok_s: 64 prompts x 128 random token ids, 128 greedy output tokens each, EOS ignored;
- batch1_ms: decode ms/token at batch 1, (t(129 tokens) - t(1 token)) / 128, best of 3;
- prefill_2048_s: a 2,048-token prompt to its first token, best of 3 (a new prompt each time,
  so that no prefix cache helps);
- peak_rss_mib: this process and its children (vLLM's engine core runs in a child).

With --batch1-only, only ready_s and batch1_ms (peers.py's alternating batch-1 rounds). With
--prefill-turns, a worker for peers.py's prefill rounds: "READY" once warm, then for each line read
from stdin one new 2,048-token prompt to its first token, answered "PREFILL <seconds>".
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import time

T0 = time.perf_counter()
NUM, IN_LEN, OUT_LEN, LONG = 64, 128, 128, 2048


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


class CpuServe:
    def __init__(self, model: str, dtype: str):
        """dtype "gguf": the GGUF's blocks as they are (float32 activations; "gguf-int8": int8 dot products on
        activations quantized per block); "w8a8": an INT8 W8A8 checkpoint's int8 weights (activations quantized
        per token), bfloat16 for the rest (the LM head, the KV cache); else every weight widened."""
        from cpuserve import LLM, SamplingParams
        gguf = dtype.startswith("gguf")
        quant = "gguf" if gguf else "compressed-tensors" if dtype == "w8a8" else "none"
        self.llm = LLM(model, dtype="float32" if gguf else "bfloat16" if dtype == "w8a8" else dtype, quantization=quant,
                       quantized_activations="int8" if dtype == "gguf-int8" else "none", kv_cache_space=4.0,
                       max_num_batched_tokens=LONG)
        self.sp = SamplingParams

    def generate(self, batch: list[list[int]], tokens: int) -> None:
        self.llm.generate(batch, self.sp(temperature=0, max_tokens=tokens, ignore_eos=True))


class Vllm:
    def __init__(self, model: str, dtype: str):
        from vllm import LLM, SamplingParams
        # "w8a8": the checkpoint's compressed-tensors int8 weights (vLLM's oneDNN W8A8), bfloat16 elsewhere
        self.llm = LLM(model=model, dtype="bfloat16" if dtype == "w8a8" else dtype, max_model_len=4096,
                       max_num_batched_tokens=LONG, seed=0)
        self.sp = SamplingParams

    def generate(self, batch: list[list[int]], tokens: int) -> None:
        self.llm.generate([{"prompt_token_ids": p} for p in batch],
                          self.sp(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)


class Transformers:
    def __init__(self, model: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def generate(self, batch: list[list[int]], tokens: int) -> None:
        ids = self.torch.tensor(batch)
        with self.torch.inference_mode():
            self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, pad_token_id=0)


def best(fn, repeats: int = 3) -> float:
    out = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        out = min(out, time.perf_counter() - t0)
    return out


def prefill_turns(eng) -> None:
    """Waits idle between prompts while the other engine runs its own (peers.prefill_in_turns)."""
    import sys
    eng.generate(prompts(1, LONG, 5), 1)
    print("READY", flush=True)
    for i, _ in enumerate(sys.stdin):
        prompt = prompts(1, LONG, 1000 + i)
        t0 = time.perf_counter()
        eng.generate(prompt, 1)
        print(f"PREFILL {time.perf_counter() - t0}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["cpuserve", "vllm", "transformers"])
    ap.add_argument("model")
    ap.add_argument("dtype", choices=["float32", "bfloat16", "gguf", "gguf-int8", "w8a8"])
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--batch1-only", action="store_true", help="only batch1_ms (and ready_s)")
    ap.add_argument("--prefill-turns", action="store_true", help="a worker of peers.prefill_in_turns")
    a = ap.parse_args()
    eng = {"cpuserve": CpuServe, "vllm": Vllm, "transformers": Transformers}[a.engine](a.model, a.dtype)
    res = {"ready_s": time.perf_counter() - T0}
    eng.generate(prompts(2, 16, 1), 4)  # warm-up
    if a.prefill_turns:
        return prefill_turns(eng)
    if not a.batch1_only:
        batch = prompts(NUM, IN_LEN, 2)
        t0 = time.perf_counter()
        eng.generate(batch, OUT_LEN)
        res["offline_tok_s"] = NUM * OUT_LEN / (time.perf_counter() - t0)
    one = prompts(1, IN_LEN, 3)
    res["batch1_ms"] = (best(lambda i: eng.generate(one, OUT_LEN + 1)) - best(lambda i: eng.generate(one, 1))) \
        / OUT_LEN * 1e3
    if not a.skip_prefill and not a.batch1_only:
        longs = prompts(3, LONG, 4)
        res["prefill_2048_s"] = best(lambda i: eng.generate([longs[i]], 1))
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    res["peak_rss_mib"] = rss / 1024
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: nothing may run at import
    main()
