"""Rotary position embedding: the cos/sin table computed as transformers does
(same float32 operations, so identical values), applied by the native kernel."""
from __future__ import annotations

import math

import torch

from cpuserve.model_executor import ops


def inv_frequencies(rot_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq, attention_factor) for the rope_scaling types we support."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_l), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding:
    def __init__(self, head_dim: int, rot_dim: int, max_positions: int, base: float,
                 scaling: dict | None = None, neox: bool = True):
        inv, factor = inv_frequencies(rot_dim, base, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv[None, :]
        self.cos_sin = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1).contiguous()
        self.head_dim = head_dim
        self.neox = neox

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        ops.rotary(q, k, positions, self.cos_sin, self.head_dim, self.neox)
