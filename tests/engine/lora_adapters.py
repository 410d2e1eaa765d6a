"""LoRA adapters for the tests in PEFT's format (adapter_config.json, adapter_model.safetensors),
drawn from a seed for the packaged SmolLM2 (no adapter can be fetched here), and transformers'
reference for one: the same model with each update merged into its weights, W + (alpha / r) B A."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from cpuserve.model_executor.lora import projection_shapes

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(out: Path, cfg, seed: int, modules=ALL, rank: int = 8, alpha: float = 16, rslora: bool = False,
                 layers=None, b_std: float = 0.01, **config) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers if layers is not None else range(cfg.num_hidden_layers):
        for m in modules:
            o, n = projection_shapes(cfg)[m]
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n, generator=g) * n ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=g) * b_std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
        "use_rslora": rslora, "task_type": "CAUSAL_LM", **config}))
    return out


def merged(hf_model, adapter: Path):
    """A copy of the transformers model with the adapter merged into its weights."""
    from safetensors.torch import load_file
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                name = key.replace("base_model.model.", "").replace(".lora_A", "")
                params[name] += scale * (b @ a)
    return model
