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
    # each adapter with its rows (int64) of the step, and whether those are all of the step's rows
    groups: list[tuple[LoRAAdapter, torch.Tensor, bool]]

    def apply(self, layer: int, part: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Adds each adapter's update of `part` of `layer` to `out` [rows, features], in place, for
        the adapter's rows of `x`: two small GEMMs over the part's packed factors (pack())."""
        for adapter, rows, whole in self.groups:
            factors = adapter.packed.get((layer, part))
            if factors is None:
                continue
            xr = x if whole else x.index_select(0, rows)
            delta = (xr.float() @ factors[0]) @ factors[1]
            if whole:
                out.add_(delta.to(out.dtype))
            else:
                out.index_add_(0, rows, delta.to(out.dtype))


def lora_batch(adapters: dict[str, LoRAAdapter], names: list[str | None], query_start: list[int]) -> LoRABatch | None:
    """The step's LoRABatch from each sequence's adapter name (None: the base model) and the
    sequences' first rows (query_start_loc, one more than the sequences); None where no row is adapted."""
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if name is not None:
            rows.setdefault(name, []).extend(range(query_start[i], query_start[i + 1]))
    if not rows:
        return None
    total = query_start[-1]
    return LoRABatch([(adapters[n], torch.tensor(r, dtype=torch.int64), len(r) == total) for n, r in rows.items()])


def pack(adapter: LoRAAdapter, cfg) -> None:
    """Each fused part's factors as one pair, so that a part costs two GEMMs whatever it adapts:
    A^T of the part's projections side by side [in, sum of ranks], and B^T block-diagonal
    [sum of ranks, the part's output features], zero where a projection is not adapted."""
    shapes = projection_shapes(cfg)
    adapter.packed = {}
    for layer, mods in adapter.layers.items():
        for part, names in FUSED.items():
            present = [n for n in names if n in mods]
            if not present:
                continue
            a_t = torch.cat([mods[n][0] for n in present]).T.contiguous()
            b_t = torch.zeros(a_t.shape[1], sum(shapes[n][0] for n in names))
            r = col = 0
            for n in names:
                if n in mods:
                    b = mods[n][1]
                    b_t[r:r + b.shape[1], col:col + b.shape[0]] = b.T
                    r += b.shape[1]
                col += shapes[n][0]
            adapter.packed[(layer, part)] = (a_t, b_t)


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection of a Llama-style layer."""
    h = cfg.hidden_size
    head = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
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

