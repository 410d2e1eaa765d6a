"""GPT-2: learned positions, LayerNorm, GELU (tanh) MLP, Conv1D weights stored [in, out]."""
from __future__ import annotations

import torch

from cpuserve.model_executor.parallel import TPGroup
from cpuserve.model_executor.layers.attention import PagedAttention
from cpuserve.model_executor.layers.embedding import Embedding, LMHead
from cpuserve.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cpuserve.model_executor.layers.norm import LayerNorm
from cpuserve.model_executor.models.common import CausalLM, Weights

_ACTS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _linear(w):
    """A Conv1D weight [in, out] as a linear one [out, in]; quantized weights (a GGUF's blocks)
    are stored [out, in] already."""
    return w.t() if isinstance(w, torch.Tensor) else w


class GPT2Block:
    def __init__(self, c, i: int, w: Weights, dtype: torch.dtype, tp: TPGroup):
        p = f"transformer.h.{i}."
        h = c.n_embd
        hd = h // c.n_head
        eps = c.layer_norm_epsilon
        qkv_w = _linear(w.take(p + "attn.c_attn.weight"))
        qkv_b = w.take(p + "attn.c_attn.bias")
        self.qkv = QKVParallelLinear(qkv_w[:h], qkv_w[h:2 * h], qkv_w[2 * h:],
                                     [qkv_b[:h], qkv_b[h:2 * h], qkv_b[2 * h:]], hd, dtype, tp)
        self.c_proj = RowParallelLinear(_linear(w.take(p + "attn.c_proj.weight")), w.take(p + "attn.c_proj.bias"),
                                        dtype, tp,
                                        self.qkv.o_range)
        scale = hd ** -0.5 if c.scale_attn_weights else 1.0
        if getattr(c, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(i + 1)
        self.attn = PagedAttention.for_qkv(self.qkv, hd, scale)
        self.ln_1 = LayerNorm(w.take(p + "ln_1.weight"), w.take(p + "ln_1.bias"), eps)
        self.ln_2 = LayerNorm(w.take(p + "ln_2.weight"), w.take(p + "ln_2.bias"), eps)
        self.c_fc = ColumnParallelLinear(_linear(w.take(p + "mlp.c_fc.weight")), w.take(p + "mlp.c_fc.bias"), dtype,
                                         tp)
        self.mlp_proj = RowParallelLinear(_linear(w.take(p + "mlp.c_proj.weight")), w.take(p + "mlp.c_proj.bias"),
                                          dtype, tp)
        self.approximate = _ACTS[c.activation_function]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.c_proj(self.attn(*self.qkv.split(self.qkv(self.ln_1(h)))))
        x = torch.nn.functional.gelu(self.c_fc(self.ln_2(h)), approximate=self.approximate)
        return h + self.mlp_proj(x)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp: TPGroup):
        c = config
        if c.activation_function not in _ACTS:
            raise ValueError(f"GPT-2 activation {c.activation_function!r} is not supported")
        wte = weights.take("transformer.wte.weight")
        self.embed = Embedding(wte, dtype)
        self.wpe = weights.take("transformer.wpe.weight").float().contiguous()
        self.layers = [GPT2Block(c, i, weights, dtype, tp) for i in range(c.n_layer)]
        self.ln_f = LayerNorm(weights.take("transformer.ln_f.weight"), weights.take("transformer.ln_f.bias"),
                              c.layer_norm_epsilon)
        lm = weights.take_optional("lm_head.weight")
        self.lm_head = LMHead(wte if lm is None else lm, dtype, tp)
        weights.check_consumed(ignore=(".attn.bias", ".attn.masked_bias"))


    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.wpe[positions]
        for layer in self.layers:
            h = layer(h)
        return self.ln_f(h).contiguous()
