"""LoRA updates in a step: each adapter's rows of the batch get (x A^T) B^T added to the outputs
of the projections it adapts, beside the base GEMMs (which every row shares). A step with no
adapted row has no LoRABatch and runs as it would without LoRA (the native decoder included);
one with any runs the Python layers, which call `apply` after each projection."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cpuserve.loading.lora import LoRAAdapter, LoRAError

# the projections of each fused part of a layer, in the order of its output columns
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


@dataclass
class LoRABatch:
    groups: list[tuple[LoRAAdapter, torch.Tensor]]  # each adapter with its rows (int64) of the step

    def apply(self, layer: int, part: str, x: torch.Tensor, out: torch.Tensor, widths: tuple[int, ...]) -> None:
        """Adds each adapter's update of `part` (its projections' output columns `widths` wide,
        in FUSED's order) to `out` [rows, sum(widths)], in place, for the adapter's rows of `x`."""
        for adapter, rows in self.groups:
            mods = adapter.layers.get(layer)
            if not mods:
                continue
            xr = None
            col = 0
            for name, width in zip(FUSED[part], widths):
                ab = mods.get(name)
                if ab is not None:
                    xr = x.index_select(0, rows).float() if xr is None else xr
                    delta = (xr @ ab[0].T) @ ab[1].T
                    out[:, col:col + width].index_add_(0, rows, delta.to(out.dtype))
                col += width


def lora_batch(adapters: dict[str, LoRAAdapter], names: list[str | None], query_start: list[int]) -> LoRABatch | None:
    """The step's LoRABatch from each sequence's adapter name (None: the base model) and the
    sequences' first rows (query_start_loc, one more than the sequences); None where no row is adapted."""
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if name is not None:
            rows.setdefault(name, []).extend(range(query_start[i], query_start[i + 1]))
    if not rows:
        return None
    return LoRABatch([(adapters[n], torch.tensor(r, dtype=torch.int64)) for n, r in rows.items()])


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection of a Llama-style layer."""
    h = cfg.hidden_size
    head = cfg.get("head_dim") or h // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * head, cfg.num_key_value_heads * head, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter)}


def check_shapes(adapter: LoRAAdapter, cfg) -> None:
    """An adapter trained for another model's shapes is refused, naming the first mismatch."""
    want = projection_shapes(cfg)
    for layer, mods in adapter.layers.items():
        for name, (a, b) in mods.items():
            if (b.shape[0], a.shape[1]) != want[name]:
                raise LoRAError(f"{adapter.path}: layer {layer} {name} maps {a.shape[1]} to {b.shape[0]} features; "
                                f"this model's maps {want[name][1]} to {want[name][0]} (an adapter for another model?)")

