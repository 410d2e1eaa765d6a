"""The Llama-family decoder stack in one native call per step (cpuserve._C.DecoderStack):
the embedding lookup, the kernels the Python layers call, in their order, on the same
weights and KV caches, and the final norm, so the results are the same bit for bit,
without a Python round trip per operator (about 10 kernel calls a layer). One rank only:
with tensor parallelism the Python layers run, as they hold the all-reduces.

CPUSERVE_NATIVE_STEP=0 (or `ENABLED = False`) runs the Python layers instead, e.g. to
compare the two. `cpuserve bench` profiles a step inside the stack (`DecoderStack.set_timing`)."""
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


def _native_table(embed, hidden: int) -> torch.Tensor | None:
    """The embedding's table where the stack can look tokens up in it itself (a plain float32 or
    bfloat16 table [rows, hidden], no scale), else None (the Python embedding runs first: GGUF
    blocks, float16, Gemma's scale)."""
    w = getattr(embed, "weight", None)
    if (not isinstance(w, torch.Tensor) or getattr(embed, "scale", None) is not None or w.dim() != 2
            or w.shape[1] != hidden or w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous()):
        return None
    return w


class NativeDecoder:
    """Built from a model's embedding, decoder layers and final norm once its KV caches are bound."""

    KEEP_RESIDUAL_TOKENS = 256

    def __init__(self, model, k=ops.KERNELS):
        layers = model.layers
        c = layers[0]
        self.hidden = c.input_norm.weight.shape[0]
        self.stack = _C.DecoderStack(k, self.hidden, c.down.weight.k)
        self.embed = model.embed
        self.residual: torch.Tensor | None = None
        table = _native_table(model.embed, self.hidden)
        if table is not None:
            self.stack.set_embedding(table.data_ptr(), ops.DTYPE_CODES[table.dtype], table.shape[0])
        self.native_embed = table is not None
        self.stack.set_final_norm(model.norm.weight.data_ptr(), model.norm.eps)
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

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input ids [T] -> the final norm's output [T, hidden] (the model's forward)."""
        ids = input_ids.reshape(-1)
        if self.native_embed:
            if ids.dtype != torch.int64 or not ids.is_contiguous():
                ids = ids.to(torch.int64).contiguous()
            h = torch.empty((ids.shape[0], self.hidden), dtype=torch.float32)
        else:
            h = self.embed(ids).contiguous()
        residual = self._residual(h.shape[0])
        bt = ctx.block_tables
        self.stack.run(ids.data_ptr() if self.native_embed else 0, h.data_ptr(), residual.data_ptr(), False,
                       h.shape[0], positions.data_ptr(), ctx.slot_mapping.data_ptr(), bt.data_ptr(), bt.shape[1],
                       ctx.seq_lens.data_ptr(), ctx.query_start_loc.data_ptr(), ctx.seq_lens.shape[0])
        return h

    def _residual(self, tokens: int) -> torch.Tensor:
        """The residual stream's scratch [tokens, hidden]: for decode-sized steps one kept from step
        to step (it never leaves the stack, and a step's torch calls are slow, their caches cold
        after the weights streamed through them); a prompt's is its own, not held after it."""
        if tokens > self.KEEP_RESIDUAL_TOKENS:
            return torch.empty((tokens, self.hidden), dtype=torch.float32)
        if self.residual is None:
            self.residual = torch.empty((self.KEEP_RESIDUAL_TOKENS, self.hidden), dtype=torch.float32)
        return self.residual


def decoder_for(model):
    """The model's NativeDecoder, (re)built when its KV caches were (re)bound; None where the
    Python layers must run."""
    nd = getattr(model, "_native", None)
    # the check a step makes: one pointer (applies() reads every layer: 40 us a decode step, the
    # Python objects cold after the weights streamed through the caches)
    if ENABLED and nd is not None and nd.cache_ptr == _ptr(model.layers[0].attn.k_cache):
        return nd
    if not NativeDecoder.applies(model):
        return None
    # applies() holds ENABLED, so here there is no stack yet or its caches were rebound
    model._native = NativeDecoder(model)
    return model._native
