"""GGUF block-quantized tensors as the loader hands them to the model: the
file's blocks, unwidened, with the slicing the layers need (row shards, block-
aligned column shards, row permutations, row concatenation). The model packs
them for the native quantized GEMM (model_executor.ops.QuantWeight)."""
from __future__ import annotations

import torch

# ggml type id -> (name, weights per block, bytes per block): the types the kernels run.
QTYPES = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    # not a ggml type: AWQ / GPTQ weights regrouped into blocks of 32 (loading/hf_quant.py):
    # f16 scale d, u8 zero point z, u8 0, 16 bytes of 4-bit codes as Q4_0's; w = d * (q - z)
    100: ("Q4_ZP", 32, 20),
}
Q4_ZP = 100


class QuantTensor:
    """A [rows, k] weight in GGUF blocks: `data` uint8 [rows, k / block * block_bytes],
    block fields in this machine's byte order. `input_perm` (GPTQ act-order): the weight's
    input features are stored in this order, so x[:, input_perm] is what multiplies it."""

    __slots__ = ("data", "qtype", "shape", "input_perm")

    def __init__(self, data: torch.Tensor, qtype: int, k: int, input_perm: torch.Tensor | None = None):
        name, block, nbytes = QTYPES[qtype]
        if data.dtype != torch.uint8 or data.dim() != 2 or k % block or data.shape[1] != k // block * nbytes:
            raise ValueError(f"{name} data of shape {tuple(data.shape)} does not hold rows of {k} weights")
        self.data, self.qtype, self.shape, self.input_perm = data, qtype, (data.shape[0], k), input_perm

    @property
    def type_name(self) -> str:
        return QTYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, dtype: torch.dtype) -> "QuantTensor":  # the blocks are kept whatever the model's dtype
        return self

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            return QuantTensor(self.data[index], self.qtype, self.shape[1], self.input_perm)
        rows, cols = index
        if rows != slice(None) or not isinstance(cols, slice) or cols.step not in (None, 1):
            raise IndexError("a quantized weight is sliced by rows, or by a range of columns")
        if self.input_perm is not None and cols.indices(self.shape[1])[:2] != (0, self.shape[1]):
            raise ValueError("GPTQ act-order weights (desc_act) cannot be split by input features "
                             "(tensor-parallel row shards); run them with tensor_parallel_size=1")
        start, stop, _ = cols.indices(self.shape[1])
        _, block, nbytes = QTYPES[self.qtype]
        if start % block or stop % block:  # a shard boundary inside a block: only the widened slice exists
            return self.dequantize()[:, start:stop]
        return QuantTensor(self.data[:, start // block * nbytes: stop // block * nbytes].contiguous(), self.qtype,
                           stop - start, self.input_perm)

    def permute_rows(self, index: torch.Tensor) -> "QuantTensor":
        return QuantTensor(self.data[index].contiguous(), self.qtype, self.shape[1], self.input_perm)

    def dequantize(self) -> torch.Tensor:
        """float32 values (gguf-py's reference dequantization; for Q4_ZP, d * (q - z)), in
        the original order of the input features."""
        import gguf
        import numpy as np

        if self.qtype == Q4_ZP:
            b = self.data.reshape(-1, 20)
            d = b[:, :2].contiguous().view(torch.float16).float()
            z = b[:, 2:3].float()
            q = torch.cat([b[:, 4:] & 15, b[:, 4:] >> 4], dim=1).float()
            w = ((q - z) * d).reshape(self.shape)
        else:
            out = gguf.quants.dequantize(np.ascontiguousarray(self.data.numpy()), gguf.GGMLQuantizationType(self.qtype))
            w = torch.from_numpy(np.array(out, dtype=np.float32)).reshape(self.shape)
        if self.input_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_perm, w)
        return w


def quantize_q8_0(w: torch.Tensor) -> tuple[QuantTensor, torch.Tensor] | None:
    """w [rows, k] (k a multiple of 32) in GGUF Q8_0 blocks, and the float32 values the kernels read
    from them: per 32 weights a float16 scale d = max|w| / 127 and codes round(w / d) (d as
    stored), clamped to [-127, 127]; llama.cpp's scheme, rounding against the stored scale. None
    where a scale is not a finite float16 (|w| beyond 127 x 65,504, or not finite)."""
    rows, k = w.shape
    b = w.float().reshape(rows, k // 32, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).half()
    if not torch.isfinite(d).all():
        return None
    df = d.float().clamp_min_(2.0 ** -24)  # (a block of zeros: codes 0 whatever its scale)
    q = torch.round(b / df).clamp_(-127, 127).to(torch.int8)
    data = torch.cat([d.view(torch.uint8).reshape(rows, k // 32, 2), q.view(torch.uint8)], dim=2)
    return QuantTensor(data.reshape(rows, -1).contiguous(), 8, k), (q.float() * df).reshape(rows, k)


def cat_rows(parts: list):
    """Row concatenation of weights (fused projections): a tensor when every part is dense,
    one QuantTensor or Int8Tensor when every part has the same storage, else a list of row
    blocks, each a run of consecutive parts of one storage joined (a Q4_K_M file's q, k and v
    as Q5_0, Q5_0 and Q8_0: two blocks, q and k in one GEMM), each packed on its own and
    filling its own columns of the output."""
    perms = [getattr(p, "input_perm", None) for p in parts]
    if any(q is not None for q in perms) and not all(q is not None and torch.equal(q, perms[0]) for q in perms):
        raise ValueError("fused projections whose GPTQ act-order permutations differ are not supported")
    runs: list[list] = []
    for p in parts:
        if runs and _storage_key(runs[-1][-1]) == _storage_key(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    blocks = [_join(run) for run in runs]
    return blocks[0] if len(blocks) == 1 else blocks


def _storage_key(p) -> tuple:
    """Parts with equal keys join into one block: dense tensors (torch.cat widens mixed dtypes,
    and packing gives every part the model's), W8A8 weights of one activation mode, GGUF blocks
    of one type and width."""
    if isinstance(p, torch.Tensor):
        return ("dense",)
    if isinstance(p, Int8Tensor):
        return ("int8", p.act_asym)
    return ("gguf", p.qtype, p.shape[1])


def _join(run: list):
    """One weight of the rows of `run`, parts whose _storage_key is the same."""
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], torch.Tensor):
        return torch.cat(run)
    if isinstance(run[0], Int8Tensor):
        return Int8Tensor(torch.cat([p.data for p in run]), torch.cat([p.scale for p in run]), run[0].act_asym)
    return QuantTensor(torch.cat([p.data for p in run]), run[0].qtype, run[0].shape[1],
                       getattr(run[0], "input_perm", None))


class Int8Tensor:
    """A [rows, k] W8A8 weight (compressed-tensors int8, "channel" strategy): `data` int8,
    `scale` float32 [rows], w = scale[row] * data; `act_asym`: the layer quantizes its input per
    token with a zero point (else symmetric). Rows carry their scales, so row shards, row
    permutations and fused projections keep every value; column shards keep every scale."""

    __slots__ = ("data", "scale", "act_asym", "shape")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, act_asym: bool = False):
        scale = scale.reshape(-1).float().contiguous()
        if data.dtype != torch.int8 or data.dim() != 2 or scale.numel() != data.shape[0]:
            raise ValueError(f"int8 weight of shape {tuple(data.shape)} {data.dtype} with {scale.numel()} channel "
                             "scales: expected int8 [rows, k] and one scale per row")
        self.data, self.scale, self.act_asym, self.shape = data, scale, bool(act_asym), tuple(data.shape)

    type_name = "int8"
    input_perm = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    def to(self, dtype: torch.dtype) -> "Int8Tensor":
        return self

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            return Int8Tensor(self.data[index].contiguous(), self.scale[index], self.act_asym)
        rows, cols = index
        if rows != slice(None):
            raise IndexError("an int8 weight is sliced by rows, or by columns")
        return Int8Tensor(self.data[:, cols].contiguous(), self.scale, self.act_asym)

    def permute_rows(self, index: torch.Tensor) -> "Int8Tensor":
        return Int8Tensor(self.data[index].contiguous(), self.scale[index], self.act_asym)

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.scale.unsqueeze(1)
