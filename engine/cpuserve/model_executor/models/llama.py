"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm), SmolLM."""
from __future__ import annotations

import torch

from cpuserve.model_executor import native_step, ops
from cpuserve.model_executor.context import get_context
from cpuserve.model_executor.parallel import TPGroup
from cpuserve.model_executor.layers.attention import PagedAttention
from cpuserve.model_executor.layers.embedding import Embedding, LMHead
from cpuserve.model_executor.layers.norm import RMSNorm
from cpuserve.model_executor.layers.rotary import RotaryEmbedding
from cpuserve.model_executor.models.common import CausalLM, Weights, attention_projections, gated_mlp, rope_settings


class LlamaDecoderLayer:
    def __init__(self, c, i: int, w: Weights, dtype: torch.dtype, tp: TPGroup, rotary: RotaryEmbedding):
        p = f"model.layers.{i}."
        self.index = i
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.qkv, self.o_proj = attention_projections(w, p, self.head_dim, dtype, tp)
        qn, kn = w.take_optional(p + "self_attn.q_norm.weight"), w.take_optional(p + "self_attn.k_norm.weight")
        self.q_norm = RMSNorm(qn, c.rms_norm_eps) if qn is not None else None
        self.k_norm = RMSNorm(kn, c.rms_norm_eps) if kn is not None else None
        window = 0
        if getattr(c, "model_type", "") == "mistral":
            window = getattr(c, "sliding_window", None) or 0
        elif getattr(c, "use_sliding_window", False):
            raise ValueError("Qwen sliding-window layers (use_sliding_window=true) are not supported")
        self.attn = PagedAttention.for_qkv(self.qkv, self.head_dim,
                                   self.head_dim ** -0.5, window)
        self.rotary = rotary
        self.gate_up, self.down = gated_mlp(w, p, dtype, tp)
        self.input_norm = RMSNorm(w.take(p + "input_layernorm.weight"), c.rms_norm_eps)
        self.post_attn_norm = RMSNorm(w.take(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
        # native_step runs this layer: one rank (its all-reduces are no-ops), inputs not permuted
        self.native_ok = tp.size == 1 and all(
            lin.in_perm is None for lin in (self.qkv, self.o_proj, self.gate_up, self.down))

    def __call__(self, positions, h, residual):
        lora = get_context().lora
        if residual is None:
            residual = h
            h = self.input_norm(h)
        else:
            h, residual = self.input_norm(h, residual)
        qkv = self.qkv(h)
        if lora is not None:
            lora.apply(self.index, "qkv", h, qkv)
        q, k, v = self.qkv.split(qkv)
        if self.q_norm is not None:
            q = self.q_norm.heads(q, self.head_dim)
            k = self.k_norm.heads(k, self.head_dim)
        self.rotary(positions, q, k)
        h = self.attn(q, k, v)
        if lora is None:
            h = self.o_proj(h)
            h, residual = self.post_attn_norm(h, residual)
            return self.down(self.gate_up.silu_and_mul(h)), residual
        return self._mlp_with_lora(lora, h, residual)

    def _mlp_with_lora(self, lora, a: torch.Tensor, residual: torch.Tensor):
        """The rest of the layer, each projection's output updated by the step's adapters."""
        h = self.o_proj(a)
        lora.apply(self.index, "o", a, h)
        h, residual = self.post_attn_norm(h, residual)
        gu = self.gate_up(h)
        lora.apply(self.index, "gate_up", h, gu)
        act = torch.nn.functional.silu(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]
        out = self.down(act)
        lora.apply(self.index, "down", act, out)
        return out, residual


class LlamaForCausalLM(CausalLM):
    supports_lora = True  # the layers apply a step's LoRA updates (model_executor/lora.py)

    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp: TPGroup):
        c = config
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported for {c.architectures}")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta, scaling = rope_settings(c)
        rotary = RotaryEmbedding(head_dim, head_dim, c.max_position_embeddings, theta, scaling, neox=True)
        embed = weights.take("model.embed_tokens.weight")
        self.embed = Embedding(embed, dtype)
        self.layers = [LlamaDecoderLayer(c, i, weights, dtype, tp, rotary) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(weights.take("model.norm.weight"), c.rms_norm_eps)
        lm = weights.take_optional("lm_head.weight")
        tied = lm is None or getattr(c, "tie_word_embeddings", False)
        self.lm_head = LMHead(embed if tied else lm, dtype, tp, packed=self.embed.shared_head(tp) if tied else None)
        weights.check_consumed(ignore=("rotary_emb.inv_freq",))


    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        native = native_step.decoder_for(self) if get_context().lora is None else None
        if native is not None:  # the same kernels in one native call
            return native(input_ids, positions, get_context())
        h, residual = self.embed(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return h


class LlamaForSequenceClassification(LlamaForCausalLM):
    """Llama, Mistral and Qwen classifiers (vLLM's classify models, Qwen3 rerankers' shape): the
    decoder's final state of a sequence's last token through `score` (labels x hidden, no bias),
    as transformers' *ForSequenceClassification reads its last token that is not padding. Run
    by the pooling runner; the LM head is the tied embedding, never used. A causal LM's checkpoint
    becomes one through --hf-overrides (from_token_head), as vLLM serves Qwen3 rerankers."""
    is_pooling = True

    def __init__(self, config, weights: Weights, dtype: torch.dtype, tp: TPGroup):
        score = weights.take_optional("score.weight")
        self.score = (score.float() if score is not None else from_token_head(config, weights))
        self.num_labels = self.score.shape[0]
        super().__init__(config, weights, dtype, tp)

    def classify_states(self, last: torch.Tensor) -> torch.Tensor:
        """[sequences, hidden] final states of each sequence's last token -> [sequences, labels]."""
        return last.float() @ self.score.T


def from_token_head(config, weights: Weights) -> torch.Tensor:
    """vLLM's classifier from a causal LM's own head (hf_overrides `classifier_from_token`): the
    LM head's rows of those tokens, one label each; with `method: from_2_way_softmax` (or
    `is_original_qwen3_reranker`, whose tokens are "no" and "yes") one label, the second row
    less the first, whose sigmoid is the two tokens' softmax probability of the second."""
    ids = config.get("classifier_from_token_ids")
    if not ids:
        raise ValueError("the checkpoint has no score.weight: serve a *ForSequenceClassification checkpoint, or a "
                         "causal LM with --hf-overrides '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                         "\"classifier_from_token\": [\"no\", \"yes\"], \"method\": \"from_2_way_softmax\"}'")
    name = "lm_head.weight" if "lm_head.weight" in weights.tensors else "model.embed_tokens.weight"
    head = weights.peek(name)
    rows = (head.dequantize() if hasattr(head, "dequantize") else head.float())[ids]
    if two_way(config):
        return (rows[1] - rows[0]).unsqueeze(0)
    return rows


def two_way(config) -> bool:
    return (config.get("method") == "from_2_way_softmax" or bool(config.get("is_original_qwen3_reranker"))) and \
        len(config.get("classifier_from_token_ids") or ()) == 2

