"""`cpuserve quantize`: AWQ- and GPTQ-layout 4-bit checkpoints made from a model's weights
here (no model hub), so that those loaders and kernels run on real weights.

The weights are rounded to nearest (RTN), asymmetric, per group of input features: a float16
scale (max - min) / 15 and a zero point in 0..15 per group and output feature. AWQ's and
GPTQ's own algorithms choose better scales (activation-aware scaling, Hessian-guided error
compensation) from calibration data; the layouts, which are what the engine reads, are
theirs: AWQ "gemm" (qweight [K, N/8] in AWQ's nibble order), GPTQ v1 (qweight [K/8, N],
zero points stored minus one, so kept in 1..15, g_idx, and with --act-order input features
grouped by decreasing weight-column norm, a stand-in for GPTQ's Hessian order, shared by the
projections that read the same input).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from cpuserve.loading.hf_quant import AWQ_ORDER

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))


def rtn(w: torch.Tensor, groups: torch.Tensor, zero_min: int = 0) -> tuple:
    """w [N, K] float32, groups [K] group of each input feature -> (codes [N, K], zeros [G, N],
    scales [G, N] float16, the dequantized weight [N, K] float32: scale * (code - zero))."""
    n_groups = int(groups.max()) + 1
    scales = torch.empty(n_groups, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(n_groups, w.shape[0], dtype=torch.int32)
    codes = torch.empty(w.shape, dtype=torch.int32)
    for g in range(n_groups):
        cols = (groups == g).nonzero().squeeze(1)
        x = w[:, cols]
        lo, hi = x.min(1).values.clamp(max=0), x.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
        z = torch.round(-lo / s.float()).clamp(zero_min, 15).to(torch.int32)
        codes[:, cols] = (torch.round(x / s.float().unsqueeze(1)) + z.unsqueeze(1)).clamp(0, 15).to(torch.int32)
        scales[g], zeros[g] = s, z
    deq = (codes - zeros[groups].t()).float() * scales[groups].t().float()
    return codes, zeros, scales, deq


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes -> int32 words, nibble i at bits 4i (two's complement)."""
    w = (nibbles.long() << (4 * torch.arange(8))).sum(-1)
    return (w - (w >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def pack_awq(codes, zeros, scales) -> dict:
    k = codes.shape[1]
    q_kn = codes.t().contiguous()
    return {"qweight": _words(q_kn.view(k, -1, 8)[..., AWQ_ORDER]),
            "qzeros": _words(zeros.view(zeros.shape[0], -1, 8)[..., AWQ_ORDER]), "scales": scales}


def pack_gptq(codes, zeros, scales, groups) -> dict:
    k = codes.shape[1]
    q_kn = codes.t().contiguous()
    return {"qweight": _words(q_kn.view(k // 8, 8, -1).transpose(1, 2)), "qzeros": _words((zeros - 1).view(
        zeros.shape[0], -1, 8)), "scales": scales, "g_idx": groups.to(torch.int32)}


def groups_for(k: int, group: int, order: torch.Tensor | None) -> torch.Tensor:
    """Group of each input feature: consecutive, or by rank in `order` (act-order)."""
    if order is None:
        return torch.arange(k) // group
    groups = torch.empty(k, dtype=torch.long)
    groups[order] = torch.arange(k) // group
    return groups


def quantize(model_dir: Path, out: Path, method: str, group: int, act_order: bool = False) -> dict:
    """Writes `out` (config with quantization_config, the tokenizer, model.safetensors) from the
    float weights of `model_dir` (a Hugging Face directory, or a converted GGUF one). Returns the
    dequantized weights by name, the reference the tests hold the engine to."""
    from safetensors.torch import save_file

    from cpuserve.loading.model_loader import load_state_dict

    if method not in ("awq", "gptq") or group not in (32, 64, 128) or (act_order and method != "gptq"):
        raise ValueError("method awq or gptq, group size 32, 64 or 128, act-order for gptq only")
    src = load_state_dict(Path(model_dir), "none")
    tensors = {n: src.pop(n).float().contiguous() for n in list(src)}
    out.mkdir(parents=True, exist_ok=True)
    reference = {}
    layers = sorted({n.split(".")[2] for n in tensors if n.startswith("model.layers.")}, key=int)
    for i in layers:
        for names in SHARED_INPUT:
            full = [next(f"model.layers.{i}.{m}.{p}.weight" for m in ("self_attn", "mlp")
                         if f"model.layers.{i}.{m}.{p}.weight" in tensors) for p in names]
            k = tensors[full[0]].shape[1]
            order = None
            if act_order:
                norms = torch.cat([tensors[f] for f in full]).norm(dim=0)
                order = torch.sort(norms, descending=True, stable=True).indices
            groups = groups_for(k, group, order)
            for f in full:
                codes, zeros, scales, deq = rtn(tensors.pop(f), groups, zero_min=1 if method == "gptq" else 0)
                packed = pack_awq(codes, zeros, scales) if method == "awq" else pack_gptq(codes, zeros, scales, groups)
                base = f[: -len(".weight")]
                tensors.update({f"{base}.{key}": v.contiguous() for key, v in packed.items()})
                reference[f] = deq
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group, "zero_point": True}
    cfg["quantization_config"].update({"version": "gemm"} if method == "awq" else
                                      {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return reference
