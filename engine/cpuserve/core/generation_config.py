"""A model's default sampling parameters, as vLLM reads them (`--generation-config`,
`--override-generation-config`): the sampling fields of the model's Hugging Face
generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens, which caps every request's output), the overrides over them. A request's own
fields win over these; what neither gives is the OpenAI default (temperature 1, no cap). A
converted GGUF carries its `general.sampling.*` metadata (llama.cpp's defaults) in that file
(loading/gguf_loader.py).

    auto  the model directory's generation_config.json (none: the plain defaults)
    vllm  the plain defaults, whatever the model says
    DIR   DIR/generation_config.json, which must exist
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from cpuserve.core.sampling_params import SamplingParams

FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# transformers' GenerationConfig defaults: a file's value equal to one of them says nothing (vLLM
# reads the file through to_diff_dict, so a file's "top_k": 50 is transformers' default, not a choice)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # max_new_tokens: the most tokens any request may generate

    @classmethod
    def from_values(cls, values: Mapping, source: str) -> SamplingDefaults:
        """From generation-config names (max_new_tokens, top_k 0 for none); a ValueError naming
        `source` for a value SamplingParams would refuse."""
        picked = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
        for k, v in picked.items():
            integral = k in ("top_k", "max_new_tokens")
            if isinstance(v, bool) or not isinstance(v, int if integral else (int, float)):
                raise ValueError(f"{source}: {k} must be {'an integer' if integral else 'a number'}, got {v!r}")
        if "max_new_tokens" in picked:
            picked["max_tokens"] = picked.pop("max_new_tokens")
        if picked.get("top_k") == 0:
            picked["top_k"] = -1
        try:
            SamplingParams(**picked)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
        return cls(**picked)

    def changed(self) -> dict:
        """The fields that differ from the plain defaults (for the start-up log)."""
        plain = asdict(SamplingDefaults())
        return {k: v for k, v in asdict(self).items() if v != plain[k]}

    def as_sampling_params(self) -> SamplingParams:
        """The offline API's parameters where a call gives none (vLLM's
        LLM.get_default_sampling_params: max_tokens 16 where max_new_tokens says nothing)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty,
                              max_tokens=16 if self.max_tokens is None else self.max_tokens)

    def cap(self, requested: int | None) -> int | None:
        """A request's max_tokens under max_new_tokens (vLLM's get_max_tokens takes the least of
        the two and the context's room); None where neither says (the context's room)."""
        if requested is None or self.max_tokens is None:
            return self.max_tokens if requested is None else requested
        return min(requested, self.max_tokens)


def file_values(path: Path) -> dict:
    """A generation_config.json's sampling fields that say something (HF_DEFAULTS dropped)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable generation config ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a generation config is a JSON object")
    return {k: data[k] for k in SAMPLING_KEYS if k in data and data[k] != HF_DEFAULTS.get(k, object())}


def sampling_defaults(model_dir: Path | None, generation_config: str = "auto",
                      overrides: Mapping | None = None) -> SamplingDefaults:
    """The defaults for a model (module docstring); overrides (generation-config names) win. A
    ValueError for an option or a file that cannot be used. model_dir None: the options alone
    (checked before the model is there)."""
    if generation_config == "vllm" or (generation_config == "auto" and model_dir is None):
        values, source = {}, f"--generation-config {generation_config}"
    elif generation_config == "auto":
        path = Path(model_dir) / FILE
        values, source = (file_values(path) if path.is_file() else {}), str(path)
    else:
        path = Path(generation_config) / FILE
        if not path.is_file():
            raise ValueError(f"--generation-config {generation_config}: no {FILE} there "
                             "(auto: the model's own; vllm: none)")
        values, source = file_values(path), str(path)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError("--override-generation-config is a JSON object, e.g. '{\"temperature\": 0.5}'")
    unknown = sorted(set(overrides or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} not among {', '.join(SAMPLING_KEYS)}")
    if overrides:
        SamplingDefaults.from_values(overrides, "--override-generation-config")  # its own mistakes, named
        source += " with --override-generation-config"
    return SamplingDefaults.from_values({**values, **(overrides or {})}, source)
