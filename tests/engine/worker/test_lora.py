"""LoRA adapters (PEFT's format, drawn from seeds for the packaged SmolLM2) against transformers
with each adapter merged into its weights: greedy tokens equal, requests with different adapters
and none in one batch each as alone, the prefix cache never shared across adapters, and the
adapters this engine cannot apply refused with the reason."""
import pytest
import torch

from cpuserve import LLM, LoRARequest, SamplingParams
from tests.engine.lora_adapters import make_adapter, merged

from ..conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    return {"all": make_adapter(d / "all", hf_model.config, seed=1),
            "attn": make_adapter(d / "attn", hf_model.config, seed=2, modules=("q_proj", "v_proj"), rank=4,
                                 alpha=8, rslora=True, layers=range(0, 30, 3), b_std=0.05)}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", block_size=16, kv_cache_space=1.0, enable_lora=True, max_lora_rank=8)


def reference(model, tokenizer, prompt, n=12):
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, attention_mask=None)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_equal_transformers_with_the_adapter_merged(llm, adapters, hf_model, tokenizer):
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    for i, (name, path) in enumerate(adapters.items(), 1):
        ref = merged(hf_model, path)
        outs = llm.generate(PROMPTS[:3], GREEDY, lora_request=LoRARequest(name, i, str(path)))
        got = [o.outputs[0].token_ids for o in outs]
        assert got == [reference(ref, tokenizer, p) for p in PROMPTS[:3]], name
        assert got != base, f"{name} changes no token: the check could not fail"


def test_adapters_and_the_base_model_share_a_batch(llm, adapters):
    reqs = [LoRARequest("all", 1, str(adapters["all"])), None, LoRARequest("attn", 2, str(adapters["attn"]))]
    alone = [llm.generate(p, GREEDY, lora_request=r)[0].outputs[0].token_ids for p, r in zip(PROMPTS[3:6], reqs)]
    together = llm.generate(PROMPTS[3:6], GREEDY, lora_request=reqs)  # one batch: prefill and decode steps mixed
    assert [o.outputs[0].token_ids for o in together] == alone


def test_the_prefix_cache_is_never_shared_across_adapters(llm, adapters):
    prompt = PROMPTS[6] * 3  # several full blocks
    lora = LoRARequest("all", 1, str(adapters["all"]))
    first = llm.generate(prompt, GREEDY, lora_request=lora)[0].outputs[0].token_ids
    base = llm.engine.prefix_cache_stats()["hits"]
    llm.generate(prompt, GREEDY)  # the same prompt on the base model: no block of the adapter's
    assert llm.engine.prefix_cache_stats()["hits"] == base
    again = llm.generate(prompt, GREEDY, lora_request=lora)[0]  # the adapter's own blocks: hits
    assert llm.engine.prefix_cache_stats()["hits"] > base and again.outputs[0].token_ids == first


def test_what_cannot_be_applied_is_refused(llm, adapters, hf_model, tmp_path):
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("big", 9, str(make_adapter(
            tmp_path / "big", hf_model.config, seed=3, rank=16, layers=[0]))))
    dora = make_adapter(tmp_path / "dora", hf_model.config, seed=4, layers=[0], use_dora=True)
    with pytest.raises(ValueError, match="DoRA is not supported"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("dora", 10, str(dora)))
    head = make_adapter(tmp_path / "head", hf_model.config, seed=5, layers=[0])
    from safetensors.torch import load_file, save_file
    t = load_file(str(head / "adapter_model.safetensors"))
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 576)
    save_file(t, str(head / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="updates a module LoRA is not applied to here"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("head", 11, str(head)))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(dtype="float32", kv_cache_space=0.5).generate("x", GREEDY, lora_request=LoRARequest("all", 1, "/x"))


def test_an_adapter_unloads_only_once_its_requests_are_done(llm, adapters):
    core, path = llm.engine.core, str(adapters["attn"])
    llm.engine.runner.add_lora("busy", path)
    llm.engine.add_request("r-busy", "Hello there", GREEDY, lora="busy")
    with pytest.raises(ValueError, match="in use by 1 request"):
        core.unload_lora("busy")
    serial = llm.engine.runner.loras["busy"].serial
    llm.engine.abort_request("r-busy")
    core.unload_lora("busy")
    with pytest.raises(KeyError, match="cannot be found"):
        core.unload_lora("busy")
    core.load_lora("busy", path)  # loaded again: a new identity for the prefix cache
    assert llm.engine.runner.loras["busy"].serial != serial
    with pytest.raises(ValueError, match="already been loaded"):
        core.load_lora("busy", path)
    with pytest.raises(ValueError, match="is loaded from"):
        llm.engine.runner.add_lora("busy", str(adapters["all"]))

