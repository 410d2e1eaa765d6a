"""The decoder stack in one native call per step (native_step) equals the Python layers bit
for bit: on the default model in its GGUF blocks (float and int8 activations), widened to
bfloat16 with a float8 cache,
and on the Llama-family variants (GQA, sliding window, qkv bias, QK-norm), over prefill
chunks and decode steps; tensor parallelism keeps the Python layers."""
import pytest
import torch

from cpuserve import LLM, SamplingParams
from cpuserve.model_executor import native_step
from tests.engine.conftest import PROMPTS
from tests.engine.model_executor.test_architectures import build_tiny


@pytest.fixture
def python_layers():
    """Runs the enclosed engine calls on the Python layers, then restores the native step."""
    yield lambda on: setattr(native_step, "ENABLED", not on)
    native_step.ENABLED = True


def _both(llm, python_layers, ids):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = []
    for py in (True, False):
        python_layers(py)
        logits = llm.engine.runner.logits_for(ids)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)]
        out.append((logits, tokens))
    assert getattr(llm.engine.runner.model, "_native", None) is not None  # the native stack did run
    return out


@pytest.mark.parametrize("kwargs", [dict(), dict(quantized_activations="int8"),
                                    dict(quantization="none", dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                                         max_num_batched_tokens=32)], ids=["gguf-blocks", "gguf-int8-dot", "bf16-fp8kv-chunks"])
def test_default_model_native_equals_python_layers(python_layers, kwargs):
    llm = LLM(**{"block_size": 16, "kv_cache_space": 0.25, **kwargs})
    ids = llm.get_tokenizer().encode(PROMPTS[5] * 3)
    (a, ta), (b, tb) = _both(llm, python_layers, ids)
    assert torch.equal(a, b) and ta == tb


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "qwen2", "qwen3"])
def test_llama_family_native_equals_python_layers(name, tmp_path_factory, llm_f32, python_layers):
    _, _, path = build_tiny(name, tmp_path_factory, llm_f32)
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_space=0.1)
    (a, ta), (b, tb) = _both(llm, python_layers, list(range(100, 140)))
    assert torch.equal(a, b) and ta == tb


def test_not_for_tensor_parallel_layers():
    class Layer:
        native_ok, attn = False, type("A", (), {"k_cache": torch.zeros(1)})()
    assert not native_step.NativeDecoder.applies(type("M", (), {"layers": [Layer()]})())
