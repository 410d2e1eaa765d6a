"""Small helpers shared by the model files."""
from __future__ import annotations

import torch


def rope_settings(config) -> tuple[float, dict | None]:
    """(rope theta, rope scaling dict or None) across transformers config generations."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(params["rope_theta"]), scaling
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


class Weights:
    """The checkpoint's tensors, handed out once each so that nothing is left unused."""

    def __init__(self, tensors):  # a dict, or model_loader.LazyTensors
        self.tensors = tensors

    def take(self, name: str) -> torch.Tensor:
        try:
            return self.tensors.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {name!r}") from None

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.pop(name, None)

    def peek(self, name: str) -> torch.Tensor:
        """A tensor another part of the model takes too (read, not handed out)."""
        if name not in self.tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.tensors.peek(name) if hasattr(self.tensors, "peek") else self.tensors[name]

    def check_consumed(self, ignore: tuple[str, ...] = ()) -> None:
        left = [n for n in self.tensors if not any(s in n for s in ignore)]
        if left:
            raise ValueError(f"checkpoint tensors not used by the model: {left[:8]}{' ...' if len(left) > 8 else ''}")


def attention_projections(w: Weights, prefix: str, head_dim: int, dtype: torch.dtype, tp):
    """The fused, sharded q/k/v projection and the output projection of a
    Hugging Face `self_attn` block (biases optional)."""
    from cpuserve.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    a = prefix + "self_attn."
    bias = [w.take_optional(a + f"{x}_proj.bias") for x in "qkv"]
    qkv = QKVParallelLinear(w.take(a + "q_proj.weight"), w.take(a + "k_proj.weight"), w.take(a + "v_proj.weight"),
                            bias if bias[0] is not None else None, head_dim, dtype, tp)
    o_proj = RowParallelLinear(w.take(a + "o_proj.weight"), w.take_optional(a + "o_proj.bias"), dtype, tp,
                               qkv.o_range)
    return qkv, o_proj


def gated_mlp(w: Weights, prefix: str, dtype: torch.dtype, tp):
    """gate/up (merged, column-parallel) and down (row-parallel) of a Hugging Face
    `mlp` block, sharing one split of the intermediate features."""
    from cpuserve.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gate, up, down = (w.take(f"{prefix}mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
    shard = tp.shard(gate.shape[0], "intermediate features", align=32)
    gate_up = MergedColumnParallelLinear([gate, up], None, dtype, tp, shard)
    return gate_up, RowParallelLinear(down, None, dtype, tp, shard)


class CausalLM:
    """What every model class shares: its attention layers (for the KV cache) and the LM head."""

    layers: list
    lm_head: object

    @property
    def attention_layers(self) -> list:
        return [layer.attn for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
