"""The Llama-family decoder stack in one native call per step (cpuserve._C.DecoderStack):
the kernels the Python layers call, in their order, on the same weights and KV caches,
so the results are the same bit for bit, without a Python round trip per operator
(about 10 kernel calls a layer). One rank only: with tensor parallelism the Python
layers run, as they hold the all-reduces.

CPUSERVE_NATIVE_STEP=0 (or `ENABLED = False`) runs the Python layers instead, e.g. to
profile each kernel from Python (`cpuserve bench`)."""
from __future__ import annotations

import os

import torch

from cpuserve import _C
from cpuserve.model_executor import ops

ENABLED = os.environ.get("CPUSERVE_NATIVE_STEP", "1") != "0"


INT8_KIND = 256  # runner/decoder_step.hpp's kInt8Kind
QDOT_KIND = 512  # ... and kQDotKind


def _kind(p) -> int:
    if ops.is_int8(p):
        return INT8_KIND + int(p.act_asym)
    if ops.is_quantized(p):
        return (QDOT_KIND if p.int8_dot else 16) + p.qtype
    return ops.DTYPE_CODES[p.dtype]


def _linear_spec(weight, bias) -> tuple:
    parts = weight.parts if ops.is_stacked(weight) else [weight]
    spec = [(p.data.data_ptr(), _kind(p), p.n) for p in parts]
    return weight.k, bias.data_ptr() if bias is not None else 0, spec


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0


class NativeDecoder:
    """Built from a model's decoder layers once their KV caches are bound."""

    def __init__(self, layers: list, hidden: int, intermediate: int, k=ops.KERNELS):
        self.stack = _C.DecoderStack(k, hidden, intermediate)
        self.cache_ptr = layers[0].attn.k_cache.data_ptr()
        for layer in layers:
            a, r = layer.attn, layer.rotary
            qn, kn = getattr(layer, "q_norm", None), getattr(layer, "k_norm", None)
            self.stack.add_layer(
                layer.input_norm.weight.data_ptr(), layer.post_attn_norm.weight.data_ptr(), layer.input_norm.eps,
                _linear_spec(layer.qkv.weight, layer.qkv.bias), _linear_spec(layer.o_proj.weight, layer.o_proj.full_bias),
                _linear_spec(layer.gate_up.weight, layer.gate_up.bias), _linear_spec(layer.down.weight, layer.down.full_bias),
                _ptr(qn.weight if qn else None), _ptr(kn.weight if kn else None), a.num_heads, a.num_kv_heads,
                a.head_dim, a.group or a.num_heads // a.num_kv_heads, a.q_head_offset, a.scale, a.sliding_window,
                a.softcap, r.cos_sin.data_ptr(), r.cos_sin.shape[1], r.neox, a.k_cache.data_ptr(),
                a.v_cache.data_ptr(), ops.DTYPE_CODES[a.k_cache.dtype], a.v_cache.shape[2], a.k_scale, a.v_scale)

    @staticmethod
    def applies(model) -> bool:
        layers = getattr(model, "layers", [])
        return ENABLED and bool(layers) and all(
            getattr(layer, "native_ok", False) and layer.attn.k_cache is not None for layer in layers)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] (the embeddings) -> (last layer's output, residual), both [T, hidden]."""
        h = h.contiguous()
        residual = torch.empty_like(h)
        bt = ctx.block_tables
        self.stack.run(h.data_ptr(), residual.data_ptr(), False, h.shape[0], positions.data_ptr(),
                       ctx.slot_mapping.data_ptr(), bt.data_ptr(), bt.shape[1], ctx.seq_lens.data_ptr(),
                       ctx.query_start_loc.data_ptr(), ctx.seq_lens.shape[0])
        return h, residual


def decoder_for(model):
    """The model's NativeDecoder, (re)built when its KV caches were (re)bound; None where the
    Python layers must run."""
    if not NativeDecoder.applies(model):
        return None
    nd = getattr(model, "_native", None)
    if nd is None or nd.cache_ptr != model.layers[0].attn.k_cache.data_ptr():
        c = model.layers[0]
        nd = NativeDecoder(model.layers, c.input_norm.weight.shape[0], c.down.weight.k)
        model._native = nd
    return nd
