"""The W8A8 GEMM against its torch reference (ops_ref.w8a8_linear: per-token activation
codes, exact integer sums, then float32), bit for bit on every ISA this CPU runs (AVX-512 with
and without VNNI, AVX2; NEON, its dot-product variant and VXE in the C++ tests under qemu)."""
import pytest
import torch

from cpuserve import _C
from cpuserve.loading.quant_tensor import Int8Tensor, cat_rows
from cpuserve.model_executor import ops, ops_ref

ISAS = _C.available_isas()


def random_int8(n: int, k: int, seed: int = 0, asym: bool = False) -> Int8Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return Int8Tensor(data, torch.rand(n, generator=g) * 0.02 + 1e-4, asym)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("asym", [False, True], ids=["symmetric", "zero-point"])
def test_w8a8_linear_equals_reference(isa, asym):
    k = _C.Kernels(isa)
    n, kdim = 100, 579  # neither a multiple of a panel nor of 4
    wt = random_int8(n, kdim, seed=3, asym=asym)
    w = ops.Int8Weight(wt, k=k)
    assert w.nbytes < n * kdim * 1.5  # one byte a weight (panels padded), not a widened copy
    bias = torch.randn(n)
    for m in (1, 2, 3, 17, 64, 300):
        x = torch.randn(m, kdim) * 3 + (0.5 if asym else 0.0)
        x[0, :7] = 0.0
        if m > 2:
            x[1] = 0.0  # a row of zeros: scale 1, codes 0
        got = ops.linear(x, w, bias, k=k)
        assert torch.equal(got, ops_ref.w8a8_linear(x, wt.data, wt.scale, bias, asym)), (isa, m)
        # a row's result does not depend on the batch it is computed in
        assert torch.equal(got[-1:], ops.linear(x[-1:].clone(), w, bias, k=k))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("asym", [False, True], ids=["symmetric", "zero-point"])
@pytest.mark.parametrize("f", [1536, 96, 40], ids=["smollm2", "f96", "not-a-panel-multiple"])
def test_w8a8_gate_up_with_silu_equals_the_reference(isa, asym, f):
    """The fused W8A8 gate/up with SiLU-and-mul (gated_gemm.hpp): bit for bit the two kernels
    apart (which the engine ran before), and torch's reference within the vector exp's rounding,
    at decode and batch row counts."""
    k = _C.Kernels(isa)
    kdim = 97
    wt = random_int8(2 * f, kdim, seed=f, asym=asym)
    w = ops.Int8Weight(wt, k=k)
    for m in (1, 2, 3, 5, 64):
        x = torch.randn(m, kdim) * 3 + (0.5 if asym else 0.0)
        if m > 2:
            x[1] = 0.0
        got = ops.linear_silu(x, w, k=k)
        assert torch.equal(got, ops.silu_and_mul(ops.linear(x, w, k=k), k=k)), (isa, m)
        want = ops_ref.silu_and_mul(ops_ref.w8a8_linear(x, wt.data, wt.scale, None, asym))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_is_close_to_the_float_product():
    """What quantizing the activations costs, on a random layer: about 1% of the output's scale."""
    wt = random_int8(64, 512, seed=4)
    x = torch.randn(8, 512)
    exact = x @ wt.dequantize().T
    for asym in (False, True):
        got = ops.linear(x, ops.Int8Weight(Int8Tensor(wt.data, wt.scale, asym)))
        err = (got - exact).abs().max() / exact.abs().max()
        assert err < 0.02, (asym, float(err))


def test_strided_output_and_stacked_with_other_kinds():
    wt = random_int8(64, 96, seed=5)
    w = ops.Int8Weight(wt)
    x = torch.randn(5, 200)[:, :96]
    out = torch.zeros(5, 80)
    ops.linear(x, w, out=out[:, 8:72])
    assert torch.equal(out[:, 8:72], ops_ref.w8a8_linear(x, wt.data, wt.scale))
    assert not out[:, :8].any() and not out[:, 72:].any()
    dense = torch.randn(16, 96)
    stacked = ops.pack([wt, dense], torch.float32)
    assert ops.storage_name(stacked) == "int8 (W8A8)+float32"
    got = ops.linear(x.contiguous(), stacked)
    assert torch.equal(got[:, :64], ops_ref.w8a8_linear(x, wt.data, wt.scale))


def test_rows_columns_permutations_and_fused_projections():
    a, b = random_int8(40, 128, seed=1), random_int8(24, 128, seed=2)
    full = torch.cat([a.dequantize(), b.dequantize()])
    cat = cat_rows([a, b])
    assert isinstance(cat, Int8Tensor) and torch.equal(cat.dequantize(), full)
    assert torch.equal(cat[10:30].dequantize(), full[10:30])
    assert torch.equal(cat[:, 32:96].dequantize(), full[:, 32:96])  # column shards keep every scale
    perm = torch.randperm(64)
    assert torch.equal(cat.permute_rows(perm).dequantize(), full[perm])
    assert isinstance(cat_rows([a, random_int8(8, 128, asym=True)]), list)  # activation modes differ: apart


def test_clear_errors():
    with pytest.raises(ValueError, match="one scale per row"):
        Int8Tensor(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="expected int8"):
        Int8Tensor(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="input has 8 features, weight expects 16"):
        ops.linear(torch.randn(2, 8), ops.Int8Weight(random_int8(4, 16)))
