"""Every native kernel against its torch reference (cpuserve.model_executor.ops_ref), on every ISA
this CPU runs (the best vector path and the scalar fallback), random odd shapes,
GQA ratios 1/4/8, block sizes 16/32/128 and every storage dtype."""
import math

import pytest
import torch

from cpuserve import _C
from cpuserve.model_executor import ops_ref as ref
from cpuserve.model_executor import ops

ISAS = _C.available_isas()
STORAGE = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=ISAS)
def kern(request):
    return _C.Kernels(request.param)


def test_best_isa_is_default():
    assert ops.KERNELS.isa == ISAS[0]


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 33), (3, 1000)])
def test_rms_norm(kern, rows, dim):
    torch.manual_seed(rows * dim)
    x, w = torch.randn(rows, dim), torch.rand(dim) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, k=kern), ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 37)])
def test_fused_add_rms_norm(kern, rows, dim):
    torch.manual_seed(dim)
    x, r, w = torch.randn(rows, dim), torch.randn(rows, dim), torch.rand(dim)
    want_x, want_r = ref.fused_add_rms_norm(x, r, w, 1e-6)
    ops.fused_add_rms_norm(x, r, w, 1e-6, k=kern)
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(x, want_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 64), (80, 80), (24, 24)])
def test_rotary(kern, neox, head_dim, rot_dim):
    torch.manual_seed(head_dim + rot_dim)
    t, hq, hk, max_pos = 9, 6, 2, 100
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim)  # q and k are strided views, as in the models
    q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim:(hq + hk) * head_dim]
    pos = torch.randint(0, max_pos, (t,))
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    want_q, want_k = ref.rotary(q, pos, cos_sin, head_dim, neox), ref.rotary(k, pos, cos_sin, head_dim, neox)
    ops.rotary(q, k, pos, cos_sin, head_dim, neox, k=kern)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,d", [(1, 1536), (5, 37), (16, 64)])
def test_silu_and_mul(kern, t, d):
    x = torch.randn(t, 2 * d) * 4
    torch.testing.assert_close(ops.silu_and_mul(x, k=kern), ref.silu_and_mul(x), rtol=1e-5, atol=1e-5)


def _argmax_rows(n: int) -> torch.Tensor:
    """Rows that catch every way an argmax can differ from torch's: ties inside and across blocks,
    masked (-inf) and all -inf rows, NaN (torch picks the first), infinities, sums that overflow,
    signed zeros, and the largest value in the tail after the last whole block."""
    torch.manual_seed(n)
    x = torch.randn(12, n) * 5
    big = float(torch.finfo(torch.float32).max)
    x[1, n // 3] = x[1, n - 1] = x[1].max() + 1  # a tie across blocks: the first wins
    x[2, 1] = x[2, 2] = x[2].max() + 1           # inside a block
    x[3].fill_(float("-inf"))
    x[4, : n // 2] = float("-inf")               # masked as a grammar or min_tokens does
    x[5, n // 2] = float("nan")
    x[5, n // 4] = x[5].nan_to_num().max() + 1   # a larger value before the NaN: the NaN still wins
    x[6, n // 3] = x[6, n - 1] = float("nan")
    x[7, n // 2] = float("inf")
    x[8, :] = big                                # every sum overflows; index 0
    x[8, n - 1] = float("inf")
    x[9].zero_()
    x[9, 0], x[9, n // 2] = -0.0, 0.0            # signed zeros compare equal: index 0
    x[10, n - 1] = x[10].max() + 1               # in the tail
    x[11] = torch.arange(n, dtype=torch.float32)  # every block better than the last
    return x


@pytest.mark.parametrize("n", [3, 17, 300, 1000, 49152])
def test_argmax(kern, n):
    x = _argmax_rows(n)
    torch.testing.assert_close(ops.argmax(x, k=kern), ref.argmax(x), rtol=0, atol=0)
    wide = torch.randn(5, n + 40)[:, 3:n + 3]  # rows strided in memory
    torch.testing.assert_close(ops.argmax(wide, k=kern), ref.argmax(wide), rtol=0, atol=0)


def test_argmax_rejects_bad_input():
    with pytest.raises(TypeError, match="float32"):
        ops.argmax(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[rows, n\]"):
        ops.argmax(torch.zeros(5))


@pytest.mark.parametrize("n", [50, 5003])
def test_greedy_head(kern, n):
    """The greedy LM head's token is the float32 GEMM's argmax bit for bit (ops.argmax of
    ops.linear on the same table), and torch's argmax where the top two logits are apart: on rows
    far apart, a near tie closer than the bfloat16 copy can resolve, an exact tie (the first index
    wins), a zero row, strided rows; a NaN or an infinity leaves its row undecided (-1)."""
    from cpuserve.model_executor.layers.embedding import row_norms_above
    torch.manual_seed(n)
    k = 576
    w = torch.randn(n, k) * 0.13
    w[n - 1] = w[7] * (1 + 1e-6 * (torch.arange(k) % 3))  # 7 and n - 1: logits closer than bfloat16 tells
    w[31] = w[30]                                        # an exact tie
    x = torch.randn(7, k + 3)[:, 2:k + 2] * 2            # strided rows
    x[1] = 4 * w[7]
    x[2] = 5 * w[30]
    x[3] = 0
    x[4, 5] = float("nan")
    x[5, 9] = float("inf")
    pw, pb = ops.PackedWeight(w, k=kern), ops.PackedWeight(w.bfloat16(), k=kern)
    norms = row_norms_above(w)
    assert bool((norms.double() >= w.double().norm(dim=1)).all())
    tokens, undecided = ops.greedy_head(ops.linear(x, pb, k=kern), x, pw, norms, float(norms.max()), k=kern)
    want = ops.argmax(ops.linear(x, pw, k=kern), k=kern)
    assert undecided == 2 and tokens[4] == tokens[5] == -1
    keep = [0, 1, 2, 3, 6]
    assert torch.equal(tokens[keep], want[keep])
    assert tokens[2] == 30 and tokens[3] == 0
    logits = ref.linear(x.double(), w.double(), None)
    top2 = logits[keep].topk(2, dim=1)
    apart = (top2.values[:, 0] - top2.values[:, 1]) > 1e-3
    assert torch.equal(tokens[keep][apart], top2.indices[:, 0][apart])


def test_greedy_head_rejects_bad_input():
    w = ops.PackedWeight(torch.randn(40, 8))
    x, norms = torch.randn(2, 8), torch.ones(40)
    with pytest.raises(TypeError, match="float32 weight"):
        ops.greedy_head(torch.zeros(2, 40), x, ops.PackedWeight(torch.randn(40, 8).bfloat16()), norms, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        ops.greedy_head(torch.zeros(2, 39), x, w, norms, 1.0)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_and_mul(kern, approximate):
    x = torch.randn(7, 2 * 45) * 3
    torch.testing.assert_close(ops.gelu_and_mul(x, approximate, k=kern), ref.gelu_and_mul(x, approximate),
                               rtol=1e-5, atol=1e-5)


def prompt_slots(block_size: int) -> torch.Tensor:
    """Slots as prompts have them: runs of consecutive slots, longer than the kernel's 16-token
    runs, crossing a block boundary, broken by a padding slot and by a jump to another block."""
    first = torch.arange(block_size - 5, block_size + 30)            # block 0's tail into block 1
    second = torch.arange(4 * block_size + 3, 4 * block_size + 24)  # mid-block in block 4
    return torch.cat([first[:20], torch.tensor([-1]), first[20:], second])


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("pattern", ["scattered", "prompt"])
def test_reshape_and_cache(kern, dtype, block_size, pattern):
    torch.manual_seed(block_size)
    hk, d, nblocks = 3, 40, 6
    if pattern == "prompt":
        slots = prompt_slots(block_size)
    else:
        slots = torch.randperm(nblocks * block_size)[:13]
        slots[4] = -1  # padding slot: skipped
    t = len(slots)
    key, value = torch.randn(t, hk * d), torch.randn(t, hk * d)
    k_shape, v_shape = ops.cache_shapes(nblocks, hk, block_size, d)
    kc, vc = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    ops.reshape_and_cache(key, value, kc, vc, slots, k=kern)
    ref.reshape_and_cache(key, value, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_bfloat16_cache_tiles_are_paired(kern):
    """A bfloat16 cache's key tile is [D/2][block_size][2] and its value tile [block_size/2][D][2]
    (kernels/cache.hpp): key j's dimensions 2i, 2i + 1 side by side, keys 2i, 2i + 1's values too."""
    hk, d, bs = 2, 8, 16
    key, value = torch.randn(3, hk * d), torch.randn(3, hk * d)
    k_shape, v_shape = ops.cache_shapes(2, hk, bs, d)
    kc, vc = torch.zeros(k_shape, dtype=torch.bfloat16), torch.zeros(v_shape, dtype=torch.bfloat16)
    ops.reshape_and_cache(key, value, kc, vc, torch.tensor([bs + 5, bs + 6, 3]), k=kern)
    kt, vt = kc.view(2, hk, d // 2, bs, 2), vc.view(2, hk, bs // 2, d, 2)
    k, v = key.bfloat16().view(3, hk, d), value.bfloat16().view(3, hk, d)
    assert torch.equal(kt[1, :, :, 5], k[0].view(hk, d // 2, 2)) and torch.equal(kt[0, :, :, 3], k[2].view(hk, d // 2, 2))
    assert torch.equal(vt[1, :, 2, :, 1], v[0]) and torch.equal(vt[1, :, 3, :, 0], v[1])
    assert torch.equal(vt[0, :, 1, :, 1], v[2])
    assert torch.equal(ref.key_tiles(kc)[1, :, :, 6], k[1]) and torch.equal(ref.value_tiles(vc)[0, :, 3], v[2])


def test_paired_cache_needs_even_head_dim():
    k_shape, v_shape = ops.cache_shapes(2, 1, 16, 7)
    kc, vc = torch.zeros(k_shape, dtype=torch.bfloat16), torch.zeros(v_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be even"):
        ops.reshape_and_cache(torch.randn(1, 7), torch.randn(1, 7), kc, vc, torch.tensor([0]))


FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 3.0)])
def test_float8_cache_bytes_equal_torch_casts(kern, dtype, scales):
    """x / scale rounded to nearest even exactly as torch casts (e4m3 saturating at 448), the
    scales small enough to push values out of range and into subnormals."""
    torch.manual_seed(3)
    t, hk, d, bs = 11, 2, 48, 16
    key, value = torch.randn(t, hk * d) * 4, torch.randn(t, hk * d) / 50
    key[0, :4] = torch.tensor([float("nan"), 1e9, -1e9, 0.0])
    slots = torch.randperm(4 * bs)[:t]
    k_shape, v_shape = ops.cache_shapes(4, hk, bs, d)
    kc, vc = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    ops.reshape_and_cache(key, value, kc, vc, slots, *scales, k=kern)
    ref.reshape_and_cache(key, value, kr, vr, slots, *scales)
    kb, kbr = kc.view(torch.uint8), kr.view(torch.uint8)
    nan = kr.float().isnan()
    assert torch.equal(kb[~nan], kbr[~nan]) and kc.float()[nan].isnan().all()
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_attention_float8_cache_with_scales(kern, dtype, block_size):
    q_lens, ctx_lens = [1, 37, 20, 1], [70, 37, 150, 259]
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, block_size, 4, 64, q_lens, ctx_lens, 5)
    scale, ks, vs = 64 ** -0.5, 0.5, 2.0
    got = ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, scale, k_scale=ks, v_scale=vs, k=kern)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, scale, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def _attention_case(dtype, block_size, group, head_dim, q_lens, ctx_lens, seed):
    torch.manual_seed(seed)
    hk = 2
    hq = hk * group
    nseq = len(q_lens)
    max_blocks = max(math.ceil(c / block_size) for c in ctx_lens)
    nblocks = nseq * max_blocks + 3
    k_shape, v_shape = ops.cache_shapes(nblocks, hk, block_size, head_dim)
    kc, vc = torch.randn(k_shape).to(dtype), torch.randn(v_shape).to(dtype)
    tables = torch.randperm(nblocks)[: nseq * max_blocks].view(nseq, max_blocks).int()
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq * head_dim)
    return q, kc, vc, tables, torch.tensor(ctx_lens, dtype=torch.int32), qsl, hq


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_attention_mixed_batch(kern, dtype, block_size, group):
    # a decode, a whole prefill, a prefill chunk on top of cached context, an odd long context
    q_lens, ctx_lens = [1, 37, 20, 1], [70, 37, 150, 259]
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, block_size, group, 64, q_lens, ctx_lens, group)
    scale = 64 ** -0.5
    pairs = kern.bf16_dot and dtype == torch.bfloat16  # bfloat16 pair dot products
    got = ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, scale, k=kern)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, scale, bf16_inputs=pairs)
    prob = ref.BF16_PROBABILITY_ERROR * float(vc.float().abs().max()) if pairs else 0.0
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 + prob)
    if pairs:  # the bound is not loose enough to hide a wrong pairing: most of it goes unused
        assert float((got - want).abs().max()) < prob / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(16, 0.0), (50, 0.0), (0, 30.0)])
def test_paged_attention_window_softcap(kern, dtype, window, softcap):
    """Windows start rows at odd keys (the pair path pads them with a zero probability; AMX's steps of
    32 keys read zeros for the keys outside the block's window)."""
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, 16, 4, 80, [1, 33, 9], [90, 33, 100], 7)
    pairs = kern.bf16_dot and dtype == torch.bfloat16
    got = ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.1, window, softcap, k=kern)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.1, window, softcap, bf16_inputs=pairs)
    prob = ref.BF16_PROBABILITY_ERROR * float(vc.float().abs().max()) if pairs else 0.0
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 + prob)


@pytest.mark.parametrize("hq,hk,group,offset", [(5, 2, 3, 0), (4, 2, 3, 2), (1, 1, 3, 1), (7, 3, 4, 3)])
def test_paged_attention_partial_groups(kern, hq, hk, group, offset):
    """A tensor-parallel rank's slice of GQA: its query heads start inside a kv
    head's group (SmolLM2's 9 q / 3 kv heads on two ranks: 5 + 4 query heads)."""
    q_lens, ctx_lens = [1, 21, 1], [40, 21, 130]
    q, kc, vc, tables, seq_lens, qsl, _ = _attention_case(torch.float32, 16, 1, 64, q_lens, ctx_lens, 5)
    kc, vc = kc[:, :1].repeat(1, hk, 1, 1).contiguous(), vc[:, :1].repeat(1, hk, 1, 1).contiguous()
    kc += torch.arange(hk).view(1, hk, 1, 1)  # kv heads distinguishable
    q = torch.randn(q.shape[0], hq * 64)
    got = ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, group=group, q_head_offset=offset, k=kern)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, group=group, q_head_offset=offset)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_paged_attention_rejects_inconsistent_groups():
    q, kc, vc, tables, seq_lens, qsl, _ = _attention_case(torch.float32, 16, 1, 64, [1], [10], 2)
    with pytest.raises(ValueError, match="do not cover exactly"):
        ops.paged_attention(torch.randn(1, 5 * 64), kc, vc, tables, seq_lens, qsl, 5, 0.1, group=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,cuts", [(16, [0, 7, 24, 39, 40]), (128, [0, 7, 24, 39, 40]),
                                             (32, [0, 100, 517, 530, 1100, 1101])])
def test_paged_attention_row_independent_of_chunking(kern, dtype, block_size, cuts):
    """A query row gives bit-identical output whether its prompt is processed whole,
    in chunks, or alone: the property batch invariance rests on (bfloat16: the pair path's
    pairs and padding depend on the row's position only; on AMX tiles, a step takes up to 16
    blocks of 32 keys, and chunks here start and end inside steps)."""
    n = cuts[-1]
    q, kc, vc, tables, _, _, hq = _attention_case(dtype, block_size, 4, 64, [n], [n], 3)
    whole = ops.paged_attention(q, kc, vc, tables, torch.tensor([n], dtype=torch.int32),
                                torch.tensor([0, n], dtype=torch.int32), hq, 0.125, k=kern)
    parts = [ops.paged_attention(q[a:b], kc, vc, tables, torch.tensor([b], dtype=torch.int32),
                                 torch.tensor([0, b - a], dtype=torch.int32), hq, 0.125, k=kern)
             for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_decode_heads_split_or_whole(kern, dtype):
    """A decode's items take a kv head's whole group of query heads, or one query head each where
    whole groups would leave most threads idle (attention.hpp split_decode_heads: one thread keeps
    them whole, sixteen split them): the same bits either way, and the reference's values."""
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, 16, 4, 64, [1, 1], [150, 37], 2)
    outs = _on_threads((1, 16), lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, k=kern))
    assert torch.equal(outs[0], outs[1])
    _assert_reference_decode(kern, dtype, outs[0], q, kc, vc, tables, seq_lens, qsl, hq)


def _on_threads(counts, fn) -> list:
    """fn() run with each OpenMP thread count in turn, the count restored after."""
    threads = _C.omp_max_threads()
    try:
        outs = []
        for n in counts:
            _C.omp_set_num_threads(n)
            outs.append(fn())
        return outs
    finally:
        _C.omp_set_num_threads(threads)


def _assert_reference_decode(kern, dtype, got, q, kc, vc, tables, seq_lens, qsl, hq):
    """got: the reference's values at scale 0.125 (on the pair path, within its bfloat16 probabilities' error)."""
    pairs = kern.bf16_dot and dtype == torch.bfloat16
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, bf16_inputs=pairs)
    prob = ref.BF16_PROBABILITY_ERROR * float(vc.float().abs().max()) if pairs else 0.0
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 + prob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_attention_decode_whole_sequences_or_kv_heads(kern, dtype, block_size):
    """Eight decode rows take one item a sequence, its kv heads block by block, on one thread, and an
    item a kv head on sixteen (attention.hpp whole_sequences): the same bits either way, each row's
    bits those of the row decoded alone, and the reference's values. Contexts end inside blocks, on
    their ends and one past them."""
    ctx = [150, 37, 16, 129, 1, 300, 64, 200]
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, block_size, 3, 64, [1] * len(ctx), ctx, 4)
    outs = _on_threads((1, 16), lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, k=kern))
    alone = _on_threads((16,), lambda: torch.cat([
        ops.paged_attention(q[i:i + 1], kc, vc, tables[i:i + 1], seq_lens[i:i + 1], qsl[:2], hq, 0.125, k=kern)
        for i in range(len(ctx))]))[0]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], alone)
    _assert_reference_decode(kern, dtype, outs[0], q, kc, vc, tables, seq_lens, qsl, hq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("window", [0, 3000])
def test_paged_attention_rows_of_several_partitions(kern, dtype, block_size, window):
    """Rows whose keys span several partitions (attention.hpp kPartitionKeys: 2,048 keys, each run
    through its own online softmax and merged in order): three decode rows split into an item a
    partition on sixteen threads, walked whole on one, give the same bits, and so does each
    position as the last row of a prefill chunk; the reference's values. Windows start inside a
    partition; 2,049 keys leave one in the last."""
    ctx = [4500, 2200, 2049]
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, block_size, 3, 64, [1] * 3, ctx, 11)
    run = lambda q, seq_lens, qsl: ops.paged_attention(q, kc, vc, tables[:len(seq_lens)], seq_lens, qsl, hq, 0.125,
                                                       window, k=kern)
    outs = _on_threads((1, 16), lambda: run(q, seq_lens, qsl))
    assert torch.equal(outs[0], outs[1])
    for i, n in enumerate(ctx):  # position n - 1 as the last of 40 prompt rows
        chunk = torch.randn(40, q.shape[1])
        chunk[-1] = q[i]
        one = tables[i:i + 1]
        got = ops.paged_attention(chunk, kc, vc, one, torch.tensor([n], dtype=torch.int32),
                                  torch.tensor([0, 40], dtype=torch.int32), hq, 0.125, window, k=kern)
        assert torch.equal(got[-1], outs[0][i]), f"row {i}"
    pairs = kern.bf16_dot and dtype == torch.bfloat16
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, window, bf16_inputs=pairs)
    prob = ref.BF16_PROBABILITY_ERROR * float(vc.float().abs().max()) if pairs else 0.0
    torch.testing.assert_close(outs[0], want, rtol=2e-5, atol=2e-5 + prob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["long first", "long last"])
def test_paged_attention_long_decode_beside_short_rows(kern, dtype, order):
    """A decode past one partition beside short decodes and a prompt chunk: cut into an item a
    partition where the threads would finish sooner that way (attention.hpp attention_items: on 2
    and 3 threads here), walked whole on one, the same bits, and each sequence's rows alone too;
    the reference's values."""
    q_lens, ctx = [1, 1, 40, 1], [4500, 200, 300, 120]
    if order == "long last":
        q_lens, ctx = q_lens[::-1], ctx[::-1]
    q, kc, vc, tables, seq_lens, qsl, hq = _attention_case(dtype, 128, 3, 64, q_lens, ctx, 12)
    outs = _on_threads((1, 2, 3), lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, hq, 0.125, k=kern))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for i in range(len(ctx)):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        one = torch.tensor([0, q_lens[i]], dtype=torch.int32)
        alone = _on_threads((2,), lambda: ops.paged_attention(q[rows], kc, vc, tables[i:i + 1], seq_lens[i:i + 1], one,
                                                              hq, 0.125, k=kern))[0]
        assert torch.equal(alone, outs[0][rows]), f"sequence {i}"
    _assert_reference_decode(kern, dtype, outs[0], q, kc, vc, tables, seq_lens, qsl, hq)


@pytest.mark.parametrize("dtype", STORAGE)
# 1-8 rows run in one pass over the weights (gemm.hpp kPassRows); K = 4,200: K blocks (gemm.hpp
# k_block) where the L2 is at most 2 MiB (float32), 1 MiB (bfloat16); bfloat16 pairs on vdpbf16ps take
# row tiles of up to 12 as even as they go (gemm.hpp kTileRows: 25 rows as 9 + 8 + 8, 64 as 11 x 5 + 9)
@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (7, 100, 33), (8, 200, 576), (64, 192, 576), (50, 49, 1536), (3, 1, 5),
                                   (300, 70, 40), (9, 40, 4200), (8, 40, 4200), (16, 100, 576), (13, 64, 96),
                                   (25, 96, 130), (24, 33, 576)])
def test_gemm(kern, dtype, m, n, k):
    torch.manual_seed(m + n + k)
    x, w, b = torch.randn(m, k), torch.randn(n, k).to(dtype), torch.randn(n)
    got = ops.linear(x, ops.PackedWeight(w, k=kern), b, k=kern)
    want = ref.linear(x, w.float(), b, bf16_inputs=kern.bf16_dot and dtype == torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * math.sqrt(k))


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (7, 100, 576), (50, 192, 576), (300, 70, 40)])
def test_gemm_without_bias(kern, dtype, m, n, k):
    """Without a bias the AMX table stores whole panels' tiles straight into C (amx.hpp amx_gemm),
    rows of 1-16 and 17-32 (one or two row tiles) and a last narrow panel through its buffer."""
    torch.manual_seed(m + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k).to(dtype)
    got = ops.linear(x, ops.PackedWeight(w, k=kern), k=kern)
    want = ref.linear(x, w.float(), None, bf16_inputs=kern.bf16_dot and dtype == torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * math.sqrt(k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_independent_of_batch(kern, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(300, 700), ops.PackedWeight(torch.randn(300, 700).to(dtype), k=kern)
    full = ops.linear(x, w, k=kern)  # 300 rows: more than one row tile on any L2 (gemm.hpp row_tiles)
    for i in (0, 5, 66, 299):
        assert torch.equal(ops.linear(x[i:i + 1], w, k=kern), full[i:i + 1])
    # 7 and 8 rows: one pass (gemm.hpp kPassRows); 13 and 16: two row tiles of up to 8 (tile_rows);
    # 13-, 23-, 25- and 37-row slices as the bfloat16 pairs' even tiles of up to 12 cut them (kTileRows)
    for lo, hi in ((10, 23), (3, 10), (40, 48), (0, 67), (20, 290), (100, 116), (1, 24), (50, 75), (7, 44)):
        assert torch.equal(ops.linear(x[lo:hi], w, k=kern), full[lo:hi])


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("m,k", [(1, 576), (16, 96), (64, 34), (5, 33)])
def test_gemm_strided_input(kern, dtype, m, k):
    """An input whose rows are an odd number of floats apart (a column slice) gives the bits of
    the same rows contiguous: AVX2's bfloat16 pair path reads rows as float pairs, and copies
    such rows to an even stride first (gemm.hpp float_pairs_of)."""
    torch.manual_seed(m + k)
    wide, w = torch.randn(m, k + 3 - k % 2), torch.randn(64, k).to(dtype)
    pw = ops.PackedWeight(w, k=kern)
    x = wide[:, 1:k + 1]
    assert x.stride(0) % 2 == 1
    assert torch.equal(ops.linear(x, pw, k=kern), ops.linear(x.contiguous(), pw, k=kern))
    assert torch.equal(ops.linear_silu(x, pw, k=kern), ops.linear_silu(x.contiguous(), pw, k=kern))


@pytest.mark.parametrize("dtype", STORAGE)
# F: multiples of every ISA's panel width (fused, gated_gemm.hpp) and not (projection, then
# silu_and_mul); rows as in test_gemm: one pass (<= 8), row tiles, K blocks (k = 4,200)
@pytest.mark.parametrize("m,f,k", [(1, 1536, 576), (2, 96, 64), (5, 192, 33), (8, 160, 576), (9, 64, 4200),
                                   (64, 1536, 576), (300, 96, 70), (3, 40, 17), (70, 17, 96), (16, 192, 576)])
def test_linear_silu(kern, dtype, m, f, k):
    """The gate/up projection fused with SiLU-and-mul: torch's reference within the GEMM's
    tolerance, and bit for bit the two kernels apart (which the engine ran before)."""
    torch.manual_seed(m + f + k)
    x, w = torch.randn(m, k), (torch.randn(2 * f, k) / math.sqrt(k)).to(dtype)
    pw = ops.PackedWeight(w, k=kern)
    got = ops.linear_silu(x, pw, k=kern)
    assert torch.equal(got, ops.silu_and_mul(ops.linear(x, pw, k=kern), k=kern))
    want = ref.silu_and_mul(ref.linear(x, w.float(), None, bf16_inputs=kern.bf16_dot and dtype == torch.bfloat16))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * math.sqrt(k))
    whole = torch.full((m, f + 3), float("nan"))
    out = whole[:, :f]  # a strided output keeps its other columns
    assert ops.linear_silu(x, pw, out=out, k=kern) is out and torch.equal(out, got)
    assert whole[:, f:].isnan().all()


def test_linear_silu_unfused_weights(kern):
    """A bias, or a weight in parts of different storage: the projection, then SiLU-and-mul."""
    torch.manual_seed(1)
    x, w, b = torch.randn(5, 40), torch.randn(96, 40) * 0.2, torch.randn(96)
    parts = ops.StackedWeight([ops.PackedWeight(w[:32], k=kern), ops.PackedWeight(w[32:].bfloat16(), k=kern)])
    for weight, bias in ((ops.PackedWeight(w, k=kern), b), (parts, None)):
        want = ops.silu_and_mul(ops.linear(x, weight, bias, k=kern), k=kern)
        out = torch.empty(5, 48)
        assert torch.equal(ops.linear_silu(x, weight, bias, k=kern), want)
        assert ops.linear_silu(x, weight, bias, out=out, k=kern) is out and torch.equal(out, want)


def test_linear_silu_rejects_bad_input():
    pw = ops.PackedWeight(torch.randn(6, 8))
    with pytest.raises(ValueError, match="features"):
        ops.linear_silu(torch.randn(2, 9), pw)
    with pytest.raises(ValueError, match="even number of rows"):
        ops.linear_silu(torch.randn(2, 8), ops.PackedWeight(torch.randn(5, 8)))
    with pytest.raises(ValueError, match="out must be"):
        ops.linear_silu(torch.randn(2, 8), pw, out=torch.empty(2, 4))


@pytest.mark.parametrize("n", [0, 1, 63, 64 * 5 + 17, 1 << 20])
def test_read_sum(kern, n):
    """The bandwidth probe's streaming sum: torch's sum, up to float32 rounding of n terms."""
    x = torch.rand(n) - 0.25
    want = float(x.double().sum())
    assert abs(ops.read_sum(x, k=kern) - want) <= 1e-6 * n + 1e-6
    with pytest.raises(ValueError, match="contiguous"):
        ops.read_sum(torch.rand(8, 16)[:, :8], k=kern)


def test_peak_flops_counts_every_threads_chains(kern):
    """The arithmetic peak probe's FLOPs: linear in its steps, a pair dot product counted as two
    multiply-adds, pairs only on the tables whose bfloat16 GEMMs multiply pairs; on the amx table,
    whose bfloat16 GEMMs run on tiles, a step is four tile dot products of 16 x 16 x 32."""
    one, two = kern.peak_flops(False, 1000), kern.peak_flops(False, 2000)
    assert one > 0 and two == 2 * one
    pairs = kern.isa in ("avx512_bf16", "amx")
    want = 1000 * 4 * 16 * 16 * 32 * 2 * _C.omp_max_threads() if kern.isa == "amx" else 2 * one
    assert kern.peak_flops(True, 1000) == (want if pairs else -1)
    assert ops.peak_gflops(False, seconds=0.005, repeats=1, k=kern) > 0
    assert (ops.peak_gflops(True, seconds=0.005, repeats=1, k=kern) is None) == (not pairs)


def test_wrappers_reject_bad_input():
    with pytest.raises(TypeError, match="float32"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="features"):
        ops.linear(torch.randn(2, 8), ops.PackedWeight(torch.randn(4, 9)))
    with pytest.raises(TypeError, match="storage dtype"):
        ops.PackedWeight(torch.randn(4, 9, dtype=torch.float64))
