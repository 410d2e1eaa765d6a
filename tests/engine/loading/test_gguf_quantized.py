"""A GGUF runs in its blocks: the default model (Q4_1 layers, a Q8_0 embedding tied to the
LM head) loads without widening, its resident weights are the file's size, the process
never holds a float32 copy, and its logits equal those of the widened model exactly."""
import json
import subprocess
import sys

import pytest
import torch

from cpuserve import LLM, SamplingParams
from cpuserve.loading import gguf_loader
from cpuserve.loading.model_loader import checkpoint_quantization, default_model_path, resolve
from cpuserve.loading.quant_tensor import QuantTensor
from cpuserve.model_executor import ops

MiB = 2 ** 20


def test_tensors_come_in_their_blocks_with_the_rotary_rows_unpermuted():
    model_dir = resolve(None)
    assert checkpoint_quantization(model_dir, None) == "gguf"
    quant = gguf_loader.GGUFTensors(model_dir)
    widened = gguf_loader.GGUFTensors(model_dir, dequantize=True)
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        q, w = quant.pop(name), widened.pop(name)
        assert isinstance(q, QuantTensor) and w.dtype == torch.float32
        assert q.type_name == ("Q8_0" if "embed" in name else "Q4_1")
        assert torch.equal(q.dequantize(), w)
    norm = quant.pop("model.norm.weight")
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float32


def test_quantization_option_is_checked(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        checkpoint_quantization(resolve(None), "awq-ish")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        checkpoint_quantization(tmp_path, "gguf")
    assert checkpoint_quantization(tmp_path, None) == "none"


def test_logits_equal_the_widened_model_exactly(llm_f32):
    runner = llm_f32.engine.runner
    assert runner.quantization == "gguf"
    widened = LLM(quantization="none", dtype="float32", block_size=16, kv_cache_space=0.25)
    assert widened.engine.runner.quantization == "none"
    ids = llm_f32.get_tokenizer().encode("The three laws of thermodynamics are")
    assert torch.equal(runner.logits_for(ids), widened.engine.runner.logits_for(ids))
    # resident weights: the file's blocks (about 94 MiB), against 540 MB widened
    assert runner.weight_bytes < 1.02 * default_model_path().stat().st_size
    assert widened.engine.runner.weight_bytes > 4.5 * runner.weight_bytes
    head, embed = runner.model.lm_head.weight, runner.model.embed.weight
    assert head is embed and ops.storage_name(head) == "Q8_0"  # the tied table is packed once


# VmHWM, the peak resident set of this process image (ru_maxrss would start from the forking
# parent's size: Linux keeps it across execve).
PEAK_RSS = """
import json, re, sys
import torch, cpuserve.model_executor.ops  # the runtime first: its own memory is not the weights'
from cpuserve import LLM
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
before = hwm()
llm = LLM(quantization=sys.argv[1], dtype="float32", num_kv_blocks=8, block_size=16)
print(json.dumps({"peak_growth": hwm() - before, "weights": llm.engine.runner.weight_bytes}))
"""


def _load_peak(quantization: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, quantization], capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_float32_copy_of_the_weights_at_load_not_even_for_a_moment():
    resolve(None)  # the metadata conversion, once, outside the measured process
    kept, widened = _load_peak("auto"), _load_peak("none")
    # peak growth while loading: the blocks plus what the engine's start-up allocates besides
    # (the modules it imports, the tokenizer, the largest tensor in flight: the 30 MB embedding),
    # measured at 65-87 MiB (it varies from run to run), far from the 540 MB of float32 that
    # widening needs
    assert kept["weights"] < 100 * MiB
    assert kept["peak_growth"] < kept["weights"] + 128 * MiB, kept
    assert widened["peak_growth"] > 500 * MiB, widened


def test_greedy_generation_in_blocks_is_sensible(llm_f32):
    out = llm_f32.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
