"""Token embedding and the LM head (which may share its table)."""
from __future__ import annotations

import os

import torch

from cpuserve.loading.quant_tensor import QuantTensor, quantize_q8_0
from cpuserve.model_executor import ops
from cpuserve.model_executor.parallel import TPGroup


class Embedding:
    """A lookup table, dense in the model dtype, or in its GGUF blocks (rows dequantized
    per lookup; the same packed blocks can serve a tied LM head, see `shared_head`)."""

    def __init__(self, weight, dtype: torch.dtype, scale: float | None = None):
        if isinstance(weight, torch.Tensor):
            self.weight = weight.to(dtype).contiguous()
        else:  # in its blocks, on the int8-dot GEMM's panels within ops.quantized_activations("int8")
            self.weight = ops.pack(weight, dtype)
        # Gemma multiplies by sqrt(hidden) in the model dtype; keep that rounding.
        self.scale = scale

    def shared_head(self, tp: TPGroup):
        """The packed table for a tied LM head when the head can use it as is (quantized,
        one rank), else None (the head packs its own)."""
        return self.weight if ops.is_quantized(self.weight) and tp.size == 1 else None

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if ops.is_quantized(self.weight):
            x = ops.dequantized_rows(self.weight, input_ids.reshape(-1)).reshape(*input_ids.shape, -1)
            return x * torch.tensor(self.scale, dtype=x.dtype) if self.scale is not None else x
        x = self.weight[input_ids]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x.float()


def greedy_head_enabled() -> bool:
    """CPUSERVE_GREEDY_HEAD=0 turns off greedy rows' bfloat16 and Q8_0 copies of a float32 LM head."""
    return os.environ.get("CPUSERVE_GREEDY_HEAD", "1") != "0"


def copy_errors_above(w: torch.Tensor, copy: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Per row t, a float32 no smaller than |w_t - copy_t| + g (|copy_t| + |w_t|), g = n u / (1 - n u)
    with n = 2K + 64 roundings of u = 2^-24: what a logit computed in float32 on the copy can be off
    from the float32 logit, per unit |x| (kernels/greedy_head.hpp, its error-norm bound)."""
    n = 2 * w.shape[1] + 64
    g = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    out = torch.empty(w.shape[0], dtype=torch.float32)
    for i in range(0, w.shape[0], chunk):
        a, b = w[i:i + chunk].double(), copy[i:i + chunk].double()
        e = (a - b).norm(dim=1) + g * (a.norm(dim=1) + b.norm(dim=1))
        out[i:i + chunk] = (e * (1 + 2.0 ** -20)).float()
    return out


def q8_0_copy(w: torch.Tensor, chunk: int = 4096) -> tuple[ops.QuantWeight, torch.Tensor] | None:
    """w's GGUF Q8_0 copy for the GEMM (float32 activations) and its copy_errors_above, a chunk of
    rows at a time (what loading adds at its peak: a chunk's float temporaries), or None where
    quantize_q8_0 cannot hold w."""
    blocks, errors = [], []
    for i in range(0, w.shape[0], chunk):
        q8 = quantize_q8_0(w[i:i + chunk])
        if q8 is None:
            return None
        blocks.append(q8[0].data)
        errors.append(copy_errors_above(w[i:i + chunk], q8[1]))
    return ops.QuantWeight(QuantTensor(torch.cat(blocks), 8, w.shape[1]), int8_dot=False), torch.cat(errors)


def row_norms_above(w: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """|w_t|_2 of each row as float32 no smaller than the real norm (in float64, a chunk of rows
    at a time, then nudged up past float32's rounding)."""
    out = torch.empty(w.shape[0], dtype=torch.float32)
    for i in range(0, w.shape[0], chunk):
        out[i:i + chunk] = (w[i:i + chunk].double().norm(dim=1) * (1 + 2.0 ** -20)).float()
    return out


class LMHead:
    """Column-parallel over the vocabulary; logits gathered across ranks. (The
    embedding itself is replicated: a lookup is cheap, and a vocab-parallel one
    would cost an all-reduce per step.)"""

    def __init__(self, weight, dtype: torch.dtype, tp: TPGroup, bias: torch.Tensor | None = None,
                 final_softcap: float | None = None, packed=None):
        self.sizes = tp.sizes(weight.shape[0], align=64) if tp.size > 1 else [weight.shape[0]]
        start, n = sum(self.sizes[:tp.rank]), self.sizes[tp.rank]
        self.vocab_size = weight.shape[0]
        self.weight = packed if packed is not None else ops.pack(weight[start:start + n], dtype)
        self.bias = bias[start:start + n].float().contiguous() if bias is not None else None
        self.tp = tp
        self.final_softcap = final_softcap
        self.greedy_copy = None  # greedy rows' bfloat16 copy of a float32 head (see `greedy`)
        self.greedy_q8 = None  # and a GGUF Q8_0 copy for a step of one row
        if dtype == torch.float32 and packed is None and isinstance(weight, torch.Tensor) and bias is None \
                and not final_softcap and tp.size == 1 and greedy_head_enabled():
            w = weight.to(torch.float32)
            self.greedy_copy = ops.pack(w, torch.bfloat16)
            self.greedy_norms = row_norms_above(w)
            self.greedy_norm_max = float(self.greedy_norms.max()) if w.shape[0] else 0.0
            q8 = q8_0_copy(w) if w.shape[1] % 32 == 0 and w.shape[0] else None
            if q8 is not None:
                self.greedy_q8, self.greedy_q8_errors = q8
                self.greedy_q8_error_max = float(self.greedy_q8_errors.max())

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row's logits (greedy sampling with nothing else asked of the
        logits), or None where this head has no bfloat16 copy (it is not float32, or its logits
        are capped, biased or split over ranks). The same tokens as argmax(self(x)), bit for bit,
        from the copy's approximate logits (half the bytes, and twice the multiply rate where the
        CPU has bfloat16 pair dot products) with a proven bound on their distance from the float32
        ones: the few logits the bound cannot rule out are computed in float32 the way the float32
        GEMM computes them (kernels/greedy_head.hpp), and a row it cannot decide (a non-finite
        value) gets its float32 logits. A step of one row, bound by the bytes it reads, takes the
        Q8_0 copy instead (a quarter of the float32 head's bytes, its float32 activations
        multiplied in float32, the bound from each column's exact error): on the Zen 4 VM its
        GEMV took 0.85 ms where the bfloat16 copy's took 1.62 (from 2 rows on, no faster)."""
        if self.greedy_copy is None:
            return None
        if x.shape[0] == 1 and self.greedy_q8 is not None:
            tokens, undecided = ops.greedy_head(ops.linear(x, self.greedy_q8), x, self.weight, self.greedy_q8_errors,
                                                self.greedy_q8_error_max, error_norms=True)
        else:
            tokens, undecided = ops.greedy_head(ops.linear(x, self.greedy_copy), x, self.weight, self.greedy_norms,
                                                self.greedy_norm_max)
        if undecided:
            rows = torch.nonzero(tokens < 0).flatten()
            tokens[rows] = ops.argmax(ops.linear(x[rows].contiguous(), self.weight))
        return tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(ops.linear(x, self.weight, self.bias), self.sizes)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
