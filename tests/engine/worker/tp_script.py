"""Runs the offline engine in its own process with the default (`auto`) binding,
for the tensor-parallel tests: `python tp_script.py MODE TP [PROMPTS_JSON]`."""
import json
import os
import sys
import threading
import time

os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the real default, not the test runner's nobind

import torch  # noqa: E402

from cpuserve import LLM, SamplingParams  # noqa: E402


def main(mode: str, tp: int, prompts: list[str]) -> None:
    if mode == "too-big":
        try:
            LLM(dtype="float32", block_size=16, kv_cache_space=4096, tensor_parallel_size=tp)
        except ValueError as e:
            print("RESULT", json.dumps(dict(error=str(e))))
        return
    llm = LLM(os.environ.get("TP_MODEL") or None, dtype="float32", block_size=16, kv_cache_space=1.0,
              tensor_parallel_size=tp, kv_cache_dtype=os.environ.get("TP_KV_CACHE_DTYPE", "auto"))
    runner = llm.engine.runner
    if mode == "kill-rank":
        victim = runner.ranks.procs[1]
        threading.Timer(1.0, victim.kill).start()
        t0 = time.monotonic()
        try:
            llm.generate(prompts * 8, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
            print("RESULT", json.dumps(dict(error=None)))
        except RuntimeError as e:
            print("RESULT", json.dumps(dict(error=str(e), seconds=time.monotonic() - t0, pid=victim.pid)))
        return
    if mode == "score":  # logits of a fixed text: its mean NLL and the argmax at every position
        from tests.engine.engine.test_batch_invariance import TEXT
        ids = llm.get_tokenizer().encode(TEXT)
        logits = runner.logits_for(ids)
        lp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
        print("RESULT", json.dumps(dict(nll=float(-lp.mean()), argmax=logits.argmax(-1).tolist())))
        runner.close()
        return
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    ranks = [runner.binding.__dict__] + [info["binding"] for info in getattr(runner, "rank_info", [])]
    print("RESULT", json.dumps(dict(tokens=[o.outputs[0].token_ids for o in outs], ranks=ranks,
                                    comm=runner.comm_stats())))
    runner.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else [])
