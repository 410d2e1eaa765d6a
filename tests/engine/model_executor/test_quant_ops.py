"""The GGUF block-quantized kernels against the torch reference: gguf-py's dequantization
(what transformers runs on a GGUF), then a matmul. Every type the engine keeps, on every
ISA this CPU runs (CPUSERVE_ISA tables), decode- and batch-shaped."""
import gguf
import numpy as np
import pytest
import torch

from cpuserve import _C
from cpuserve.loading.quant_tensor import Q4_ZP, QTYPES, QuantTensor, cat_rows
from cpuserve.model_executor import ops, ops_ref

ISAS = _C.available_isas()
TYPES = [name for name, _, _ in QTYPES.values()]


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantTensor:
    """Blocks from gguf-py's quantizer where it has one (Q4_0 ... Q8_0), else random bytes
    with finite f16 scales (every bit pattern of a K-quant's codes and 6-bit scales is valid)."""
    t = Q4_ZP if qtype == "Q4_ZP" else int(getattr(gguf.GGMLQuantizationType, qtype))
    rng = np.random.default_rng(seed)
    _, block, nbytes = QTYPES[t]
    if t == Q4_ZP:  # AWQ / GPTQ groups: scale, zero point 0..15, a zero byte, codes
        raw = rng.integers(0, 256, size=(n * k // block, nbytes), dtype=np.uint8)
        raw[:, 0:2] = rng.uniform(1e-3, 3e-2, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, 2], raw[:, 3] = rng.integers(0, 16, len(raw)), 0
    elif block == 32:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(n * k // block, nbytes), dtype=np.uint8)
        half = lambda size, sign: (rng.uniform(1e-3, 3e-2, size) * sign).astype(np.float16).view(np.uint8)  # noqa: E731
        if qtype == "Q6_K":
            raw[:, 208:210] = half(len(raw), 1).reshape(-1, 2)
        else:
            raw[:, 0:2] = half(len(raw), 1).reshape(-1, 2)
            raw[:, 2:4] = half(len(raw), rng.choice([-1, 1], len(raw))).reshape(-1, 2)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1)), t, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_quantized_linear_equals_reference(isa, qtype):
    k = _C.Kernels(isa)
    n, kdim = 100, 512
    qt = random_blocks(qtype, n, kdim, seed=len(qtype))
    ref_w = qt.dequantize()  # gguf-py, float32
    w = ops.QuantWeight(qt, k=k)
    padded = -(-n // k.gemm_nr) * k.gemm_nr  # rows padded to whole panels
    assert w.nbytes <= qt.nbytes * padded / n * 1.05  # the blocks, not a widened copy (K-quants unpack scales)
    # every row decodes to the reference dequantization, bit for bit
    ids = torch.randperm(n)
    assert torch.equal(ops.dequantized_rows(w, ids, k=k), ref_w[ids])
    dense = ops.PackedWeight(ref_w, k=k)
    bias = torch.randn(n)
    for m in (1, 2, 3, 8, 9, 17, 33, 64):  # decoded in registers 8 rows a pass up to 32 rows (8 on AVX2)
        x = torch.randn(m, kdim)
        got = ops.linear(x, w, bias, k=k)
        want = torch.addmm(bias.double(), x.double(), ref_w.double().T)  # float64: the rounding is ours
        scale = float((x.abs() @ ref_w.abs().T).max())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * scale)
        # ... and equals the dense kernel on the dequantized weight exactly: quantized weights
        # change nothing but the storage, and a row's result does not depend on the batch
        assert torch.equal(got, ops.linear(x, dense, bias, k=k))
        assert torch.equal(got[-1:], ops.linear(x[-1:].clone(), w, bias, k=k))


def test_strided_output_and_input_rows():
    qt = random_blocks("Q4_1", 64, 96)
    w = ops.QuantWeight(qt)
    x = torch.randn(5, 200)[:, :96]
    out = torch.zeros(5, 80)
    ops.linear(x, w, out=out[:, 8:72])
    torch.testing.assert_close(out[:, 8:72], x @ qt.dequantize().T, rtol=1e-4, atol=1e-4)
    assert not out[:, :8].any() and not out[:, 72:].any()


def test_slicing_permuting_and_concatenating_blocks():
    a, b = random_blocks("Q8_0", 40, 128, seed=1), random_blocks("Q8_0", 24, 128, seed=2)
    full = torch.cat([a.dequantize(), b.dequantize()])
    cat = cat_rows([a, b])
    assert isinstance(cat, QuantTensor) and torch.equal(cat.dequantize(), full)
    assert torch.equal(cat[10:30].dequantize(), full[10:30])
    assert torch.equal(cat[:, 32:96].dequantize(), full[:, 32:96])  # block-aligned: stays quantized
    widened = cat[:, 16:48]  # a shard boundary inside a block: the widened slice
    assert isinstance(widened, torch.Tensor) and torch.equal(widened, full[:, 16:48])
    perm = torch.randperm(64)
    assert torch.equal(cat.permute_rows(perm).dequantize(), full[perm])
    mixed = cat_rows([a, random_blocks("Q5_0", 8, 128)])  # different types: kept apart
    assert isinstance(mixed, list) and len(mixed) == 2


def test_runs_of_one_type_join_into_one_block():
    """A Q4_K_M file's q, k, v as Q5_0, Q5_0, Q8_0: q and k become one block (one GEMM), v its
    own; a run broken by another type stays apart on both sides."""
    q, k, v = (random_blocks(t, n, 128, seed=s) for t, n, s in (("Q5_0", 64, 5), ("Q5_0", 32, 6), ("Q8_0", 32, 7)))
    blocks = cat_rows([q, k, v])
    assert [(b.type_name, b.shape[0]) for b in blocks] == [("Q5_0", 96), ("Q8_0", 32)]
    assert torch.equal(blocks[0].dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    split = cat_rows([q, v, k])
    assert [(b.type_name, b.shape[0]) for b in split] == [("Q5_0", 64), ("Q8_0", 32), ("Q5_0", 32)]
    w = ops.pack(blocks, torch.float32)
    assert ops.storage_name(w) == "Q5_0+Q8_0" and len(w.parts) == 2
    ref = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    x = torch.randn(3, 128)
    torch.testing.assert_close(ops.linear(x, w), x @ ref.T, rtol=1e-4, atol=1e-4)


def test_stacked_weight_of_mixed_types_fills_its_columns():
    parts = [random_blocks("Q5_0", 64, 128, seed=3), random_blocks("Q8_0", 32, 128, seed=4),
             torch.randn(16, 128)]
    w = ops.pack(parts, torch.float32)
    assert ops.storage_name(w) == "Q5_0+Q8_0+float32"
    ref = torch.cat([parts[0].dequantize(), parts[1].dequantize(), parts[2]])
    bias = torch.randn(112)
    for m in (1, 9):
        x = torch.randn(m, 128)
        torch.testing.assert_close(ops.linear(x, w, bias), torch.addmm(bias, x, ref.T), rtol=1e-4, atol=1e-4)


def test_permuted_inputs_follow_the_weight():
    """GPTQ act-order: the weight stores its input features permuted; dequantize() gives them
    back in the original order and the layer gathers its input the same way."""
    from cpuserve.model_executor.layers.linear import Linear
    qt = random_blocks("Q4_ZP", 48, 128, seed=9)
    perm = torch.randperm(128)
    qt.input_perm = perm
    layer = Linear(qt, None, torch.float32)
    x = torch.randn(3, 128)
    w = qt.dequantize()
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be split by input features"):
        qt[:, :64]


def test_clear_errors():
    qt = random_blocks("Q4_0", 32, 64)
    with pytest.raises(ValueError, match="does not hold rows of 96 weights"):
        QuantTensor(qt.data, qt.qtype, 96)
    with pytest.raises(ValueError, match="not a multiple of the block"):
        ops.KERNELS.qpacked_bytes(2, 32, 48)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type"):
        ops.KERNELS.qpacked_bytes(10, 32, 256)  # Q2_K: not kept in blocks (widened at load)
    with pytest.raises(IndexError, match="out of range"):
        ops.dequantized_rows(ops.QuantWeight(qt), torch.tensor([32]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_quantized_gate_up_with_silu_equals_the_two_kernels(isa, qtype):
    """ops.linear_silu on a GGUF gate/up weight (F = 96: whole panels on every ISA; F = 40: not on
    AVX-512), on the float path and on int8 dot products: bit for bit the GEMM then
    silu_and_mul, decode- and batch-shaped."""
    k = _C.Kernels(isa)
    for f in (96, 40):
        qt = random_blocks(qtype, 2 * f, 512, seed=len(qtype) + f)
        for w in (ops.QuantWeight(qt, k=k), ops.QuantWeight(qt, k=k, int8_dot=True)):
            if w.int8_dot and not ops.int8_dot_supported(w.qtype):
                continue
            for m in (1, 2, 3, 8, 9, 33, 64):
                x = torch.randn(m, 512)
                want = ops.silu_and_mul(ops.linear(x, w, k=k), k=k)
                assert torch.equal(ops.linear_silu(x, w, k=k), want), (f, m, w.type_name)


DOT_TYPES = [name for t, (name, _, _) in QTYPES.items() if ops.int8_dot_supported(t)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", DOT_TYPES)
def test_int8_dot_linear_equals_reference(isa, qtype):
    """--quantized-activations int8: the activations quantized per group (ops_ref.quantize_groups),
    the weights exactly the float path's; equal to the float64 reference up to float32 rounding,
    the same bits at every batch size, and embedding rows equal to the float path's."""
    k = _C.Kernels(isa)
    n, kdim = 100, 512
    qt = random_blocks(qtype, n, kdim, seed=len(qtype) + 7)
    ref_w = qt.dequantize()
    w = ops.QuantWeight(qt, k=k, int8_dot=True)
    assert w.int8_dot and w.type_name.endswith(" x int8")
    ids = torch.randperm(n)
    assert torch.equal(ops.dequantized_rows(w, ids, k=k), ref_w[ids])
    group = 16 if qtype == "Q6_K" else 32
    bias = torch.randn(n)
    for m in (1, 3, 4, 5, 64):
        x = torch.randn(m, kdim)
        x[0, :group] = 0.0  # a group of zeros
        got = ops.linear(x, w, bias, k=k)
        want = ops_ref.int8_dot_linear(x, ref_w, group, bias)
        q, s = ops_ref.quantize_groups(x, group)
        scale = float(((q.abs().reshape(m, -1, group) * s.unsqueeze(2)).reshape(m, kdim) @ ref_w.abs().T).max())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
        assert torch.equal(got[-1:], ops.linear(x[-1:].clone(), w, bias, k=k))


def test_int8_dot_is_chosen_within_quantized_activations_only():
    q41, q80 = random_blocks("Q4_1", 64, 64), random_blocks("Q8_0", 64, 64)
    assert not ops.pack(q41, torch.float32).int8_dot
    with ops.quantized_activations("int8"):
        w41, w80 = ops.pack(q41, torch.float32), ops.pack(q80, torch.float32)
    assert w41.int8_dot and w80.int8_dot
    assert ops.storage_name(w41) == "Q4_1 x int8" and ops.storage_name(w80) == "Q8_0 x int8"
    # the blocks' own bytes, regrouped: nibbles (and a plane of fifth bits), float16 d (and m)
    with ops.quantized_activations("int8"):
        q50, q4k, q6k = (random_blocks(t, 64, k) for t, k in (("Q5_0", 64), ("Q4_K", 256), ("Q6_K", 256)))
        w50, w4k, w6k = (ops.pack(q, torch.float32) for q in (q50, q4k, q6k))
    assert (w41.nbytes, w80.nbytes, w50.nbytes) == (q41.nbytes, q80.nbytes, q50.nbytes)
    # K-quants: float32 S and O a group of 32 (Q4_K); Q6_K's 6-bit codes as nibbles and a plane of
    # bits 4-5, and float32 S alone a group of 16 (O = -32 S)
    assert w4k.nbytes == 64 * 256 * (4 + 64 / 32) // 8
    assert w6k.nbytes == 64 * 256 * (6 + 32 / 16) // 8
    with pytest.raises(ValueError, match="none or int8"):
        with ops.quantized_activations("fp8"):
            pass
