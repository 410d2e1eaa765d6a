"""`cpuserve quantize`: AWQ- and GPTQ-layout 4-bit checkpoints, and compressed-tensors INT8
W8A8 ones, made from a model's weights here (no model hub), so that those loaders and kernels
run on real weights.

W8A8: each linear's weight rounded to nearest per output channel, symmetric int8 in
[-127, 127] with the float32 scale max|w| / 127; activations are quantized per token by the
engine at run time (dynamic), symmetric, or with a zero point per token with --act-asym. The
layout and config are compressed-tensors' "int-quantized" (what llm-compressor writes);
llm-compressor's recipes usually add SmoothQuant, which this does not.

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


def w8a8_config(act_asym: bool) -> dict:
    """compressed-tensors' quantization_config for per-channel int8 weights and dynamic per-token
    int8 activations."""
    args = {"num_bits": 8, "type": "int", "group_size": None, "block_structure": None, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": {**args, "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {**args, "strategy": "token", "symmetric": not act_asym, "dynamic": True}}}}


def rtn_int8(w: torch.Tensor) -> tuple:
    """w [N, K] float32 -> (int8 codes, float32 scales [N, 1], the dequantized weight)."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale, q.float() * scale


def quantize(model_dir: Path, out: Path, method: str, group: int, act_order: bool = False,
             act_asym: bool = False) -> dict:
    """Writes `out` (config with quantization_config, the tokenizer, model.safetensors) from the
    float weights of `model_dir` (a Hugging Face directory, or a converted GGUF one). Returns the
    dequantized weights by name, the reference the tests hold the engine to."""
    from safetensors.torch import save_file

    from cpuserve.loading.model_loader import load_state_dict

    if method not in ("awq", "gptq", "w8a8") or (method != "w8a8" and group not in (32, 64, 128)) \
            or (act_order and method != "gptq") or (act_asym and method != "w8a8"):
        raise ValueError("method awq, gptq or w8a8; group size 32, 64 or 128 for awq and gptq; act-order for "
                         "gptq only; act-asym for w8a8 only")
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
            groups = groups_for(k, group, order) if method != "w8a8" else None
            for f in full:
                if method == "w8a8":
                    q, scale, reference[f] = rtn_int8(tensors.pop(f))
                    tensors.update({f: q, f"{f}_scale": scale})
                    continue
                codes, zeros, scales, deq = rtn(tensors.pop(f), groups, zero_min=1 if method == "gptq" else 0)
                packed = pack_awq(codes, zeros, scales) if method == "awq" else pack_gptq(codes, zeros, scales, groups)
                base = f[: -len(".weight")]
                tensors.update({f"{base}.{key}": v.contiguous() for key, v in packed.items()})
                reference[f] = deq
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if method == "w8a8":
        cfg["quantization_config"] = w8a8_config(act_asym)
    else:
        cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group, "zero_point": True}
        cfg["quantization_config"].update({"version": "gemm"} if method == "awq" else
                                          {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return reference


def default_w8a8(act_asym: bool = False) -> Path:
    """The default model's W8A8 checkpoint, made once into the cache (benchmarks' w8a8 rows)."""
    import os
    import tempfile

    from cpuserve.loading.gguf_loader import cache_root
    from cpuserve.loading.model_loader import resolve

    src = resolve(None)
    out = cache_root() / "quantized" / f"{src.name}-w8a8{'-asym' if act_asym else ''}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".w8a8-"))
        quantize(src, tmp, "w8a8", 0, act_asym=act_asym)
        try:
            os.replace(tmp, out)
        except OSError:  # made by another process meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return out

