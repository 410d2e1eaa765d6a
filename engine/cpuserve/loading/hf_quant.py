"""Quantized Hugging Face checkpoints, handed to the model without widening:

AWQ and GPTQ 4-bit checkpoints in their usual layouts, as Q4_ZP blocks
(loading/quant_tensor.py): w = scale * (q - zero) per group of 32, 64 or 128 input features.

- AWQ (AutoAWQ "gemm"): qweight int32 [K, N/8] and qzeros int32 [K/g, N/8] packed along the
  output features in AWQ's nibble order, scales float16 [K/g, N].
- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K/8, N] packed along the input features, qzeros
  int32 [G, N/8] ("gptq" v1 stores zero - 1, "gptq_v2" the zero), scales float16 [G, N], g_idx
  int32 [K]. With act-order (desc_act) g_idx is not monotonic: the input features are sorted
  by group at load and the layer gathers its input in that order (QuantTensor.input_perm).

INT8 W8A8 from compressed-tensors ("int-quantized", as llm-compressor writes it), as
Int8Tensor: `weight` int8 [N, K] with `weight_scale` per output channel (or one per tensor),
symmetric; activations quantized per token at run time ("dynamic", "token"), symmetric or,
when the scheme says `symmetric: false`, with a zero point per token.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from cpuserve.loading.quant_tensor import Q4_ZP, Int8Tensor, QuantTensor

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
    if method == "compressed-tensors":
        w8a8_scheme(qc, model_dir)
        return qc
    if method not in ("awq", "gptq"):
        raise ValueError(f"{model_dir}: quantization method {method!r} is not supported "
                         "(awq, gptq, compressed-tensors W8A8 and GGUF files are)")
    if int(qc.get("bits", qc.get("w_bit", 4))) != 4:
        raise ValueError(f"{model_dir}: {method} with {qc.get('bits')} bits; only 4-bit weights are supported")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{model_dir}: AWQ version {qc.get('version')!r}; only the 'gemm' layout is supported")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"{model_dir}: GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not supported")
    return qc


def w8a8_scheme(qc: dict, where="checkpoint") -> bool:
    """Checks a compressed-tensors quantization_config is the INT8 W8A8 scheme the int8 GEMM
    runs; returns whether activations are asymmetric. Refuses anything else, saying what."""
    fmt = qc.get("format")
    if fmt != "int-quantized":
        raise ValueError(f"{where}: compressed-tensors format {fmt!r} is not supported (int-quantized W8A8 is)")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError(f"{where}: compressed-tensors config without config_groups")
    asym = set()
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations")
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) not in ((8, "int", "channel"), (8, "int", "tensor")):
            raise ValueError(f"{where}: weights {w.get('num_bits')}-bit {w.get('type')} per {w.get('strategy')}; "
                             "only 8-bit int weights per channel or per tensor are supported")
        if not w.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric int8 weights (weight_zero_point) are not supported")
        if not a:
            raise ValueError(f"{where}: int8 weights without input_activations (W8A16) are not supported")
        if (a.get("num_bits"), a.get("type")) != (8, "int") or not a.get("dynamic") or a.get("strategy") != "token":
            raise ValueError(f"{where}: activations {a.get('num_bits')}-bit {a.get('type')} "
                             f"{'dynamic' if a.get('dynamic') else 'static'} per {a.get('strategy')}; only dynamic "
                             "per-token int8 activations are supported")
        asym.add(not a.get("symmetric", True))
    if len(asym) > 1:
        raise ValueError(f"{where}: config groups that mix symmetric and asymmetric activations")
    return asym.pop()


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


def int8_weight(data: torch.Tensor, scale: torch.Tensor, act_asym: bool, name: str) -> Int8Tensor:
    """compressed-tensors' int8 weight and its scale: one per output channel ([N, 1]) or one
    for the tensor (the "tensor" strategy), kept as a scale per row."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(data.shape[0])
    if data.dtype != torch.int8 or scale.numel() != data.shape[0]:
        raise ValueError(f"{name}: {data.dtype} weight {tuple(data.shape)} with {scale.numel()} scales is not an "
                         "int8 W8A8 weight")
    return Int8Tensor(data, scale, act_asym)


class QuantizedCheckpoint:
    """A checkpoint's tensors where each quantized linear's parts (AWQ / GPTQ qweight, qzeros,
    scales, g_idx; compressed-tensors weight and weight_scale) come out as one `<name>.weight`:
    a QuantTensor or Int8Tensor, or float32 when `dequantize`."""

    def __init__(self, tensors, qc: dict, dequantize: bool = False):
        self.tensors, self.qc, self.dequantize = tensors, qc, dequantize
        self.w8a8 = qc["quant_method"] == "compressed-tensors"
        self.act_asym = w8a8_scheme(qc) if self.w8a8 else False
        self.parts = (".weight", ".weight_scale") if self.w8a8 else (".qweight", ".qzeros", ".scales", ".g_idx")
        marker = self.parts[1] if self.w8a8 else self.parts[0]
        self.bases = {n[: -len(marker)] for n in tensors if n.endswith(marker)}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or (name.endswith(".weight") and name[: -len(".weight")] in self.bases)

    def __iter__(self):
        plain = [n for n in self.tensors if not (n.endswith(self.parts) and n.rsplit(".", 1)[0] in self.bases)]
        return iter(plain + [b + ".weight" for b in self.bases])

    def pop(self, name: str, *default):
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base not in self.bases:
            return self.tensors.pop(name, *default)
        self.bases.remove(base)
        t = self.tensors
        if self.w8a8:
            w = int8_weight(t.pop(base + ".weight"), t.pop(base + ".weight_scale"), self.act_asym, name)
        elif self.qc["quant_method"] == "awq":
            w = awq_weight(t.pop(base + ".qweight"), t.pop(base + ".qzeros"), t.pop(base + ".scales"))
        else:
            w = gptq_weight(t.pop(base + ".qweight"), t.pop(base + ".qzeros"), t.pop(base + ".scales"),
                            t.pop(base + ".g_idx", None), self.qc.get("checkpoint_format", "gptq") == "gptq")
        return w.dequantize() if self.dequantize else w
