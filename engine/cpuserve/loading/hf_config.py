"""Reads a Hugging Face config.json without importing transformers (whose import
alone costs seconds at every start). Fields a checkpoint leaves out take the
defaults of transformers' config class for that model type; tests check that
the values match transformers' own reading."""
from __future__ import annotations

import json
from pathlib import Path

_DEFAULTS: dict[str, dict] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                  max_position_embeddings=2048, attention_bias=False),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                    max_position_embeddings=4096 * 32, sliding_window=4096, num_key_value_heads=8),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                  max_position_embeddings=32768, use_sliding_window=False, num_key_value_heads=32),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                  max_position_embeddings=32768, use_sliding_window=False, head_dim=128, num_key_value_heads=32),
    "opt": dict(do_layer_norm_before=True, activation_function="relu", max_position_embeddings=2048),
    "gpt2": dict(n_positions=1024, layer_norm_epsilon=1e-5, activation_function="gelu_new", scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False),
    "gemma3_text": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rms_norm_eps=1e-6,
                        rope_theta=1_000_000.0, rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
                        final_logit_softcapping=None, attn_logit_softcapping=None, max_position_embeddings=131072,
                        sliding_window_pattern=6, tie_word_embeddings=True, num_key_value_heads=4),
}


class HFConfig:
    """Attribute access to config.json with model-type defaults."""

    def __init__(self, raw: dict):
        self.__dict__.update(_DEFAULTS.get(raw.get("model_type", ""), {}))
        self.__dict__.update(raw)
        if "num_attention_heads" in raw and "num_key_value_heads" not in self.__dict__:  # llama: = heads
            self.num_key_value_heads = raw["num_attention_heads"]
        if raw.get("model_type") == "opt" and raw.get("word_embed_proj_dim") is None:
            self.word_embed_proj_dim = raw.get("hidden_size")
        if raw.get("model_type") == "gpt2":  # aliases transformers provides
            self.hidden_size, self.num_attention_heads = raw.get("n_embd"), raw.get("n_head")
            self.num_hidden_layers, self.max_position_embeddings = raw.get("n_layer"), self.n_positions

    def __getattr__(self, name: str):  # only called for missing attributes
        raise AttributeError(f"config has no field {name!r}")

    def get(self, name: str, default=None):
        return self.__dict__.get(name, default)


def load_config(model_dir: Path, overrides: dict | None = None) -> HFConfig:
    """config.json with vLLM's --hf-overrides merged over it (nested objects merged key by key).
    A classifier made from a causal LM's head (`classifier_from_token`, as vLLM serves Qwen3
    rerankers) gets those tokens' ids from the model's tokenizer.json."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    raw = merged(raw, overrides or {})
    if raw.get("is_original_qwen3_reranker"):  # as vLLM: its head's "no" and "yes" rows
        raw.setdefault("classifier_from_token", ["no", "yes"])
    if raw.get("classifier_from_token"):
        raw["classifier_from_token_ids"] = _token_ids(Path(model_dir), raw["classifier_from_token"])
    return HFConfig(raw)


def merged(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`: objects key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _token_ids(model_dir: Path, tokens) -> list[int]:
    from tokenizers import Tokenizer

    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("classifier_from_token must be a list of tokens, e.g. [\"no\", \"yes\"]")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in tokens]
    missing = [t for t, i in zip(tokens, ids) if i is None]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} not in the tokenizer's vocabulary")
    return ids
