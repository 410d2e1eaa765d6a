"""What the CPU can do, and the dtype decisions that follow from it."""
from __future__ import annotations

import platform

import torch

from cpuserve import _C

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


# KV cache only: OCP float8 (vLLM's names; "fp8" is e4m3, as in vLLM). torch < 2.1 has no float8.
FP8_KV = {name: getattr(torch, attr) for name, attr in (("fp8_e5m2", "float8_e5m2"), ("fp8_e4m3", "float8_e4m3fn"),
                                                          ("fp8", "float8_e4m3fn")) if hasattr(torch, attr)}


def resolve_kv_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: `auto` = the model's, a float dtype, or fp8_e5m2 / fp8_e4m3."""
    if requested == "auto":
        return model_dtype
    if requested in ("fp8_e5m2", "fp8_e4m3", "fp8"):
        if requested not in FP8_KV:
            raise ValueError(f"kv_cache_dtype {requested} needs torch >= 2.1 (float8 dtypes); this is {torch.__version__}")
        return FP8_KV[requested]
    return resolve_dtype(requested, None)


def supported_dtypes() -> list[torch.dtype]:
    """Storage dtypes the kernels run on this machine. float16 needs hardware
    conversions (x86 F16C, AArch64); s390x z14 has none."""
    out = [torch.float32, torch.bfloat16]
    if platform.machine() != "s390x":
        out.append(torch.float16)
    return out


def resolve_dtype(requested: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """`auto`: the checkpoint's 16-bit dtype as bfloat16 (our GEMMs widen bf16 in
    registers, so it halves memory traffic at no compute cost on any ISA), else
    float32 (float32 checkpoints and dequantized GGUF keep full precision)."""
    if requested == "auto":
        if checkpoint_dtype in (torch.bfloat16, torch.float16) and platform.machine() != "s390x":
            return torch.bfloat16
        return torch.float32
    dtype = _NAMES.get(requested)
    if dtype is None:
        raise ValueError(f"unknown dtype {requested!r}; use auto, float32, bfloat16 or float16")
    if dtype not in supported_dtypes():
        raise ValueError(f"dtype {requested} is not supported on this CPU ({platform.machine()}, kernels: "
                         f"{_C.available_isas()[0]}); use float32 or bfloat16")
    return dtype
