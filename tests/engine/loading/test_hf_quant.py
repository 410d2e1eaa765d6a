"""AWQ and GPTQ 4-bit checkpoints, made here from the default model's weights by `cpuserve
quantize` (round to nearest in their layouts), load into Q4_ZP blocks that dequantize to
exactly the weights the quantizer meant, run with the engine's quantized GEMM (group sizes
32 / 64 / 128, GPTQ act-order included) and stay close to the float model."""
import json
import math

import pytest
import torch

from cpuserve import LLM, SamplingParams
from cpuserve.entrypoints.quantize import quantize
from cpuserve.loading.hf_quant import QuantizedCheckpoint, quant_config
from cpuserve.loading.model_loader import LazyTensors, checkpoint_quantization, resolve
from cpuserve.loading.quant_tensor import QuantTensor
from tests.engine.engine.test_batch_invariance import TEXT

def nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of the text's next tokens."""
    lp = logits[:-1].log_softmax(-1)
    return float(-lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean())


def assert_native_step_equals_python_and_answers(llm, ids: list[int], logits: torch.Tensor) -> None:
    """A quantized model's native decoder stack runs the same GEMMs as its Python layers (the
    same bits), and the model still knows the capital of France: after the chat prompt and "The
    capital of France is", " Paris" with probability > 0.9 (a free greedy answer is a near-tie at
    its first token, "The" -1.88 against "L" -1.97 on the float model, so it is not asked for)."""
    from cpuserve.model_executor import native_step

    runner = llm.engine.runner
    assert getattr(runner.model, "_native", None) is not None
    native_step.ENABLED = False
    try:
        assert torch.equal(runner.logits_for(ids), logits)
    finally:
        native_step.ENABLED = True
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False) + "The capital of France is"
    lp = runner.logits_for(tok.encode(prompt))[-1].log_softmax(-1)
    assert tok.decode([int(lp.argmax())]) == " Paris" and float(lp.max()) > math.log(0.9)


CASES = {"awq-g64": ("awq", 64, False), "gptq-g128": ("gptq", 128, False), "gptq-g32-act-order": ("gptq", 32, True)}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    method, group, act = CASES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    reference = quantize(resolve(None), out, method, group, act)
    return request.param, out, reference


def test_blocks_dequantize_to_the_quantizers_weights(checkpoint):
    name, path, reference = checkpoint
    assert checkpoint_quantization(path, None) == CASES[name][0]
    tensors = QuantizedCheckpoint(LazyTensors(sorted(path.glob("*.safetensors"))), quant_config(path))
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        w = tensors.pop(key)
        assert isinstance(w, QuantTensor) and w.type_name == "Q4_ZP"
        assert (w.input_perm is not None) == CASES[name][2]
        assert torch.equal(w.dequantize(), reference[key])
        assert w.nbytes * 8 / w.shape[0] / w.shape[1] == 5  # 4-bit codes, scale and zero per 32


def test_engine_runs_the_blocks_close_to_the_float_model(checkpoint, llm_f32, monkeypatch):
    name, path, _ = checkpoint
    monkeypatch.setenv("CPUSERVE_GREEDY_HEAD", "0")  # the sizes below without the float32 head's greedy copies
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_space=0.25)
    runner = llm.engine.runner
    widened = LLM(str(path), dtype="float32", quantization="none", block_size=16, kv_cache_space=0.25)
    # 5 bits a layer weight; the float32 embedding and its tied head as they were (226 of 292 MB)
    assert runner.quantization == CASES[name][0] and runner.weight_bytes < 0.5 * widened.engine.runner.weight_bytes
    ids = llm_f32.get_tokenizer().encode(TEXT)
    got, want = runner.logits_for(ids), llm_f32.engine.runner.logits_for(ids)
    # 4-bit round to nearest of a 135M model already in Q4_1: on this fixed text the mean NLL
    # rises from 4.30 to 4.44 (AWQ g64), 4.66 (GPTQ g128), 4.59 (GPTQ g32 act-order)
    assert nll(got, ids) < nll(want, ids) + 0.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5
    # the same weights widened (quantization="none") give the same logits: exactly where the
    # input features keep their order, to float rounding under act-order's permuted sums
    ref = widened.engine.runner.logits_for(ids)
    if CASES[name][2]:
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
        assert getattr(runner.model, "_native", None) is None  # permuted inputs: the Python layers
    else:
        assert torch.equal(got, ref)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].text.strip()


def test_unsupported_variants_are_refused(tmp_path):
    for qc, msg in (({"quant_method": "awq", "bits": 8}, "only 4-bit"),
                    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "only the 'gemm' layout"),
                    ({"quant_method": "bitsandbytes"}, "not supported")):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        with pytest.raises(ValueError, match=msg):
            quant_config(tmp_path)
    with pytest.raises(ValueError, match="method awq, gptq or w8a8; group size"):
        quantize(resolve(None), tmp_path / "x", "awq", 48)
