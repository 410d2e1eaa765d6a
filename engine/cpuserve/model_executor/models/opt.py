"""OPT (facebook/opt-*): learned positions (offset 2), LayerNorm, ReLU MLP, biases everywhere."""
from __future__ import annotations

import torch

from cpuserve.model_executor.parallel import TPGroup
from cpuserve.model_executor.layers.attention import PagedAttention
from cpuserve.model_executor.layers.embedding import Embedding, LMHead
from cpuserve.model_executor.layers.linear import ColumnParallelLinear, Linear, QKVParallelLinear, RowParallelLinear
from cpuserve.model_executor.layers.norm import LayerNorm
from cpuserve.model_executor.models.common import CausalLM, Weights

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class OPTDecoderLayer:
    def __init__(self, c, i: int, w: Weights, dtype: torch.dtype, tp: TPGroup):
        p = f"model.decoder.layers.{i}."
        hd = c.hidden_size // c.num_attention_heads
        t = lambda n: w.take(p + n)  # noqa: E731
        self.qkv = QKVParallelLinear(t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"),
                                     t("self_attn.v_proj.weight"),
                                     [t("self_attn.q_proj.bias"), t("self_attn.k_proj.bias"), t("self_attn.v_proj.bias")],
                                     hd, dtype, tp)
        self.out_proj = RowParallelLinear(t("self_attn.out_proj.weight"), t("self_attn.out_proj.bias"), dtype, tp,
                                          self.qkv.o_range)
        self.attn = PagedAttention.for_qkv(self.qkv, hd, hd ** -0.5)
        self.attn_norm = LayerNorm(t("self_attn_layer_norm.weight"), t("self_attn_layer_norm.bias"), 1e-5)
        self.fc1 = ColumnParallelLinear(t("fc1.weight"), t("fc1.bias"), dtype, tp)
        self.fc2 = RowParallelLinear(t("fc2.weight"), t("fc2.bias"), dtype, tp)
        self.mlp_norm = LayerNorm(t("final_layer_norm.weight"), t("final_layer_norm.bias"), 1e-5)
        self.pre_norm = c.do_layer_norm_before

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(h) if self.pre_norm else h
        h = h + self.out_proj(self.attn(*self.qkv.split(self.qkv(x))))
        if not self.pre_norm:
            h = self.attn_norm(h)
        x = self.mlp_norm(h) if self.pre_norm else h
        h = h + self.fc2(torch.relu(self.fc1(x)))
        if not self.pre_norm:
            h = self.mlp_norm(h)
        return h


class OPTForCausalLM(CausalLM):
    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp: TPGroup):
        c = config
        if c.activation_function != "relu":
            raise ValueError(f"OPT activation {c.activation_function!r} is not supported (relu is)")
        embed = weights.take("model.decoder.embed_tokens.weight")
        self.embed = Embedding(embed, dtype)
        self.positions = weights.take("model.decoder.embed_positions.weight").float().contiguous()
        pin = weights.take_optional("model.decoder.project_in.weight")
        pout = weights.take_optional("model.decoder.project_out.weight")
        self.project_in = Linear(pin, None, dtype) if pin is not None else None
        self.project_out = Linear(pout, None, dtype) if pout is not None else None
        self.layers = [OPTDecoderLayer(c, i, weights, dtype, tp) for i in range(c.num_hidden_layers)]
        fw, fb = weights.take_optional("model.decoder.final_layer_norm.weight"), \
            weights.take_optional("model.decoder.final_layer_norm.bias")
        self.final_norm = LayerNorm(fw, fb, 1e-5) if fw is not None else None
        lm = weights.take_optional("lm_head.weight")
        self.lm_head = LMHead(embed if lm is None else lm, dtype, tp)
        weights.check_consumed()


    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.project_in is not None:
            h = self.project_in(h)
        h = h + self.positions[positions + POSITION_OFFSET]
        for layer in self.layers:
            h = layer(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return h.contiguous()
