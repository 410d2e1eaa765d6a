"""BERT-style encoders: learned absolute positions, post-norm layers, GELU (erf), bidirectional
attention. They run without a KV cache: a batch of whole sequences, packed into one row set for
the linear layers, each sequence attending over itself.
- BertModel, RobertaModel / XLMRobertaModel: token states, pooled into sentence embeddings
  (sentence-transformers models such as all-MiniLM-L6-v2, multilingual-e5);
- BertForSequenceClassification, (XLM)RobertaForSequenceClassification: a classifier's logits,
  the cross-encoders that score a query and a document read together (ms-marco-MiniLM,
  bge-reranker). A pair's second text is segment 1 (token type ids), as the tokenizer's pair
  template marks it; RoBERTa counts positions from its padding index + 1, as transformers does."""
from __future__ import annotations

import torch

from cpuserve.loading.quant_tensor import cat_rows
from cpuserve.model_executor.layers.linear import Linear
from cpuserve.model_executor.layers.norm import LayerNorm
from cpuserve.model_executor.models.common import Weights


def _dense(w) -> torch.Tensor:
    """A lookup table as float32 (a GGUF's quantized word embeddings widened: 47 MB for MiniLM)."""
    return w.dequantize() if hasattr(w, "dequantize") else w.float()


def _affine(w: Weights, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A small head's weight and bias in float32 (a classifier's few rows run through torch)."""
    return w.take(name + ".weight").float(), w.take(name + ".bias").float()


class BertLayer:
    def __init__(self, c, i: int, w: Weights, dtype: torch.dtype, prefix: str = ""):
        p = f"{prefix}encoder.layer.{i}."
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
    is_encoder = True                      # whole sequences, no KV cache (worker/pooling_runner.py)
    prefix = ""                            # where the encoder's tensors live in the checkpoint
    unused: tuple[str, ...] = ("pooler.",)  # BERT's pooler serves next-sentence prediction, not embeddings
    segments = True                        # a pair's texts are token types 0 and 1

    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp=None):
        c = config
        if getattr(c, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"BERT activation {c.hidden_act!r} is not supported (gelu is)")
        if getattr(c, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT position embeddings other than absolute are not supported")
        e = self.prefix + "embeddings."
        self.words = _dense(weights.take(e + "word_embeddings.weight"))
        self.positions = _dense(weights.take(e + "position_embeddings.weight"))
        self.token_types = _dense(weights.take(e + "token_type_embeddings.weight"))
        self.norm = LayerNorm(weights.take(e + "LayerNorm.weight"), weights.take(e + "LayerNorm.bias"),
                              c.layer_norm_eps)
        self.layers = [BertLayer(c, i, weights, dtype, self.prefix) for i in range(c.num_hidden_layers)]
        self.hidden_size, self.vocab_size = c.hidden_size, c.vocab_size
        self.max_positions = c.max_position_embeddings
        self.load_head(c, weights)
        weights.check_consumed(ignore=("position_ids", *self.unused))

    def load_head(self, c, weights: Weights) -> None:
        """(an encoder's states are pooled by the runner: no head)"""

    def position_ids(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(n) for n in lengths])

    def encode(self, batch: list[list[int]], types: list[list[int] | None] | None = None) -> torch.Tensor:
        """`types`: each sequence's token type ids (segment 0 and 1 of a pair), None for all 0."""
        lengths = [len(ids) for ids in batch]
        if not self.segments:
            types = None
        ids = torch.tensor([t for seq in batch for t in seq], dtype=torch.long)
        kinds = [t if t is not None else [0] * n for t, n in zip(types or [None] * len(batch), lengths)]
        tt = torch.tensor([k for seq in kinds for k in seq], dtype=torch.long)
        x = self.norm(self.words[ids] + self.positions[self.position_ids(ids, lengths)] + self.token_types[tt])
        for layer in self.layers:
            x = layer(x, lengths)
        return x


class BertForSequenceClassification(BertModel):
    """A classifier's logits [sequences, labels] from its first ([CLS]) token through the pooler
    (dense + tanh) and the classifier, as transformers' BertForSequenceClassification."""
    prefix, unused = "bert.", ()

    def load_head(self, c, weights: Weights) -> None:
        self.pooler = _affine(weights, "bert.pooler.dense")
        self.classifier = _affine(weights, "classifier")
        self.num_labels = self.classifier[0].shape[0]

    def first_tokens(self, batch: list[list[int]], types) -> torch.Tensor:
        starts = torch.tensor([0] + [len(ids) for ids in batch[:-1]]).cumsum(0)
        return self.encode(batch, types)[starts]

    def classify(self, batch: list[list[int]], types=None) -> torch.Tensor:
        pooled = torch.tanh(torch.nn.functional.linear(self.first_tokens(batch, types), *self.pooler))
        return torch.nn.functional.linear(pooled, *self.classifier)


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT's layers; positions counted from padding_idx + 1 over the
    tokens that are not padding (a pad id inside a sequence keeps padding_idx); one token type
    for both texts of a pair, as transformers' RoBERTa tokenizers give no token type ids."""
    segments = False

    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp=None):
        self.padding_idx = config.pad_token_id
        super().__init__(config, weights, dtype, tp)
        self.max_positions = config.max_position_embeddings - self.padding_idx - 1

    def position_ids(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        out = []
        for seq in torch.split(ids, lengths):
            real = (seq != self.padding_idx).long()
            out.append(torch.cumsum(real, 0) * real + self.padding_idx)
        return torch.cat(out)


class RobertaForSequenceClassification(RobertaModel, BertForSequenceClassification):
    """RoBERTa's classification head: dense + tanh + out_proj on the first (<s>) token; no pooler."""
    prefix, unused = "roberta.", ()

    def load_head(self, c, weights: Weights) -> None:
        self.dense = _affine(weights, "classifier.dense")
        self.out_proj = _affine(weights, "classifier.out_proj")
        self.num_labels = self.out_proj[0].shape[0]

    def classify(self, batch: list[list[int]], types=None) -> torch.Tensor:
        hidden = torch.tanh(torch.nn.functional.linear(self.first_tokens(batch, types), *self.dense))
        return torch.nn.functional.linear(hidden, *self.out_proj)
