"""Turning an encoder's (or decoder's) token states into one embedding per sequence,
as sentence-transformers and vLLM's pooling runner do: the model directory's
`modules.json` and `1_Pooling/config.json` say mean, CLS, max or last-token pooling
and whether to L2-normalize; decoder models default to last token, normalized."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Pooling:
    mode: str        # mean | cls | max | last
    normalize: bool
    max_len: int | None = None  # sentence-transformers' max_seq_length, when given

    @classmethod
    def from_dir(cls, model_dir: Path, decoder: bool) -> "Pooling":
        d = Path(model_dir)
        modules = _json(d / "modules.json") or []
        pool_dir = next((m.get("path") for m in modules if m.get("type", "").endswith(".Pooling")), None)
        cfg = _json(d / pool_dir / "config.json") if pool_dir else None
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        max_len = (_json(d / "sentence_bert_config.json") or {}).get("max_seq_length")
        if cfg is None:
            return cls("last" if decoder else "cls", True, max_len)
        for key, mode in (("pooling_mode_lasttoken", "last"), ("pooling_mode_cls_token", "cls"),
                          ("pooling_mode_max_tokens", "max"), ("pooling_mode_mean_tokens", "mean")):
            if cfg.get(key):
                return cls(mode, normalize, max_len)
        raise ValueError(f"{d / pool_dir}: no pooling mode this engine supports (mean, cls, max, last token)")

    def __call__(self, states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        out = []
        for s in torch.split(states, lengths):
            v = {"mean": lambda: s.mean(0), "cls": lambda: s[0], "max": lambda: s.max(0).values,
                 "last": lambda: s[-1]}[self.mode]()
            out.append(torch.nn.functional.normalize(v, dim=0) if self.normalize else v)
        return out


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
