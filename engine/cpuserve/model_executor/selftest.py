"""`cpuserve selftest`: every native kernel on every ISA this CPU runs (the best
vector path and the scalar fallback), against its torch reference (ops_ref), on
random inputs. It is what an image runs to prove its ISA paths right on the
machine (or emulator) it lands on; tests/engine/model_executor/test_ops.py is
the exhaustive version of the same comparison."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpuserve import _C
from cpuserve.model_executor import ops
from cpuserve.model_executor import ops_ref as ref


@dataclass(frozen=True)
class Check:
    isa: str
    kernel: str
    dtype: str
    max_err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol  # NaN fails


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max())


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return _err(got, want) / max(float(want.double().abs().max()), 1e-30)


def _elementwise(k) -> list[tuple[str, str, float, float]]:
    x, w = torch.randn(7, 577), torch.rand(577) + 0.5
    out = [("rms_norm", "float32", _err(ops.rms_norm(x, w, 1e-5, k=k), ref.rms_norm(x, w, 1e-5)), 1e-4)]
    g = torch.randn(5, 2 * 301) * 4
    out.append(("silu_and_mul", "float32", _err(ops.silu_and_mul(g, k=k), ref.silu_and_mul(g)), 1e-4))
    qk = torch.randn(9, 8 * 64)
    q, key = qk[:, :6 * 64], qk[:, 6 * 64:]
    pos = torch.randint(0, 50, (9,))
    freqs = torch.outer(torch.arange(50).float(), 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    want = ref.rotary(q, pos, cos_sin, 64, True)
    ops.rotary(q, key, pos, cos_sin, 64, True, k=k)
    out.append(("rotary", "float32", _err(q, want), 1e-4))
    return out


def _attention(k, dtype: torch.dtype) -> list[tuple[str, str, float, float]]:
    hk, group, d, bs, nblocks = 2, 3, 64, 16, 12
    k_shape, v_shape = ops.cache_shapes(nblocks, hk, bs, d)
    kc, vc = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    ctx, t = 37, 37
    key, value = torch.randn(t, hk * d), torch.randn(t, hk * d)
    table = torch.randperm(nblocks)[:math.ceil(ctx / bs)].int()
    slots = torch.tensor([int(table[i // bs]) * bs + i % bs for i in range(t)])
    ops.reshape_and_cache(key, value, kc, vc, slots, k=k)
    ref.reshape_and_cache(key, value, kr, vr, slots)
    cache_err = max(_err(kc, kr), _err(vc, vr))
    q = torch.randn(5, hk * group * d)  # the last 5 positions, as a chunked prefill
    args = (kc, vc, table.view(1, -1), torch.tensor([ctx], dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32), hk * group, d ** -0.5)
    pairs = k.bf16_dot and dtype == torch.bfloat16  # bfloat16 pair dot products: probabilities rounded
    got, want = ops.paged_attention(q, *args, k=k), ref.paged_attention(q, *args, bf16_inputs=pairs)
    tol = 1e-4 + (ref.BF16_PROBABILITY_ERROR * float(vr.float().abs().max()) if pairs else 0.0)
    name = str(dtype).replace("torch.", "")
    return [("reshape_and_cache", name, cache_err, 0.0), ("paged_attention", name, _err(got, want), tol)]


def _linear(k, dtype: torch.dtype) -> tuple[str, str, float, float]:
    x, w, b = torch.randn(9, 300), torch.randn(131, 300).to(dtype), torch.randn(131)
    got = ops.linear(x, ops.PackedWeight(w, k=k), b, k=k)
    want = ref.linear(x, w.float(), b, bf16_inputs=k.bf16_dot and dtype == torch.bfloat16)
    return "linear", str(dtype).replace("torch.", ""), _rel_err(got, want), 1e-5


def _w8a8(k) -> list[tuple[str, str, float, float]]:
    """The int8 GEMM, exact integer sums: the reference's bits, for both activation modes."""
    from cpuserve.loading.quant_tensor import Int8Tensor

    w = torch.randint(-128, 128, (131, 301), dtype=torch.int8)
    s, x, b = torch.rand(131) * 0.01, torch.randn(9, 301), torch.randn(131)
    rows = []
    for asym in (False, True):
        got = ops.linear(x, ops.Int8Weight(Int8Tensor(w, s, asym), k=k), b, k=k)
        rows.append(("w8a8_linear", "int8+zp" if asym else "int8", _err(got, ref.w8a8_linear(x, w, s, b, asym)), 0.0))
    return rows


def _random_blocks(qtype: int, n: int, k: int):
    """Random blocks with finite float16 scales (d, and Q4_1's m, at their offsets)."""
    from cpuserve.loading.quant_tensor import QTYPES, QuantTensor

    _, block, nbytes = QTYPES[qtype]
    raw = torch.randint(0, 256, (n * k // block, nbytes), dtype=torch.uint8)
    for at in {3: (0, 2), 8: (0,), 14: (208,)}[qtype]:
        raw[:, at:at + 2] = (torch.rand(len(raw)) * 0.03 + 1e-3).half().view(torch.uint8).view(-1, 2)
    return QuantTensor(raw.view(n, -1), qtype, k)


def _int8_dot(k) -> list[tuple[str, str, float, float]]:
    """--quantized-activations int8: Q4_1, Q8_0 and Q6_K blocks against the activations quantized per group."""
    rows = []
    for qtype, name, group in ((3, "Q4_1", 32), (8, "Q8_0", 32), (14, "Q6_K", 16)):
        qt = _random_blocks(qtype, 67, 512)
        x, b = torch.randn(9, 512), torch.randn(67)
        got = ops.linear(x, ops.QuantWeight(qt, k=k, int8_dot=True), b, k=k)
        rows.append(("int8_dot_linear", name, _rel_err(got, ref.int8_dot_linear(x, qt.dequantize(), group, b)), 1e-5))
    return rows


def run(isas: list[str] | None = None, seed: int = 0) -> list[Check]:
    from cpuserve.platform.isa import supported_dtypes

    checks = []
    for isa in isas or _C.available_isas():
        torch.manual_seed(seed)
        k = _C.Kernels(isa)
        rows = _elementwise(k) + _w8a8(k) + _int8_dot(k)
        for dtype in supported_dtypes():
            rows += _attention(k, dtype)
            rows.append(_linear(k, dtype))
        checks += [Check(isa, *row) for row in rows]
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = [f"{'isa':<12} {'kernel':<18} {'dtype':<9} {'max error':>10} {'tolerance':>10}  result"]
    lines += [f"{c.isa:<12} {c.kernel:<18} {c.dtype:<9} {c.max_err:>10.2e} {c.tol:>10.0e}  {'ok' if c.ok else 'FAIL'}"
              for c in checks]
    return "\n".join(lines)
