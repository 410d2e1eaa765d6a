"""Torch-facing wrappers of the native kernels (cpuserve._C).

Activations are float32 tensors; weights and the KV cache may be float32,
bfloat16 or float16. Every wrapper checks what the kernel relies on (dtype,
contiguity of the innermost dimension, shapes) and passes raw addresses, so the
native side needs no torch headers. `KERNELS` is the table for this CPU's best
ISA, or the one named by CPUSERVE_ISA.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import time

import torch

from cpuserve import _C

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
for _code, _name in ((3, "float8_e5m2"), (4, "float8_e4m3fn")):  # KV cache only; torch >= 2.1
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code


def _load_kernels() -> "_C.Kernels":
    isa = os.environ.get("CPUSERVE_ISA", "")
    try:
        return _C.Kernels(isa)
    except ValueError as e:
        raise RuntimeError(f"CPUSERVE_ISA={isa!r}: {e}; available here: {_C.available_isas()}") from None


def _decode_fetch() -> None:
    """CPUSERVE_DECODE_FETCH, where set, over the choice made for this CPU's vendor (_C.decode_fetch;
    csrc/kernels/prefetch.hpp, DecodeFetch): how decode GEMVs ask for their weights' lines."""
    name = os.environ.get("CPUSERVE_DECODE_FETCH", "")
    if name:
        try:
            _C.set_decode_fetch(name)
        except ValueError as e:
            raise RuntimeError(f"CPUSERVE_DECODE_FETCH={name!r}: {e}") from None


KERNELS = _load_kernels()
_decode_fetch()


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


def read_sum(x: torch.Tensor, k=KERNELS) -> float:
    """The sum of a contiguous float32 tensor, every thread streaming its share with vector loads:
    the bandwidth probe of `cpuserve bench` (the way the decode GEMV reads its weights)."""
    _f32(x, "x")
    if not x.is_contiguous():
        raise ValueError("read_sum: x must be contiguous")
    return k.read_sum(x.data_ptr(), x.numel())


def peak_gflops(pairs: bool = False, seconds: float = 0.05, repeats: int = 3, k=KERNELS) -> float | None:
    """The arithmetic peak in GFLOP/s (best of `repeats` runs of about `seconds`): independent
    multiply-add chains in registers on every thread, float FMAs or, with `pairs`, the bfloat16
    pair dot products that this table's bfloat16 GEMMs run on (AMX tile dot products on the amx
    table; None where it has none)."""
    if k.peak_flops(pairs, 1) < 0:
        return None
    t0 = time.perf_counter()
    k.peak_flops(pairs, 100_000)  # sizes the timed runs (and wakes the threads)
    steps = max(100_000, int(100_000 * seconds / max(time.perf_counter() - t0, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        flops = k.peak_flops(pairs, steps)
        best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    return best


def argmax(x: torch.Tensor, k=KERNELS) -> torch.Tensor:
    """x.argmax(dim=-1) of float32 rows [R, V], the same answer (first index of the largest value,
    a NaN the largest), each row in vectors and the rows shared among the threads."""
    _f32(x, "x")
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: x must be [rows, n] with n > 0, got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    k.argmax(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0))
    return out


def greedy_head(approx: torch.Tensor, x: torch.Tensor, w: "PackedWeight", norms: torch.Tensor, norm_max: float,
                error_norms: bool = False, k=KERNELS) -> tuple[torch.Tensor, int]:
    """argmax(linear(x, w)) for a float32 packed `w` [V, K], decided from approx = linear(x, the
    same weight packed in bfloat16) and norms[t] >= |w_t| (or, `error_norms`, from approx =
    linear(x, any copy computed in float32) and norms[t] >= that copy's error per unit |x|:
    layers/embedding.py copy_errors_above): (tokens [R] int64, -1 where a row is undecided, and
    how many are). The same tokens as ops.argmax(linear(x, w)), bit for bit (kernels/
    greedy_head.hpp has the bound and why)."""
    _f32(approx, "approx")
    _f32(x, "x")
    if not isinstance(w, PackedWeight) or w.dtype != torch.float32:
        raise TypeError("greedy_head: w must be a float32 weight from pack()")
    if approx.shape != (x.shape[0], w.n) or x.shape[1] != w.k or norms.shape != (w.n,) or norms.dtype != torch.float32:
        raise ValueError(f"greedy_head: approx {tuple(approx.shape)}, x {tuple(x.shape)} and norms "
                         f"{tuple(norms.shape)} do not fit a [{w.n}, {w.k}] weight")
    out, norms = torch.empty(x.shape[0], dtype=torch.int64), norms.contiguous()
    undecided = k.greedy_head(out.data_ptr(), approx.data_ptr(), approx.stride(0), x.data_ptr(), x.stride(0),
                              w.data.data_ptr(), norms.data_ptr(), norm_max, int(error_norms), x.shape[0], w.n, w.k)
    return out, undecided


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


def cache_shapes(blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[tuple, tuple]:
    """The key cache's and the value cache's shapes: keys transposed in each block (head_dim-major,
    as vLLM's CPU backend keeps them), values token-major; a bfloat16 cache orders each tile's
    elements in pairs inside these shapes (ops_ref.paired)."""
    return (blocks, kv_heads, head_dim, block_size), (blocks, kv_heads, block_size, head_dim)


def _cache_dims(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    nb, hk, bs, d = v_cache.shape
    if tuple(k_cache.shape) != cache_shapes(nb, hk, bs, d)[0] or k_cache.dtype != v_cache.dtype \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous, of one dtype, k_cache {cache_shapes(nb, hk, bs, d)[0]} for "
                         f"v_cache {tuple(v_cache.shape)}; got k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype == torch.bfloat16 and (d % 2 or bs % 2):  # (kernels/cache.hpp, ops_ref.paired)
        raise ValueError(f"a {v_cache.dtype} cache keeps its tiles in pairs: head_dim ({d}) and block_size ({bs}) "
                         "must be even")
    return hk, bs, d


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0, k=KERNELS) -> None:
    """key/value: [T, Hk*D] float32 (rows may be strided); k_cache [blocks, Hk, D, block_size]
    (keys transposed in each block), v_cache [blocks, Hk, block_size, D], holding key / k_scale
    and value / v_scale (a float8 cache's per-tensor scales)."""
    _f32(key, "key")
    _f32(value, "value")
    hk, bs, d = _cache_dims(k_cache, v_cache)
    k.reshape_and_cache(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        _dtype_code(k_cache.dtype), slot_mapping.data_ptr(), key.shape[0], hk, d, bs,
                        key.stride(0), value.stride(0), k_scale, v_scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_heads: int, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0, out: torch.Tensor | None = None,
                    group: int | None = None, q_head_offset: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
                    k=KERNELS) -> torch.Tensor:
    """q: [T, Hq*D] float32 -> out [T, Hq*D] float32. Query head i uses kv head
    (i + q_head_offset) // group; group defaults to Hq / Hk (plain GQA)."""
    _f32(q, "q")
    hk, bs, d = _cache_dims(k_cache, v_cache)
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
                      q_head_offset, d, bs, scale, sliding_window, softcap, q.stride(0), out.stride(0), k_scale,
                      v_scale)
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
        align = k.bf16_k_align if weight.dtype == torch.bfloat16 else 2  # bf16 pairs: K even, AMX tiles: 32
        self.data = _weight_buffer(panels * nr * (-(-self.k // align) * align), weight.dtype)
        k.pack_weight(self.data.data_ptr(), weight.data_ptr(), _dtype_code(weight.dtype), self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class QuantWeight:
    """A [N, K] GGUF block-quantized weight (loading.quant_tensor.QuantTensor), its blocks
    regrouped into the quantized GEMM's panels: the same bytes, never widened.

    int8_dot: the int8-dot GEMM's panels instead (kernels/qdot.hpp): each weight's code with
    its group's scale and offset, and the layer's input quantized to int8 per group on the fly
    (llama.cpp's scheme). The legacy block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) keep their
    blocks' float16 scale (and min), so their panels are the file's bytes; the K-quants and
    AWQ / GPTQ blocks (Q4_ZP) keep a float32 scale and offset per group."""

    __slots__ = ("data", "n", "k", "qtype", "type_name", "int8_dot")

    def __init__(self, weight, k=KERNELS, int8_dot: bool = False):
        self.n, self.k = weight.shape
        self.qtype, self.int8_dot = weight.qtype, int8_dot
        self.type_name = weight.type_name + (" x int8" if int8_dot else "")
        size = k.qdpacked_bytes(self.qtype, self.n, self.k) if int8_dot else k.qpacked_bytes(self.qtype, self.n, self.k)
        self.data = _weight_buffer(size, torch.uint8)
        (k.qdpack if int8_dot else k.qpack)(self.data.data_ptr(), weight.data.data_ptr(), self.qtype, self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class Int8Weight:
    """A [N, K] W8A8 weight (loading.quant_tensor.Int8Tensor) in the int8 GEMM's panels, with
    its per-channel scales and column sums; the layer's input is quantized per token on the fly."""

    __slots__ = ("data", "n", "k", "act_asym")

    def __init__(self, weight, k=KERNELS):
        self.n, self.k = weight.shape
        self.act_asym = weight.act_asym
        data = weight.data.contiguous()
        self.data = _weight_buffer(k.i8packed_bytes(self.n, self.k), torch.uint8)
        k.i8pack(self.data.data_ptr(), data.data_ptr(), weight.scale.data_ptr(), self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class StackedWeight:
    """Row blocks of different storage (a fused projection whose parts were quantized to
    different types, as in Q4_K_M files): each part fills its own output columns."""

    __slots__ = ("parts", "n", "k")

    def __init__(self, parts: list):
        self.parts = parts
        self.n, self.k = sum(p.n for p in parts), parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


# Weight kinds are told by their attributes, not their classes: a test may reload this module
# (CPUSERVE_ISA) while models built with the earlier classes are still alive.
def is_stacked(w) -> bool:
    return hasattr(w, "parts")


def is_quantized(w) -> bool:
    return hasattr(w, "qtype")


def is_int8(w) -> bool:
    return hasattr(w, "act_asym")


def is_packed(w) -> bool:
    """A GEMM weight of any kind (ops.pack's result, stacked ones excepted)."""
    return not isinstance(w, torch.Tensor) and hasattr(w, "data") and hasattr(w, "n") and hasattr(w, "k") \
        and (hasattr(w, "qtype") or hasattr(w, "dtype") or hasattr(w, "act_asym"))


def int8_dot_supported(qtype: int, k=KERNELS) -> bool:
    """Whether the int8-dot GEMM runs this block type (every kept GGUF block type, and AWQ / GPTQ
    groups): the kernels' own answer, for rows of 256 weights (a multiple of every block)."""
    return k.qdpacked_bytes(qtype, 1, 256) >= 0


_ACTIVATIONS = contextvars.ContextVar("quantized_activations", default="none")


@contextlib.contextmanager
def quantized_activations(mode: str):
    """Within: pack() puts block-quantized weights (GGUF, AWQ, GPTQ) on the int8-dot GEMM (where
    int8_dot_supported) when mode is "int8" (--quantized-activations); "none" keeps float32
    activations."""
    if mode not in ("none", "int8"):
        raise ValueError(f"quantized activations must be none or int8, got {mode!r}")
    token = _ACTIVATIONS.set(mode)
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


_WEIGHT_ARENA = contextvars.ContextVar("weight_arena", default=None)


@contextlib.contextmanager
def weights_in(arena):
    """Within: packed weights are placed in `arena` (platform.pages.HugeArena: huge pages),
    else each in its own torch.empty."""
    token = _WEIGHT_ARENA.set(arena)
    try:
        yield
    finally:
        _WEIGHT_ARENA.reset(token)


def _weight_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    arena = _WEIGHT_ARENA.get()
    return torch.empty(numel, dtype=dtype) if arena is None else arena.empty(numel, dtype)


def pack(weight, dtype: torch.dtype):
    """The GEMM form of a weight: dense tensors packed in `dtype`, quantized ones in their
    blocks, a list of row blocks (loading.quant_tensor.cat_rows) part by part."""
    if isinstance(weight, list):
        return StackedWeight([pack(p, dtype) for p in weight])
    if isinstance(weight, torch.Tensor):
        return PackedWeight(weight.to(dtype))
    if is_int8(weight):
        return Int8Weight(weight)
    return QuantWeight(weight, int8_dot=_ACTIVATIONS.get() == "int8" and int8_dot_supported(weight.qtype))


def storage_name(w) -> str:
    """How a packed weight is stored: 'float32', 'Q4_1', 'Q5_0+Q8_0', ..."""
    if is_stacked(w):
        return "+".join(dict.fromkeys(storage_name(p) for p in w.parts))
    if is_int8(w):
        return "int8 (W8A8, asymmetric activations)" if w.act_asym else "int8 (W8A8)"
    return w.type_name if is_quantized(w) else str(w.dtype).removeprefix("torch.")


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           k=KERNELS) -> torch.Tensor:
    """x [M, K] float32 @ W^T (+ bias) -> [M, N] float32; W from pack()."""
    _f32(x, "x")
    if x.shape[1] != w.k:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects {w.k}")
    out = torch.empty((x.shape[0], w.n), dtype=torch.float32) if out is None else out
    parts = w.parts if is_stacked(w) else [w]
    col = 0
    for p in parts:
        o = out[:, col:col + p.n] if len(parts) > 1 else out
        b = 0 if bias is None else bias[col:col + p.n].data_ptr()
        if is_int8(p):
            k.i8gemm(o.data_ptr(), x.data_ptr(), p.data.data_ptr(), b, x.shape[0], p.n, p.k, x.stride(0), o.stride(0),
                     p.act_asym)
        elif is_quantized(p):
            run = k.qdgemm if p.int8_dot else k.qgemm
            run(o.data_ptr(), x.data_ptr(), p.data.data_ptr(), p.qtype, b, x.shape[0], p.n, p.k, x.stride(0),
                o.stride(0))
        else:
            k.gemm(o.data_ptr(), x.data_ptr(), p.data.data_ptr(), _dtype_code(p.dtype), b, x.shape[0], p.n, p.k,
                   x.stride(0), o.stride(0))
        col += p.n
    return out


def linear_silu(x: torch.Tensor, w, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                k=KERNELS) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T) -> [M, F] for a gate/up weight W = [Wg; Wu] ([2F, K], from
    pack()): on dense, GGUF and W8A8 weights one fused pass (kernels/gated_gemm.hpp), else (a
    bias, parts of different storage) linear() then silu_and_mul(); the same bits either way."""
    if bias is not None or is_stacked(w):
        act = silu_and_mul(linear(x, w, bias, k=k), k=k)
        return act if out is None else out.copy_(act)
    _f32(x, "x")
    if x.shape[1] != w.k:
        raise ValueError(f"linear_silu: input has {x.shape[1]} features, weight expects {w.k}")
    if w.n % 2:
        raise ValueError(f"linear_silu: a gate/up weight has an even number of rows, got {w.n}")
    f = w.n // 2
    out = torch.empty((x.shape[0], f), dtype=torch.float32) if out is None else out
    if out.shape != (x.shape[0], f) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"linear_silu: out must be float32 [{x.shape[0]}, {f}] with unit column stride")
    if is_int8(w):
        k.i8gemm_silu(out.data_ptr(), x.data_ptr(), w.data.data_ptr(), x.shape[0], f, w.k, x.stride(0), out.stride(0),
                      w.act_asym)
    elif is_quantized(w):
        run = k.qdgemm_silu if w.int8_dot else k.qgemm_silu
        run(out.data_ptr(), x.data_ptr(), w.data.data_ptr(), w.qtype, x.shape[0], f, w.k, x.stride(0), out.stride(0))
    else:
        k.gemm_silu(out.data_ptr(), x.data_ptr(), w.data.data_ptr(), _dtype_code(w.dtype), x.shape[0], f, w.k,
                    x.stride(0), out.stride(0))
    return out


def dequantized_rows(w: QuantWeight, ids: torch.Tensor, k=KERNELS) -> torch.Tensor:
    """float32 rows `ids` of a quantized weight (an embedding lookup): [len(ids), K]."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.n):
        raise IndexError(f"row index out of range for a weight of {w.n} rows")
    out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
    (k.qdrows if w.int8_dot else k.qrows)(out.data_ptr(), w.data.data_ptr(), w.qtype, ids.data_ptr(), ids.numel(), w.k)
    return out
