"""Classification models for the tests, made with transformers where no hub can be reached:
the packaged all-MiniLM-L6-v2's real encoder under a seeded random classifier head (a cross-
encoder in shape: BertForSequenceClassification, its tokenizer's pair template), and tiny
random BERT / (XLM-)RoBERTa checkpoints. Each is a directory cpuserve and transformers both load."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from cpuserve.loading.model_loader import PACKAGED_EMBEDDER, resolve

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def minilm_classifier(out: Path, num_labels: int = 1, seed: int = 0, **config) -> Path:
    """MiniLM's 6 layers as BertForSequenceClassification with `num_labels` outputs: the pooler
    MiniLM ships, a classifier drawn from `seed`; `config`: fields such as id2label."""
    from transformers import BertForSequenceClassification

    src = resolve(PACKAGED_EMBEDDER)
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(str(src), num_labels=num_labels, **config).eval()
    with torch.no_grad():  # logits of a useful spread (the default init gives scores near 0.5)
        model.classifier.weight.normal_(0, 0.5)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, out / name)
    return out


def tiny(out: Path, arch: str, seed: int = 0, **config) -> Path:
    """A random 2-layer checkpoint of `arch` (BertForSequenceClassification, XLMRobertaModel, ...)
    with MiniLM's tokenizer files beside it (its ids are in range of the tiny vocabulary's 30,522)."""
    import transformers

    kind = "xlm-roberta" if arch.startswith("XLMRoberta") else "roberta" if arch.startswith("Roberta") else "bert"
    cfg = transformers.AutoConfig.for_model(kind, vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            max_position_embeddings=130, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    model.save_pretrained(str(out))
    src = resolve(PACKAGED_EMBEDDER)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, out / name)
    return out
