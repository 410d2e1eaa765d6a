"""Torch-facing wrappers of the native kernels (cpuserve._C).

Activations are float32 tensors; weights and the KV cache may be float32,
bfloat16 or float16. Every wrapper checks what the kernel relies on (dtype,
contiguity of the innermost dimension, shapes) and passes raw addresses, so the
native side needs no torch headers. `KERNELS` is the table for this CPU's best
ISA, or the one named by CPUSERVE_ISA.
"""
from __future__ import annotations

import os

import torch

from cpuserve import _C

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _load_kernels() -> "_C.Kernels":
    isa = os.environ.get("CPUSERVE_ISA", "")
    try:
        return _C.Kernels(isa)
    except ValueError as e:
        raise RuntimeError(f"CPUSERVE_ISA={isa!r}: {e}; available here: {_C.available_isas()}") from None


KERNELS = _load_kernels()


def _f32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"unsupported storage dtype {dtype}; use float32, bfloat16 or float16") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             k=KERNELS) -> torch.Tensor:
    """out = x / rms(x) * weight over the last dimension (x: [rows, dim])."""
    _f32(x, "x")
    out = torch.empty_like(x) if out is None else out
    k.rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
               out.stride(0), eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       k=KERNELS) -> None:
    """In place: residual += x; x = rms_norm(residual) * weight."""
    _f32(x, "x")
    _f32(residual, "residual")
    k.fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
                         x.stride(0), residual.stride(0), eps)


def rotary(q: torch.Tensor, key: torch.Tensor | None, positions: torch.Tensor, cos_sin: torch.Tensor,
           head_dim: int, neox: bool, k=KERNELS) -> None:
    """In-place rotary embedding. q: [T, Hq*D] (token rows may be strided), key likewise."""
    _f32(q, "q")
    rot_dim = cos_sin.shape[1]
    hk = key.shape[1] // head_dim if key is not None else 0
    k.rotary(q.data_ptr(), key.data_ptr() if key is not None else 0, positions.data_ptr(), cos_sin.data_ptr(),
             q.shape[0], q.shape[1] // head_dim, hk, head_dim, rot_dim, q.stride(0),
             key.stride(0) if key is not None else 0, neox)


def silu_and_mul(x: torch.Tensor, k=KERNELS) -> torch.Tensor:
    _f32(x, "x")
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=torch.float32)
    k.silu_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], d, x.stride(0), out.stride(0))
    return out


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh", k=KERNELS) -> torch.Tensor:
    _f32(x, "x")
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=torch.float32)
    k.gelu_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], d, x.stride(0), out.stride(0),
                   approximate == "tanh")
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k=KERNELS) -> None:
    """key/value: [T, Hk*D] float32 (rows may be strided); caches [blocks, Hk, block_size, D]."""
    _f32(key, "key")
    _f32(value, "value")
    _, hk, bs, d = k_cache.shape
    k.reshape_and_cache(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        _dtype_code(k_cache.dtype), slot_mapping.data_ptr(), key.shape[0], hk, d, bs,
                        key.stride(0), value.stride(0))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_heads: int, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0, out: torch.Tensor | None = None,
                    group: int | None = None, q_head_offset: int = 0, k=KERNELS) -> torch.Tensor:
    """q: [T, Hq*D] float32 -> out [T, Hq*D] float32. Query head i uses kv head
    (i + q_head_offset) // group; group defaults to Hq / Hk (plain GQA)."""
    _f32(q, "q")
    _, hk, bs, d = k_cache.shape
    if group is None:
        if num_heads % hk:
            raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({hk})")
        group = num_heads // hk
    if not 0 <= q_head_offset < group or (num_heads + q_head_offset + group - 1) // group != hk:
        raise ValueError(f"{num_heads} query heads at offset {q_head_offset} in groups of {group} do not "
                         f"cover exactly {hk} kv heads")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous int32 tensor")
    out = torch.empty((q.shape[0], num_heads * d), dtype=torch.float32) if out is None else out
    k.paged_attention(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      _dtype_code(k_cache.dtype), block_tables.data_ptr(), block_tables.shape[1],
                      seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_lens.shape[0], num_heads, hk, group,
                      q_head_offset, d, bs, scale, sliding_window, softcap, q.stride(0), out.stride(0))
    return out


class PackedWeight:
    """A [N, K] weight packed once into the GEMM kernel's panel layout."""

    __slots__ = ("data", "n", "k", "dtype")

    def __init__(self, weight: torch.Tensor, k=KERNELS):
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        weight = weight.contiguous()
        self.n, self.k = weight.shape
        self.dtype = weight.dtype
        nr = k.gemm_nr
        panels = (self.n + nr - 1) // nr
        self.data = torch.empty(panels * nr * self.k, dtype=weight.dtype)
        k.pack_weight(self.data.data_ptr(), weight.data_ptr(), _dtype_code(weight.dtype), self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           k=KERNELS) -> torch.Tensor:
    """x [M, K] float32 @ W^T (+ bias) -> [M, N] float32."""
    _f32(x, "x")
    if x.shape[1] != w.k:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects {w.k}")
    out = torch.empty((x.shape[0], w.n), dtype=torch.float32) if out is None else out
    k.gemm(out.data_ptr(), x.data_ptr(), w.data.data_ptr(), _dtype_code(w.dtype),
           bias.data_ptr() if bias is not None else 0, x.shape[0], w.n, w.k, x.stride(0), out.stride(0))
    return out
