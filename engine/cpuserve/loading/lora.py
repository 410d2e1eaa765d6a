"""LoRA adapters in PEFT's format (adapter_config.json beside adapter_model.safetensors or
adapter_model.bin), as vLLM serves them: low-rank updates W + (alpha / r) * B @ A of a decoder's
attention and MLP projections, kept apart from the base weights so that requests with different
adapters, and without one, share a batch. Scaling is alpha / r, or alpha / sqrt(r) with rsLoRA.
What PEFT can hold but this engine does not apply (DoRA, biases, an adapted embedding or LM head,
modules_to_save) is refused with the reason, never silently left out."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# a decoder layer's projections an adapter may update, by the part of the layer that runs them
MODULES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
           "up_proj": "gate_up", "down_proj": "down"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter this engine cannot serve, and why."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # layer index -> projection name (q_proj ...) -> (A [r, in], B [out, r] times the scaling), float32
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    serial: int = 0  # set by the runner at load: this load's identity (the prefix cache's key)
    packed: dict = field(default_factory=dict)  # (layer, fused part) -> (A^T, B^T): model_executor.lora.pack

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for mods in self.layers.values() for pair in mods.values() for t in pair)


def adapter_config(path: Path) -> dict:
    f = path / "adapter_config.json"
    if not f.exists():
        raise LoRAError(f"{path}: no adapter_config.json (a PEFT LoRA adapter directory is expected)")
    cfg = json.loads(f.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: a {cfg['peft_type']} adapter; only LoRA adapters are supported")
    refused = [(k, why) for k, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                                       ("modules_to_save", "modules_to_save (fully trained modules)"))
               if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        refused.append(("bias", f"bias={cfg['bias']!r} (trained biases)"))
    if refused:
        raise LoRAError(f"{path}: {refused[0][1]} is not supported (adapter_config.json: {refused[0][0]})")
    return cfg


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from cpuserve.loading.model_loader import LazyTensors

    st = path / "adapter_model.safetensors"
    if st.exists():
        lazy = LazyTensors([st])
        return {name: lazy.pop(name) for name in list(lazy)}
    pt = path / "adapter_model.bin"
    if pt.exists():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise LoRAError(f"{path}: no adapter_model.safetensors or adapter_model.bin")


def load_adapter(name: str, path: str | Path, num_layers: int, max_rank: int) -> LoRAAdapter:
    """The adapter's per-layer updates, checked against the model (its layer count) and the
    engine's --max-lora-rank."""
    path = Path(path)
    cfg = adapter_config(path)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if rank > max_rank:
        raise LoRAError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    scaling = alpha / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _tensors(path).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULES:
            raise LoRAError(f"{path}: tensor {key!r} updates a module LoRA is not applied to here (the decoder "
                            f"layers' {', '.join(MODULES)})")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    adapter = LoRAAdapter(name, str(path), rank, scaling)
    for (layer, module), ab in sorted(parts.items()):
        if layer >= num_layers:
            raise LoRAError(f"{path}: layer {layer} is beyond the model's {num_layers}")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{path}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"].float(), ab["B"].float()
        if a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise LoRAError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            f"do not make a rank-{rank} update")
        adapter.layers.setdefault(layer, {})[module] = (a.contiguous(), (b * scaling).contiguous())
    if not adapter.layers:
        raise LoRAError(f"{path}: the adapter holds no LoRA weights")
    return adapter
