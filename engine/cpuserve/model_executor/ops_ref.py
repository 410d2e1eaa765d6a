"""Plain torch reference implementations of every native kernel.

They define what each kernel must compute; tests compare the native kernels
against them. Written for clarity, not speed.
"""
from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


def fused_add_rms_norm(x, residual, weight, eps):
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_dim: int, neox: bool):
    """x [T, H*D]; returns the rotated copy."""
    t = x.shape[0]
    x = x.view(t, -1, head_dim).double().clone()
    rot = cos_sin.shape[1]
    cos, sin = cos_sin[positions].double().chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = x[..., :rot]
    if neox:
        x1, x2 = r[..., : rot // 2], r[..., rot // 2:]
        r = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        r = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    x[..., :rot] = r
    return x.view(t, -1).float()


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d].double()).float() * x[..., d:]


def gelu_and_mul(x, approximate="tanh"):
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d].double(), approximate=approximate).float() * x[..., d:]


def argmax(x):
    return x.argmax(dim=-1)


def to_cache(x, dtype, scale=1.0):
    """x / scale in a cache dtype; float8 e4m3 saturates at +-448 (torch's cast would give NaN)."""
    x = x / scale if scale != 1.0 else x
    if dtype == getattr(torch, "float8_e4m3fn", None):
        x = x.clamp(-448.0, 448.0)
    return x.to(dtype)


def paired(dtype) -> bool:
    """Whether a cache of this dtype keeps its tiles in pairs (kernels/cache.hpp): bfloat16's key
    tile as [D / 2][block_size][2] (dimensions e, e + 1 of a key side by side) and value tile as
    [block_size / 2][D][2] (keys j, j + 1 of a dimension side by side), the operands of
    vdpbf16ps and AMX as they are; the tensors' shapes do not change."""
    return dtype == torch.bfloat16


def key_tiles(k_cache):
    """k_cache's key tiles as [blocks, Hk, D, block_size] (a copy where paired)."""
    if not paired(k_cache.dtype):
        return k_cache
    nb, hk, d, bs = k_cache.shape
    return k_cache.view(nb, hk, d // 2, bs, 2).permute(0, 1, 2, 4, 3).flatten(2, 3)


def value_tiles(v_cache):
    """v_cache's value tiles as [blocks, Hk, block_size, D] (a copy where paired)."""
    if not paired(v_cache.dtype):
        return v_cache
    nb, hk, bs, d = v_cache.shape
    return v_cache.view(nb, hk, bs // 2, d, 2).permute(0, 1, 2, 4, 3).flatten(2, 3)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """k_cache [blocks, Hk, D, block_size] (keys transposed in each block), v_cache [blocks, Hk, block_size, D],
    bfloat16 in pairs (`paired`)."""
    _, hk, bs, d = v_cache.shape
    pair = paired(v_cache.dtype)
    kp = k_cache.view(-1, hk, d // 2, bs, 2) if pair else None
    vp = v_cache.view(-1, hk, bs // 2, d, 2) if pair else None
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, off = divmod(slot, bs)
        k = to_cache(key[t].view(hk, d), k_cache.dtype, k_scale)
        v = to_cache(value[t].view(hk, d), v_cache.dtype, v_scale)
        if pair:
            kp[b, :, :, off] = k.view(hk, d // 2, 2)
            vp[b, :, off // 2, :, off % 2] = v
        else:
            k_cache[b, :, :, off] = k
            v_cache[b, :, off] = v


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_heads, scale,
                    sliding_window=0, softcap=0.0, group=None, q_head_offset=0, k_scale=1.0, v_scale=1.0,
                    bf16_inputs: bool = False):
    """Gathers each sequence's keys/values from the cache and runs masked softmax attention;
    query head i uses kv head (i + q_head_offset) // group. `bf16_inputs`: q rounded to bfloat16
    first, as the AVX-512 BF16 kernels do for a bfloat16 cache (Kernels.bf16_dot); they also round
    the probabilities to bfloat16 (relative error at most 2^-9 each), so their output stays within
    2^-9 * max|v| of this one (`BF16_PROBABILITY_ERROR`), up to float32 rounding."""
    if bf16_inputs:
        q = q.to(torch.bfloat16).float()
    _, hk, bs, d = v_cache.shape
    group = group or num_heads // hk
    kv_of = torch.tensor([(i + q_head_offset) // group for i in range(num_heads)])
    out = torch.empty(q.shape[0], num_heads * d)
    for s in range(seq_lens.shape[0]):
        ctx = int(seq_lens[s])
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        nblk = math.ceil(ctx / bs)
        blocks = block_tables[s, :nblk].long()
        keys = key_tiles(k_cache[blocks]).double().permute(1, 0, 3, 2).reshape(hk, nblk * bs, d)[:, :ctx] * k_scale
        vals = value_tiles(v_cache[blocks]).double().permute(1, 0, 2, 3).reshape(hk, nblk * bs, d)[:, :ctx] * v_scale
        keys, vals = keys[kv_of], vals[kv_of]
        qs = q[q0:q1].view(q1 - q0, num_heads, d).double().transpose(0, 1)  # [H, L, D]
        scores = qs @ keys.transpose(1, 2) * scale  # [H, L, ctx]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(ctx - (q1 - q0), ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        mask = kpos <= pos
        if sliding_window > 0:
            mask &= (pos - kpos) < sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[q0:q1] = (scores.softmax(-1) @ vals).transpose(0, 1).reshape(q1 - q0, -1).float()
    return out


BF16_PROBABILITY_ERROR = 2.0 ** -9  # bfloat16 rounding to nearest: half its 2^-8 unit roundoff


def linear(x, weight, bias=None, bf16_inputs: bool = False):
    """x @ weight^T (+ bias) in float64; `bf16_inputs`: x rounded to bfloat16 first, as the
    AVX-512 BF16 kernels do for bfloat16 weights (Kernels.bf16_dot)."""
    if bf16_inputs:
        x = x.to(torch.bfloat16).float()
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.float()


def quantize_tokens(x: torch.Tensor, asym: bool = False) -> tuple:
    """Dynamic per-token int8 quantization of x [M, K] float32 -> (codes int32 in [-127, 127],
    scales [M], zero points [M] int32): symmetric s = max|x| / 127, or asymmetric
    s = (max - min) / 254 with z = round(-127 - min / s); a constant row gets s = 1."""
    if asym:
        lo, hi = x.amin(1), x.amax(1)
        s = (hi - lo) / 254
    else:
        lo, s = x.new_zeros(x.shape[0]), x.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    z = torch.round(-127 - lo / s).to(torch.int32) if asym else torch.zeros_like(s, dtype=torch.int32)
    q = (torch.round(x / s.unsqueeze(1)) + z.unsqueeze(1).float()).clamp(-127, 127).to(torch.int32)
    return q, s, z


def w8a8_linear(x, w_int8, w_scale, bias=None, asym: bool = False):
    """x [M, K] float32 @ (w_scale * w_int8)^T with x quantized per token: the integer sums
    exact (int64), then float(sum) * (s_x * s_w) (+ bias), as the int8 GEMM computes it."""
    q, s, z = quantize_tokens(x.float(), asym)
    acc = (q.long() - z.long().unsqueeze(1)) @ w_int8.long().T
    out = acc.to(torch.int32).float() * (s.unsqueeze(1) * w_scale.reshape(1, -1).float())
    return out + bias if bias is not None else out


def quantize_groups(x, group: int):
    """x [M, K] float32 quantized to int8 per group of `group` consecutive k (the int8-dot GGUF
    GEMM's activations): s = max|x| / 127 over the group (1 for a group of zeros), q = rne(x / s)."""
    xg = x.float().reshape(x.shape[0], -1, group)
    s = xg.abs().amax(dim=2, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(xg / s).clamp(-127, 127)
    return q.reshape(x.shape), s.squeeze(2)


def int8_dot_linear(x, w, group: int, bias=None):
    """x [M, K] @ w^T with x quantized per group (quantize_groups) and w the dequantized block
    weight [N, K], in float64: what the int8-dot GEMM computes up to float32 rounding."""
    q, s = quantize_groups(x, group)
    xq = (q.reshape(x.shape[0], -1, group).double() * s.double().unsqueeze(2)).reshape(x.shape)
    out = (xq @ w.double().T).float()
    return out + bias if bias is not None else out
