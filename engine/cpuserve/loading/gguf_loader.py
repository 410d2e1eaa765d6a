"""GGUF files: their metadata converted once into a Hugging Face directory
(config.json, tokenizer files with the chat template, and a pointer back to the
file), cached by file identity; the weights are read from the GGUF itself at
every start (GGUFTensors): quantized tensors stay in their blocks (QuantTensor),
float ones become tensors, and with quantization "none" every tensor is widened.

Reading undoes what llama.cpp's converter did: tensor names go back to Hugging
Face names and the q/k row permutation of Llama rotary is reversed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from cpuserve.loading.lazy import LazyByName
from cpuserve.loading.quant_tensor import QTYPES, QuantTensor

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("CPUSERVE_CACHE", Path.home() / ".cache" / "cpuserve"))


def hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in _TOP_MAP:
        return f"{_TOP_MAP[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_MAP:
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute() of q/k projection rows (interleaved -> halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Multi-byte fields inside each quantized block, as (offset, width) in bytes, and the
# block size. GGUF stores them in the file's byte order (little-endian but for files
# converted on big-endian machines); numpy's dequantizers read them in the host's.
BLOCK_FIELDS = {
    "BF16": (2, ((0, 2),)),
    "Q4_0": (18, ((0, 2),)),
    "Q4_1": (20, ((0, 2), (2, 2))),
    "Q5_0": (22, ((0, 2), (2, 4))),
    "Q5_1": (24, ((0, 2), (2, 2), (4, 4))),
    "Q8_0": (34, ((0, 2),)),
    "Q2_K": (84, ((80, 2), (82, 2))),
    "Q3_K": (110, ((108, 2),)),
    "Q4_K": (144, ((0, 2), (2, 2))),
    "Q5_K": (176, ((0, 2), (2, 2))),
    "Q6_K": (210, ((208, 2),)),
}


def swap_block_fields(raw: np.ndarray, type_name: str) -> np.ndarray:
    """A copy of raw quantized blocks with every multi-byte field byte-swapped."""
    if type_name not in BLOCK_FIELDS:
        raise ValueError(f"GGUF tensors of type {type_name} in the other byte order than this machine's are not "
                         f"supported (supported: F32, F16, {', '.join(BLOCK_FIELDS)})")
    size, fields = BLOCK_FIELDS[type_name]
    blocks = np.array(raw, dtype=np.uint8).reshape(-1, size)
    for off, width in fields:
        blocks[:, off:off + width] = blocks[:, off:off + width][:, ::-1]
    return blocks.reshape(np.shape(raw))


def dequantize(data: np.ndarray, qtype, swapped: bool) -> np.ndarray:
    """float32 values of one tensor; `swapped`: the file's byte order is not the host's."""
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.array(data, dtype=np.float32)  # the reader's dtype already carries the file's order
    if swapped:
        data = swap_block_fields(data, qtype.name)
    return np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader, arch: str, tensor_names: set[str]) -> dict:
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_head = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = int(g("vocab_size", 0)) or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                          "qwen3": ["Qwen3ForCausalLM"]}[arch],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(g("attention.head_count_kv", n_head)),
        "head_dim": int(g("attention.key_length", hidden // n_head)),
        "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if arch == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def open_reader(path: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - truncated or not GGUF at all: name the file
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHS)}); use the model's Hugging Face directory instead")
    return reader, arch


def tensor_index(reader, arch: str, cfg: dict) -> dict:
    """Where each tensor lies in the file, by Hugging Face name (kept beside the config, so
    that a start does not parse the file's metadata again: the vocabulary alone takes seconds)."""
    tensors = {}
    for t in reader.tensors:
        tensors[hf_name(t.name)] = {
            "gguf_name": t.name, "type": int(t.tensor_type), "type_name": t.tensor_type.name,
            "shape": [int(x) for x in reversed(t.shape.tolist())],  # GGUF lists ne0 (columns) first
            "offset": int(t.data_offset), "n_bytes": int(t.n_bytes), "n_elements": int(t.n_elements)}
    return {"arch": arch, "swapped": reader.byte_order == "S", "tensors": tensors,
            "heads": {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}}


def convert(path: Path, out: Path) -> None:
    """config.json, the tokenizer files, the tensor index and cpuserve_source.json (the GGUF's path)."""
    from cpuserve.loading.gguf_tokenizer import write_tokenizer

    reader, arch = open_reader(path)
    cfg = _config(reader, arch, {t.name for t in reader.tensors})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "gguf_tensors.json").write_text(json.dumps(tensor_index(reader, arch, cfg)))
    write_tokenizer(reader, path, out)
    (out / "cpuserve_source.json").write_text(json.dumps({"gguf": str(path)}))


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory stands for, or None for a Hugging Face directory."""
    src = Path(model_dir) / "cpuserve_source.json"
    return Path(json.loads(src.read_text())["gguf"]) if src.exists() else None


class GGUFTensors(LazyByName):
    """Hugging Face name -> tensor, read from the GGUF file when popped, with plain file
    reads at the offsets of the converted directory's index (no memory map: no mapped page
    of the weights stays resident). Quantized tensors of the types the kernels run come as
    QuantTensor unless `dequantize`; every other one as float32 (F16 as is)."""

    def __init__(self, model_dir: Path, dequantize: bool = False):
        super().__init__()
        index = json.loads((Path(model_dir) / "gguf_tensors.json").read_text())
        self.path, self.dequantize = gguf_source(model_dir), dequantize
        self.arch, self.swapped, self.heads = index["arch"], index["swapped"], index["heads"]
        self._where = index["tensors"]

    def _load(self, name: str, t: dict):
        w = self._read(t)
        proj = name.rsplit(".", 2)[-2]
        if self.arch == "llama" and proj in self.heads:
            rows = unpermute_rotary(torch.arange(w.shape[0]).unsqueeze(1), self.heads[proj]).squeeze(1)
            w = w.permute_rows(rows) if isinstance(w, QuantTensor) else w[rows].contiguous()
        return w

    def _read(self, t: dict):
        import gguf

        buf = bytearray(t["n_bytes"])
        with open(self.path, "rb") as fh:
            fh.seek(t["offset"])
            if fh.readinto(buf) != len(buf):
                raise ValueError(f"{self.path}: truncated data for tensor {t['gguf_name']}")
        shape, qtype = tuple(t["shape"]), t["type"]
        raw = np.frombuffer(buf, dtype=np.uint8)
        if qtype in QTYPES and not self.dequantize and len(shape) == 2:
            if self.swapped:
                raw = swap_block_fields(raw, t["type_name"])
            return QuantTensor(torch.from_numpy(np.array(raw).reshape(shape[0], -1)), qtype, shape[1])
        kind = gguf.GGMLQuantizationType(qtype)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dt = np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
            file_order = ">" if self.swapped != (sys.byteorder == "big") else "<"
            arr = np.frombuffer(buf, dtype=dt.newbyteorder(file_order))
            return torch.from_numpy(arr.astype(dt.newbyteorder("="))).reshape(shape)
        return torch.from_numpy(dequantize(raw, kind, self.swapped)).reshape(shape)


def weight_bytes(model_dir: Path, dequantize_to: torch.dtype | None) -> int:
    """Resident weight bytes of a converted GGUF: its tensor data as stored, or widened to a dtype."""
    tensors = json.loads((Path(model_dir) / "gguf_tensors.json").read_text())["tensors"].values()
    if dequantize_to is None:
        return sum(t["n_bytes"] for t in tensors)
    size = torch.tensor([], dtype=dequantize_to).element_size()
    return sum(t["n_elements"] * size for t in tensors)


def converted_dir(path: str | os.PathLike) -> Path:
    """The cached Hugging Face directory for a GGUF file, converting it on first use."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|v4".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        try:
            convert(path, tmp)
        except OSError as e:  # a full or read-only cache volume; nothing half-written is kept
            raise OSError(e.errno, f"converting {path} into the cache {out.parent} failed: {e.strerror or e}; "
                          "free space there or point CPUSERVE_CACHE at a writable volume") from None
        try:
            tmp.rename(out)  # atomic: a concurrent converter may have won the race
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
