"""Gemma 3 (text): sliding-window and global layers with their own rotary bases,
QK-norm, (1 + w) RMSNorms around both attention and MLP, GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden)."""
from __future__ import annotations

import torch

from cpuserve.model_executor import ops
from cpuserve.model_executor.parallel import TPGroup
from cpuserve.model_executor.layers.attention import PagedAttention
from cpuserve.model_executor.layers.embedding import Embedding, LMHead
from cpuserve.model_executor.layers.norm import RMSNorm
from cpuserve.model_executor.layers.rotary import RotaryEmbedding
from cpuserve.model_executor.models.common import CausalLM, Weights, attention_projections, gated_mlp

_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def layer_types(c) -> list[str]:
    types = getattr(c, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(c, "sliding_window_pattern", None) or getattr(c, "_sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(c.num_hidden_layers)]


def rope_for(c, kind: str) -> tuple[float, dict | None]:
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and kind in params:  # transformers >= 5: one entry per layer type
        p = params[kind]
        return float(p["rope_theta"]), (p if p.get("rope_type", "default") != "default" else None)
    if kind == "sliding_attention":
        return float(getattr(c, "rope_local_base_freq", 10000.0)), None
    return float(getattr(c, "rope_theta", 1e6)), getattr(c, "rope_scaling", None)


class Gemma3DecoderLayer:
    def __init__(self, c, i: int, kind: str, w: Weights, dtype, tp: TPGroup, rotary: RotaryEmbedding):
        p = f"model.layers.{i}."
        self.head_dim = c.head_dim
        eps = c.rms_norm_eps
        self.qkv, self.o_proj = attention_projections(w, p, c.head_dim, dtype, tp)
        self.q_norm = RMSNorm(w.take(p + "self_attn.q_norm.weight"), eps, offset=1.0)
        self.k_norm = RMSNorm(w.take(p + "self_attn.k_norm.weight"), eps, offset=1.0)
        window = c.sliding_window if kind == "sliding_attention" else 0
        self.attn = PagedAttention.for_qkv(self.qkv, c.head_dim, c.query_pre_attn_scalar ** -0.5, window,
                                           getattr(c, "attn_logit_softcapping", 0) or 0)
        self.rotary = rotary
        self.gate_up, self.down = gated_mlp(w, p, dtype, tp)
        norm = lambda n: RMSNorm(w.take(p + n + ".weight"), eps, offset=1.0)  # noqa: E731
        self.input_norm, self.post_attn_norm = norm("input_layernorm"), norm("post_attention_layernorm")
        self.pre_ff_norm, self.post_ff_norm = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm")
        self.approximate = _ACTS[c.hidden_activation]

    def __call__(self, positions, h):
        q, k, v = self.qkv.split(self.qkv(self.input_norm(h)))
        q = self.q_norm.heads(q, self.head_dim)
        k = self.k_norm.heads(k, self.head_dim)
        self.rotary(positions, q, k)
        h = h + self.post_attn_norm(self.o_proj(self.attn(q, k, v)))
        x = ops.gelu_and_mul(self.gate_up(self.pre_ff_norm(h)), self.approximate)
        return h + self.post_ff_norm(self.down(x))


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp: TPGroup):
        c = config
        act = getattr(c, "hidden_activation", None) or c.hidden_act
        if act not in _ACTS:
            raise ValueError(f"Gemma 3 activation {act!r} is not supported")
        c.hidden_activation = act
        embed = weights.take("model.embed_tokens.weight")
        self.embed = Embedding(embed, dtype, scale=c.hidden_size ** 0.5)
        rotaries = {kind: RotaryEmbedding(c.head_dim, c.head_dim, c.max_position_embeddings, *rope_for(c, kind))
                    for kind in ("sliding_attention", "full_attention")}
        self.layers = [Gemma3DecoderLayer(c, i, kind, weights, dtype, tp, rotaries[kind])
                       for i, kind in enumerate(layer_types(c))]
        self.norm = RMSNorm(weights.take("model.norm.weight"), c.rms_norm_eps, offset=1.0)
        lm = weights.take_optional("lm_head.weight")
        self.lm_head = LMHead(embed if lm is None else lm, dtype, tp,
                              final_softcap=getattr(c, "final_logit_softcapping", None))
        weights.check_consumed()


    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)
