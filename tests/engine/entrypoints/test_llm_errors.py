"""Every error a user can cause gets a clear message, not a crash or a hang."""
import json
import platform

import pytest
import torch

from cpuserve import LLM, SamplingParams
from cpuserve.platform.isa import resolve_dtype


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/no/such/model")


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture(tmp_path):
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "llama"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="FooForCausalLM.*not supported"):
        LLM(str(tmp_path))


def test_bad_dtypes(monkeypatch):
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float64", None)
    monkeypatch.setattr(platform, "machine", lambda: "s390x")
    with pytest.raises(ValueError, match="not supported on this CPU"):
        resolve_dtype("float16", None)
    assert resolve_dtype("auto", torch.bfloat16) == torch.float32  # s390x: float32 only by default


def test_cache_too_small_for_one_block():
    with pytest.raises(ValueError, match="holds no block"):
        LLM(kv_cache_space=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=24), "multiple of 16"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=10**6), "exceeds the model's maximum context"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
])
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_request_errors_leave_the_engine_usable(tokenizer):
    llm = LLM(dtype="float32", block_size=16, num_kv_blocks=4, max_model_len=128)
    long_prompt = tokenizer.encode("word " * 200)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_token_ids": long_prompt})
    with pytest.raises(ValueError, match="whole cache holds 4 blocks"):
        llm.generate({"prompt_token_ids": long_prompt[:60]}, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate({"prompt_token_ids": [1, 10**7]})
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(n=0), "n must"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={1: 500}), "logit_bias"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_isa_override_is_checked(monkeypatch):
    import importlib
    from cpuserve.model_executor import ops
    monkeypatch.setenv("CPUSERVE_ISA", "vxe" if platform.machine() != "s390x" else "avx2")
    with pytest.raises(RuntimeError, match="not compiled in or not supported"):
        importlib.reload(ops)
    monkeypatch.delenv("CPUSERVE_ISA")
    importlib.reload(ops)


def test_truncated_gguf_names_the_file(tmp_path, monkeypatch, model_path):
    monkeypatch.setenv("CPUSERVE_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[: 1 << 20])
    with pytest.raises(ValueError, match=f"{cut}: not a readable GGUF file"):
        LLM(str(cut))


def test_truncated_safetensors_names_the_file(tmp_path, llm_f32):
    src = llm_f32.engine.runner.model_dir
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            (tmp_path / name).write_bytes((src / name).read_bytes())
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.randn(64, 576)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{tmp_path / 'model.safetensors'}: truncated data"):
        LLM(str(tmp_path), dtype="float32", kv_cache_space=0.1)


def test_full_cache_disk_is_clear_and_leaves_nothing_behind(tmp_path, monkeypatch, model_path):
    import errno

    from cpuserve.loading import gguf_tokenizer

    cache = tmp_path / "cache"
    monkeypatch.setenv("CPUSERVE_CACHE", str(cache))

    def disk_full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(gguf_tokenizer, "write_tokenizer", disk_full)
    with pytest.raises(OSError, match="into the cache .* failed: No space left on device; .*CPUSERVE_CACHE"):
        LLM(str(model_path))
    assert list((cache / "gguf").iterdir()) == []  # no half-written directory a later start could trust
