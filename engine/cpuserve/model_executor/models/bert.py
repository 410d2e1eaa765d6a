"""BERT encoders (sentence-transformers models such as all-MiniLM-L6-v2): learned
absolute positions, post-norm layers, GELU (erf), bidirectional attention. They run
without a KV cache: a batch of whole sequences, packed into one row set for the
linear layers, each sequence attending over itself."""
from __future__ import annotations

import torch

from cpuserve.loading.quant_tensor import cat_rows
from cpuserve.model_executor.layers.linear import Linear
from cpuserve.model_executor.layers.norm import LayerNorm
from cpuserve.model_executor.models.common import Weights


def _dense(w) -> torch.Tensor:
    """A lookup table as float32 (a GGUF's quantized word embeddings widened: 47 MB for MiniLM)."""
    return w.dequantize() if hasattr(w, "dequantize") else w.float()


class BertLayer:
    def __init__(self, c, i: int, w: Weights, dtype: torch.dtype):
        p = f"encoder.layer.{i}."
        t = lambda n: w.take(p + n)  # noqa: E731
        qkv_w = cat_rows([t(f"attention.self.{n}.weight") for n in ("query", "key", "value")])
        qkv_b = torch.cat([t(f"attention.self.{n}.bias") for n in ("query", "key", "value")])
        self.qkv = Linear(qkv_w, qkv_b, dtype)
        self.out = Linear(t("attention.output.dense.weight"), t("attention.output.dense.bias"), dtype)
        self.attn_norm = LayerNorm(t("attention.output.LayerNorm.weight"), t("attention.output.LayerNorm.bias"),
                                   c.layer_norm_eps)
        self.up = Linear(t("intermediate.dense.weight"), t("intermediate.dense.bias"), dtype)
        self.down = Linear(t("output.dense.weight"), t("output.dense.bias"), dtype)
        self.mlp_norm = LayerNorm(t("output.LayerNorm.weight"), t("output.LayerNorm.bias"), c.layer_norm_eps)
        self.heads, self.hidden = c.num_attention_heads, c.hidden_size

    def attention(self, qkv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        h, d = self.heads, self.hidden // self.heads
        out = []
        for chunk in torch.split(qkv, lengths):
            q, k, v = chunk.view(-1, 3, h, d).permute(1, 2, 0, 3)  # each [heads, len, d]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            out.append(o.transpose(0, 1).reshape(-1, self.hidden))
        return torch.cat(out)

    def __call__(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attn_norm(x + self.out(self.attention(self.qkv(x), lengths)))
        return self.mlp_norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class BertModel:
    """hidden states of every token: encode(list of token id lists) -> [total tokens, hidden]."""
    is_pooling = True

    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp=None):
        c = config
        if getattr(c, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"BERT activation {c.hidden_act!r} is not supported (gelu is)")
        if getattr(c, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT position embeddings other than absolute are not supported")
        e = "embeddings."
        self.words = _dense(weights.take(e + "word_embeddings.weight"))
        self.positions = _dense(weights.take(e + "position_embeddings.weight"))
        self.token_type = _dense(weights.take(e + "token_type_embeddings.weight"))[0]
        self.norm = LayerNorm(weights.take(e + "LayerNorm.weight"), weights.take(e + "LayerNorm.bias"),
                              c.layer_norm_eps)
        self.layers = [BertLayer(c, i, weights, dtype) for i in range(c.num_hidden_layers)]
        self.hidden_size, self.vocab_size = c.hidden_size, c.vocab_size
        self.max_positions = c.max_position_embeddings
        # the pooler (CLS dense + tanh) serves next-sentence prediction, not sentence embeddings
        weights.check_consumed(ignore=("position_ids", "pooler."))

    def encode(self, batch: list[list[int]]) -> torch.Tensor:
        lengths = [len(ids) for ids in batch]
        ids = torch.tensor([t for seq in batch for t in seq], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lengths])
        x = self.norm(self.words[ids] + self.positions[pos] + self.token_type)
        for layer in self.layers:
            x = layer(x, lengths)
        return x
