"""PEFT adapter directories read into per-layer updates, and --lora-modules' forms: scaling
(alpha / r, rsLoRA's alpha / sqrt(r)), B scaled once at load, and each mistake named."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpuserve.core.lora_request import parse_modules
from cpuserve.loading.lora import LoRAError, load_adapter
from tests.engine.lora_adapters import make_adapter

CFG = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      num_hidden_layers=3)


@pytest.mark.parametrize("rslora, scaling", [(False, 16 / 8), (True, 16 / 8 ** 0.5)])
def test_updates_are_read_and_scaled(tmp_path, rslora, scaling):
    path = make_adapter(tmp_path / "a", CFG, seed=0, rslora=rslora, layers=[0, 2], modules=("q_proj", "down_proj"))
    a = load_adapter("a", path, num_layers=3, max_rank=8)
    assert (a.rank, a.scaling, sorted(a.layers)) == (8, pytest.approx(scaling), [0, 2])
    raw = load_file(str(path / "adapter_model.safetensors"))
    A, B = a.layers[2]["down_proj"]
    key = "base_model.model.model.layers.2.mlp.down_proj"
    assert torch.equal(A, raw[f"{key}.lora_A.weight"])
    assert torch.allclose(B, raw[f"{key}.lora_B.weight"] * scaling)
    assert A.shape == (8, 96) and B.shape == (64, 8)


def test_mistakes_are_named(tmp_path):
    path = make_adapter(tmp_path / "a", CFG, seed=0, layers=[0])
    with pytest.raises(LoRAError, match="layer 0 is beyond the model's 0"):
        load_adapter("a", path, num_layers=0, max_rank=8)
    t = load_file(str(path / "adapter_model.safetensors"))
    del t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(t, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="q_proj has lora_B missing"):
        load_adapter("a", path, num_layers=3, max_rank=8)
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, "bias": "all"}))
    with pytest.raises(LoRAError, match="bias='all'"):
        load_adapter("a", path, num_layers=3, max_rank=8)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter("a", tmp_path, num_layers=3, max_rank=8)


def test_lora_modules_forms():
    assert parse_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == {"a": "/x", "b": "/y"}
    assert parse_modules(None) == {}
    for bad, msg in ((["a"], "not name=path"), (["a=/x", "a=/y"], "given twice"), (['{"name": "b"}'], "JSON object")):
        with pytest.raises(ValueError, match=msg):
            parse_modules(bad)
