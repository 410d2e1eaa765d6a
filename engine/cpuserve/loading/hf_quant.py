"""AWQ and GPTQ 4-bit checkpoints in their usual Hugging Face layouts, handed to the model as
Q4_ZP blocks (loading/quant_tensor.py): w = scale * (q - zero) per group of 32, 64 or 128
input features, the codes never widened.

- AWQ (AutoAWQ "gemm"): qweight int32 [K, N/8] and qzeros int32 [K/g, N/8] packed along the
  output features in AWQ's nibble order, scales float16 [K/g, N].
- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K/8, N] packed along the input features, qzeros
  int32 [G, N/8] ("gptq" v1 stores zero - 1, "gptq_v2" the zero), scales float16 [G, N], g_idx
  int32 [K]. With act-order (desc_act) g_idx is not monotonic: the input features are sorted
  by group at load and the layer gathers its input in that order (QuantTensor.input_perm).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from cpuserve.loading.quant_tensor import Q4_ZP, QuantTensor

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds output feature 8j + AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def quant_config(model_dir: Path) -> dict | None:
    """The checkpoint's quantization_config when it is one this loader runs, else None;
    refuses the variants it does not run with the reason."""
    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.exists():
        return None
    qc = json.loads(cfg_file.read_text()).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in ("awq", "gptq"):
        raise ValueError(f"{model_dir}: quantization method {method!r} is not supported (awq, gptq and GGUF files are)")
    if int(qc.get("bits", qc.get("w_bit", 4))) != 4:
        raise ValueError(f"{model_dir}: {method} with {qc.get('bits')} bits; only 4-bit weights are supported")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{model_dir}: AWQ version {qc.get('version')!r}; only the 'gemm' layout is supported")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"{model_dir}: GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not supported")
    return qc


def _unpack_along_last(t: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> codes [R, C/8, 8] (nibble i at index i)."""
    return (t.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15


def _awq_cols(t: torch.Tensor) -> torch.Tensor:
    nib = _unpack_along_last(t)
    out = torch.empty_like(nib)
    out[..., AWQ_ORDER] = nib
    return out.reshape(t.shape[0], -1)


def to_blocks(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_of_row: torch.Tensor,
              input_perm: torch.Tensor | None = None) -> QuantTensor:
    """q [K, N] codes, zeros [G, N], scales [G, N] float16, group_of_row [K] (in q's row order)
    -> a [N, K] Q4_ZP QuantTensor."""
    k, n = q.shape
    if k % 32:
        raise ValueError(f"{k} input features: not a multiple of 32")
    gb = group_of_row.view(k // 32, 32)
    if not bool((gb == gb[:, :1]).all()):
        raise ValueError("a quantization group that does not fill whole blocks of 32 input features")
    g0 = gb[:, 0].long()
    d = scales.to(torch.float16)[g0].t().contiguous().view(torch.uint8).view(n, k // 32, 2)
    z = zeros[g0].t().to(torch.uint8).unsqueeze(-1)
    qt = q.t().to(torch.uint8).reshape(n, k // 32, 32)
    qs = qt[..., :16] | (qt[..., 16:] << 4)
    data = torch.cat([d, z, torch.zeros_like(z), qs], dim=-1).reshape(n, -1).contiguous()
    return QuantTensor(data, Q4_ZP, k, input_perm)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    k = qweight.shape[0]
    group = k // scales.shape[0]
    return to_blocks(_awq_cols(qweight), _awq_cols(qzeros), scales, torch.arange(k) // group)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                v1: bool) -> QuantTensor:
    k8, n = qweight.shape
    q = ((qweight.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 15).reshape(k8 * 8, n)
    zeros = _unpack_along_last(qzeros).reshape(qzeros.shape[0], -1) + (1 if v1 else 0)
    k = q.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // (k // scales.shape[0])
    perm = None
    if bool((groups[1:] < groups[:-1]).any()):  # act-order: sort the input features by group
        perm = torch.sort(groups, stable=True).indices
        q, groups = q[perm], groups[perm]
    return to_blocks(q, zeros, scales, groups, perm)


class QuantizedCheckpoint:
    """A checkpoint's tensors where each quantized linear's qweight / qzeros / scales (/ g_idx)
    come out as one `<name>.weight`: a QuantTensor, or float32 when `dequantize`."""

    def __init__(self, tensors, qc: dict, dequantize: bool = False):
        self.tensors, self.qc, self.dequantize = tensors, qc, dequantize
        self.bases = {n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or (name.endswith(".weight") and name[: -len(".weight")] in self.bases)

    def __iter__(self):
        parts = (".qweight", ".qzeros", ".scales", ".g_idx")
        plain = [n for n in self.tensors if not (n.endswith(parts) and n.rsplit(".", 1)[0] in self.bases)]
        return iter(plain + [b + ".weight" for b in self.bases])

    def pop(self, name: str, *default):
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base not in self.bases:
            return self.tensors.pop(name, *default)
        self.bases.remove(base)
        t = self.tensors
        if self.qc["quant_method"] == "awq":
            w = awq_weight(t.pop(base + ".qweight"), t.pop(base + ".qzeros"), t.pop(base + ".scales"))
        else:
            w = gptq_weight(t.pop(base + ".qweight"), t.pop(base + ".qzeros"), t.pop(base + ".scales"),
                            t.pop(base + ".g_idx", None), self.qc.get("checkpoint_format", "gptq") == "gptq")
        return w.dequantize() if self.dequantize else w
