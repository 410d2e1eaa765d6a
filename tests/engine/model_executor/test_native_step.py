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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_looks_tokens_up_as_torch_does(dtype):
    """The stack's own embedding lookup (no layers here): torch's index and .float(), and a clear
    error for an id outside the table (never read)."""
    from cpuserve import _C
    from cpuserve.model_executor import ops
    table = torch.randn(10, 8).to(dtype)
    stack = _C.DecoderStack(ops.KERNELS, 8, 16)
    stack.set_embedding(table.data_ptr(), ops.DTYPE_CODES[dtype], 10)
    ids = torch.tensor([3, 0, 9, 3])
    h, res = torch.full((4, 8), float("nan")), torch.empty(4, 8)
    z = torch.zeros(4, dtype=torch.int32)
    run = lambda ids: stack.run(ids.data_ptr(), h.data_ptr(), res.data_ptr(), False, ids.shape[0], 0, 0,
                                z.data_ptr(), 1, z.data_ptr(), z.data_ptr(), 1)
    run(ids)
    assert torch.equal(h, table[ids].float())
    with pytest.raises(IndexError, match="token id 10 outside the embedding's 10 rows"):
        run(torch.tensor([1, 10]))


def test_stack_times_its_kernels_only_when_asked(llm_f32):
    """Timing on (`cpuserve bench`'s profile) sums each kernel category's seconds over the steps
    and changes no result; off (the default), nothing is counted."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    generate = lambda: [o.outputs[0].token_ids for o in llm_f32.generate(PROMPTS[:2], params)]
    base = generate()
    stack = native_step.decoder_for(llm_f32.engine.runner.model).stack
    stack.reset_timings()
    generate()
    assert stack.timings() == {}
    stack.set_timing(True)
    try:
        timed = generate()
    finally:
        stack.set_timing(False)
    t = stack.timings()
    assert timed == base
    # the GGUF's embedding is looked up in Python (its blocks), so no "embedding" here
    assert set(t) == {"GEMM", "attention", "reshape_and_cache", "rotary", "fused_add_rms_norm", "rms_norm"}
    assert all(v > 0 for v in t.values()) and t["GEMM"] > t["rotary"]
    generate()
    assert stack.timings() == t  # off again: nothing added
    stack.reset_timings()
    assert stack.timings() == {}
