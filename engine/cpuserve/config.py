"""Engine configuration: one dataclass with every knob, validated in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

# How the weights are kept (loading/model_loader.py checkpoint_quantization; the CLI's --quantization).
QUANTIZATIONS = ("auto", "gguf", "awq", "gptq", "compressed-tensors", "none")

GiB = 1 << 30
DEFAULT_KV_CACHE_GIB = 4.0  # vLLM's VLLM_CPU_KVCACHE_SPACE default, and ours without a memory limit


def env_kv_cache_space() -> float | None:
    """VLLM_CPU_KVCACHE_SPACE (or CPUSERVE_KVCACHE_SPACE) in GiB; 0 or unset means default."""
    for name in ("CPUSERVE_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        raw = os.environ.get(name)
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number of GiB") from None
            if value < 0:
                raise ValueError(f"{name} must be >= 0 GiB, got {value}")
            if value > 0:
                return value
    return None


@dataclass
class EngineConfig:
    model: str | None = None          # HF directory, .gguf file; None = the packaged SmolLM2
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16 (weights and KV cache)
    kv_cache_dtype: str = "auto"      # auto (= dtype) | float32 | bfloat16 | float16 | fp8_e5m2 | fp8_e4m3 (fp8)
    quantization: str | None = None   # None/auto (as the checkpoint is) | gguf | awq | gptq | compressed-tensors | none (widen)
    quantized_activations: str = "none"  # int8: block-quantized GEMMs on int8 dot products (kernels/qdot.hpp)
    block_size: int = 128
    kv_cache_space: float | None = None   # GiB; default from VLLM_CPU_KVCACHE_SPACE, else 4
    num_kv_blocks: int | None = None      # exact block count (tests); overrides kv_cache_space
    kv_populate: str = "start"            # start | idle | off: when the KV cache's pages are faulted in
    weight_hugepages: str = "start"       # start | idle | off: when the packed weights get huge pages
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len) when not chunking
    # with chunked prefill, prompt tokens in a step that also decodes (None / 0: the whole budget)
    max_prefill_tokens_while_decoding: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    served_model_name: str | None = None
    runner: str = "auto"              # auto | generate | pooling (vLLM's --runner: a causal LM as an embedder)
    # default sampling parameters (core/generation_config.py): auto (the model's
    # generation_config.json) | vllm (none) | a directory holding one; overrides over them
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    max_logprobs: int = 20                # the most logprobs a request may ask for (-1: the whole vocabulary)
    hf_overrides: dict | None = None      # merged over the model's config.json (vLLM's --hf-overrides)
    enable_lora: bool = False             # LoRA adapters (loading/lora.py): vLLM's --enable-lora
    lora_modules: dict | None = None      # name -> PEFT adapter directory, loaded at start (--lora-modules)
    max_loras: int = 8                    # the most adapters loaded at once (--max-loras)
    max_lora_rank: int = 16               # the largest adapter rank accepted (--max-lora-rank)
    binding: object | None = None     # binding.BindingPlan; None = planned from the environment at startup
    # True when neither kv_cache_space nor the environment set it: under a container memory limit
    # the engine then sizes the KV cache to what the limit leaves (ModelRunner), else 4 GiB
    kv_cache_space_default: bool = field(default=False, init=False)

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora=True (--enable-lora)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.enable_lora and self.tensor_parallel_size != 1:
            raise ValueError("LoRA adapters run on one rank: tensor_parallel_size must be 1 with enable_lora")
        if len(self.lora_modules or {}) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} lora_modules for max_loras={self.max_loras}")

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 0:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 0 (0: no cap), got "
                             f"{self.max_prefill_tokens_while_decoding}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantized_activations not in ("none", "int8"):
            raise ValueError(f"quantized_activations must be none or int8, got {self.quantized_activations!r}")
        if self.kv_populate not in ("start", "idle", "off"):
            raise ValueError(f"kv_populate must be start, idle or off, got {self.kv_populate!r}")
        if self.weight_hugepages not in ("start", "idle", "off"):
            raise ValueError(f"weight_hugepages must be start, idle or off, got {self.weight_hugepages!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_lora()
        if self.kv_cache_space is None:
            self.kv_cache_space = env_kv_cache_space()
            self.kv_cache_space_default = self.kv_cache_space is None and self.num_kv_blocks is None
            self.kv_cache_space = self.kv_cache_space or DEFAULT_KV_CACHE_GIB
        if self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space}")

    def resolve_max_logprobs(self, vocab_size: int) -> int:
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def resolve_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({max_model_len}) and chunked prefill is off: long prompts could never be scheduled. "
                    "Enable chunked prefill or raise max_num_batched_tokens.")
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
