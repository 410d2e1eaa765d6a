"""The architecture registry: Hugging Face architecture name -> (module, class).
Adding an architecture is one file in this package and one line here."""
from __future__ import annotations

import importlib

_REGISTRY = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            module, cls = _REGISTRY[arch]
            return getattr(importlib.import_module(f"cpuserve.model_executor.models.{module}"), cls)
    raise ValueError(f"model architecture {archs or '(none given)'} is not supported; supported: "
                     f"{', '.join(supported_architectures())}")
