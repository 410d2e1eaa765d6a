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

from cpuserve import _C
from cpuserve.loading.lazy import LazyByName
from cpuserve.loading.quant_tensor import QTYPES, QuantTensor

_LLAMA_LAYERS = {
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
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GEMMA3_LAYERS = {**_LLAMA_LAYERS, "ffn_norm": "pre_feedforward_layernorm",
                  "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GPT2_LAYERS = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
             "output": "lm_head"}

_BERT_LAYERS = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_BERT_TOP = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
             "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm"}

# GGUF architecture -> (Hugging Face architecture, layer prefix, layer names, top-level names):
# every architecture the engine runs that llama.cpp's converter writes (Mistral is "llama").
ARCHS = {
    "llama": ("LlamaForCausalLM", "model.layers", _LLAMA_LAYERS, _LLAMA_TOP),
    "qwen2": ("Qwen2ForCausalLM", "model.layers", _LLAMA_LAYERS, _LLAMA_TOP),
    "qwen3": ("Qwen3ForCausalLM", "model.layers", _LLAMA_LAYERS, _LLAMA_TOP),
    "gemma3": ("Gemma3ForCausalLM", "model.layers", _GEMMA3_LAYERS, _LLAMA_TOP),
    "gpt2": ("GPT2LMHeadModel", "transformer.h", _GPT2_LAYERS, _GPT2_TOP),
    "bert": ("BertModel", "encoder.layer", _BERT_LAYERS, _BERT_TOP),
}
# llama.cpp's pooling_type -> sentence-transformers' pooling mode (1_Pooling/config.json)
POOLING = {1: "pooling_mode_mean_tokens", 2: "pooling_mode_cls_token", 3: "pooling_mode_lasttoken"}
SUPPORTED_ARCHS = tuple(ARCHS)
GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def cache_root() -> Path:
    return Path(os.environ.get("CPUSERVE_CACHE", Path.home() / ".cache" / "cpuserve"))


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    _, prefix, layers, top = ARCHS[arch]
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in top:
        return f"{top[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layers:
        return f"{prefix}.{parts[1]}.{layers[parts[2]]}.{kind}"
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


def widen(q: QuantTensor) -> torch.Tensor:
    """float32 values of a [N, K] block-quantized weight by the engine's own decoder (the
    embedding lookup's, kernels/quant.hpp): bit for bit gguf-py's dequantization on every type
    and ISA (tests/engine/model_executor/test_quant_ops.py), and 3-4x faster: 0.25 against
    0.89 s for the default model's Q4_1 weights, at every float32 or bfloat16 start."""
    k = _C.Kernels("")  # (any ISA's table: they decode alike)
    n, kk = q.shape
    packed = torch.empty(k.qpacked_bytes(q.qtype, n, kk), dtype=torch.uint8)
    k.qpack(packed.data_ptr(), q.data.data_ptr(), q.qtype, n, kk)
    out = torch.empty((n, kk), dtype=torch.float32)
    ids = torch.arange(n, dtype=torch.int64)
    k.qrows(out.data_ptr(), packed.data_ptr(), q.qtype, ids.data_ptr(), n, kk)
    return out


# llama.cpp's general.sampling.* metadata (a model's recommended sampling) -> generation_config.json's
# names, which core/generation_config.py reads as the server's defaults
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader, arch: str, tensor_names: set[str]) -> dict:
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    vocab = int(g("vocab_size", 0)) or len(reader.fields["tokenizer.ggml.tokens"].data)
    common = {"architectures": [ARCHS[arch][0]], "vocab_size": vocab, "torch_dtype": "float32",
              "tie_word_embeddings": "output.weight" not in tensor_names,
              "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
              "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id")}
    if arch == "bert":
        types = next((int(t.shape[1]) for t in reader.tensors if t.name == "token_types.weight"), 2)
        return {**common, "model_type": "bert", "hidden_size": int(g("embedding_length")),
                "num_hidden_layers": int(g("block_count")), "num_attention_heads": int(g("attention.head_count")),
                "intermediate_size": int(g("feed_forward_length")), "max_position_embeddings": int(g("context_length")),
                "type_vocab_size": types, "layer_norm_eps": float(g("attention.layer_norm_epsilon")),
                "hidden_act": "gelu", "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", 0)}
    if arch == "gpt2":
        return {**common, "model_type": "gpt2", "n_embd": int(g("embedding_length")), "n_layer": int(g("block_count")),
                "n_head": int(g("attention.head_count")), "n_positions": int(g("context_length")),
                "n_ctx": int(g("context_length")), "n_inner": int(g("feed_forward_length")),
                "layer_norm_epsilon": float(g("attention.layer_norm_epsilon")), "activation_function": "gelu_new"}
    n_head = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    cfg = {
        **common,
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(g("attention.head_count_kv", n_head)),
        "head_dim": int(g("attention.key_length", hidden // n_head)),
        "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
    }
    if arch == "gemma3":
        return _gemma3_config(cfg, g)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if arch == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def _gemma3_config(cfg: dict, g) -> dict:
    """Gemma 3 as llama.cpp runs its GGUF: every 6th layer global unless the file gives a pattern,
    queries scaled by the head size, local layers' rotary base from rope.freq_base_swa."""
    pattern = g("attention.sliding_window_pattern", 6)
    n = cfg["num_hidden_layers"]
    if isinstance(pattern, list):  # one flag a layer: true = sliding
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n)]
    cfg.update(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
               query_pre_attn_scalar=cfg["head_dim"], sliding_window=int(g("attention.sliding_window", 4096)),
               rope_local_base_freq=float(g("rope.freq_base_swa", 10000.0)), layer_types=types,
               final_logit_softcapping=g("final_logit_softcapping"))
    if g("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
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
        tensors[hf_name(t.name, arch)] = {
            "gguf_name": t.name, "type": int(t.tensor_type), "type_name": t.tensor_type.name,
            "shape": [int(x) for x in reversed(t.shape.tolist())],  # GGUF lists ne0 (columns) first
            "offset": int(t.data_offset), "n_bytes": int(t.n_bytes), "n_elements": int(t.n_elements)}
    return {"arch": arch, "swapped": reader.byte_order == "S", "tensors": tensors,
            "heads": {"q_proj": cfg.get("num_attention_heads"), "k_proj": cfg.get("num_key_value_heads")}}


def convert(path: Path, out: Path) -> None:
    """config.json, the tokenizer files, the tensor index, cpuserve_source.json (the GGUF's path) and,
    where the GGUF recommends sampling parameters (general.sampling.*), generation_config.json."""
    from cpuserve.loading.gguf_tokenizer import write_tokenizer

    reader, arch = open_reader(path)
    cfg = _config(reader, arch, {t.name for t in reader.tensors})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "gguf_tensors.json").write_text(json.dumps(tensor_index(reader, arch, cfg)))
    write_tokenizer(reader, path, out)
    sampling = {name: _field(reader, key) for key, name in GGUF_SAMPLING.items() if _field(reader, key) is not None}
    if sampling:  # the model's recommended sampling, as llama.cpp reads it: the server's defaults
        (out / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    if arch == "bert":
        write_pooling(_field(reader, "bert.pooling_type", 1), out)
    (out / "cpuserve_source.json").write_text(json.dumps({"gguf": str(path)}))


def write_pooling(pooling_type: int, out: Path) -> None:
    """An embedding GGUF's pooling as sentence-transformers files (model_executor/pooling.py
    reads them), normalized as llama.cpp's embeddings are by default."""
    if int(pooling_type) not in POOLING:
        raise ValueError(f"GGUF pooling_type {pooling_type} is not supported (1 mean, 2 cls, 3 last token)")
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({POOLING[int(pooling_type)]: True}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory stands for, or None for a Hugging Face directory."""
    src = Path(model_dir) / "cpuserve_source.json"
    return Path(json.loads(src.read_text())["gguf"]) if src.exists() else None


def converted_index(model_dir: Path) -> dict:
    """A converted GGUF directory's index (gguf_tensors.json): its arch, its tensors by Hugging Face
    name (offset, kind, shape, n_elements, n_bytes), what the converter swapped."""
    return json.loads((Path(model_dir) / "gguf_tensors.json").read_text())


class GGUFTensors(LazyByName):
    """Hugging Face name -> tensor, read from the GGUF file when popped, with plain file
    reads at the offsets of the converted directory's index (no memory map: no mapped page
    of the weights stays resident). Quantized tensors of the types the kernels run come as
    QuantTensor unless `dequantize`; every other one as float32 (F16 as is)."""

    def __init__(self, model_dir: Path, dequantize: bool = False):
        super().__init__()
        index = converted_index(model_dir)
        self.path, self.dequantize = gguf_source(model_dir), dequantize
        self.arch, self.swapped, self.heads = index["arch"], index["swapped"], index["heads"]
        self._where = index["tensors"]

    def _load(self, name: str, t: dict):
        """Undoes the converter: Llama's q/k row permutation, Gemma 3's norm weights stored
        plus one, GPT-2's Conv1D weights stored transposed (float ones go back to [in, out];
        quantized ones only exist as [out, in], which the GPT-2 model takes as they are)."""
        w = self._read(t)
        proj = name.rsplit(".", 2)[-2]
        if self.arch == "llama" and proj in self.heads:
            rows = unpermute_rotary(torch.arange(w.shape[0]).unsqueeze(1), self.heads[proj]).squeeze(1)
            w = w.permute_rows(rows) if isinstance(w, QuantTensor) else w[rows].contiguous()
        elif self.arch == "gemma3" and name.endswith("norm.weight"):
            w = w.float() - 1.0
        elif self.arch == "gpt2" and name.endswith(GPT2_CONV1D) and isinstance(w, torch.Tensor):
            w = w.t().contiguous()
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
        if qtype in QTYPES and len(shape) == 2:
            if self.swapped:
                raw = swap_block_fields(raw, t["type_name"])
            q = QuantTensor(torch.from_numpy(np.array(raw).reshape(shape[0], -1)), qtype, shape[1])
            return widen(q) if self.dequantize else q
        kind = gguf.GGMLQuantizationType(qtype)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dt = np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
            file_order = ">" if self.swapped != (sys.byteorder == "big") else "<"
            arr = np.frombuffer(buf, dtype=dt.newbyteorder(file_order))
            return torch.from_numpy(arr.astype(dt.newbyteorder("="))).reshape(shape)
        return torch.from_numpy(dequantize(raw, kind, self.swapped)).reshape(shape)


def weight_bytes(model_dir: Path, dequantize_to: torch.dtype | None) -> int:
    """Resident weight bytes of a converted GGUF: its tensor data as stored, or widened to a dtype."""
    tensors = converted_index(model_dir)["tensors"].values()
    if dequantize_to is None:
        return sum(t["n_bytes"] for t in tensors)
    size = torch.tensor([], dtype=dequantize_to).element_size()
    return sum(t["n_elements"] * size for t in tensors)


def converted_dir(path: str | os.PathLike) -> Path:
    """The cached Hugging Face directory for a GGUF file, converting it on first use."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|v5".encode()).hexdigest()[:16]
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
