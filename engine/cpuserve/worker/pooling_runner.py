"""The runners of an embedding or classification model, no sampler and no generation KV cache:
- an encoder (BERT, RoBERTa) run over whole sequences: pooled into embeddings, or a
  cross-encoder's classifier logits;
- a causal LM run as one (vLLM's `--runner pooling`): each batch is prefilled into a scratch
  cache of its own and pooled, by default from its last token.
Both bind their threads as a generation runner does."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from cpuserve.config import EngineConfig
from cpuserve.loading.model_loader import checkpoint_quantization, load_config, load_state_dict, resolve
from cpuserve.model_executor import ops
from cpuserve.model_executor.models import model_class
from cpuserve.model_executor.models.common import Weights
from cpuserve.model_executor.pooling import Pooling
from cpuserve.platform import pages
from cpuserve.platform.malloc import release_free_heap
from cpuserve.worker.idle import IdleWork
from cpuserve.worker.input_batch import blocks_for

log = logging.getLogger("cpuserve")


def is_pooling_model(model_dir, overrides: dict | None = None) -> bool:
    """An encoder or a classifier, which only pool (a causal LM embeds only when asked: `runner="pooling"`)."""
    return bool(getattr(model_class(load_config(model_dir, overrides)), "is_pooling", False))


def runs_pooling(config: EngineConfig, model_dir) -> bool:
    """Whether this engine pools (True: embeddings or a classifier's logits) or generates (False)."""
    pooling = is_pooling_model(model_dir, config.hf_overrides)
    if config.runner == "generate" and pooling:
        raise ValueError(f"{model_dir} is an embedding model (an encoder) or a classifier: it cannot run with "
                         "runner='generate'")
    return pooling or config.runner == "pooling"


def pooling_runner(config: EngineConfig, model_dir):
    if config.tensor_parallel_size != 1:
        raise ValueError("embedding models run on one rank: tensor_parallel_size must be 1")
    encoder = getattr(model_class(load_config(model_dir, config.hf_overrides)), "is_encoder", False)
    return EncoderRunner(config, model_dir) if encoder else DecoderPoolingRunner(config, model_dir)


class EncoderRunner:
    def __init__(self, config: EngineConfig, model_dir=None):
        from cpuserve.worker.tp_ranks import start_rank0

        t0 = time.perf_counter()
        self.config = config
        self.model_dir = model_dir or resolve(config.model)
        self.hf_config = load_config(self.model_dir, config.hf_overrides)
        if config.dtype not in ("auto", "float32"):
            raise ValueError(f"embedding models run in float32; dtype {config.dtype!r} is not supported for them")
        self.dtype = torch.float32
        self.tp, self.binding, self.ranks = start_rank0(config, str(self.model_dir))
        self.quantization = checkpoint_quantization(self.model_dir, config.quantization)
        arena = pages.HugeArena(mode=pages.hugepages_mode(config.weight_hugepages))
        with ops.quantized_activations(config.quantized_activations), ops.weights_in(arena):
            self.model = model_class(self.hf_config)(
                self.hf_config, Weights(load_state_dict(self.model_dir, self.quantization)), self.dtype)
        release_free_heap()  # the load's freed temporaries go back to the kernel, as ModelRunner's
        self.idle_work = IdleWork(arena.collapser())
        self.task = "classify" if hasattr(self.model, "classify") else "embed"
        self.pooling = Pooling.from_dir(self.model_dir, decoder=False)
        limits = [self.model.max_positions, self.pooling.max_len, config.max_model_len]
        self.max_model_len = min(n for n in limits if n)
        self.vocab_size, self.num_blocks = self.model.vocab_size, 0  # no generation KV cache
        self.load_seconds = time.perf_counter() - t0
        _log_loaded(self.model_dir, self.pooling if self.task == "embed" else None, self.max_model_len,
                    self.load_seconds)

    def fits(self, lengths: list[int]) -> bool:
        """(an encoder keeps no cache: the core's token budget is the only bound)"""
        return True

    @torch.inference_mode()
    def embed(self, batch: list[list[int]], types: list[list[int] | None] | None = None) -> list[list[float]]:
        """Each sequence's pooled embedding, or a classifier's logits; `types`: token type ids."""
        if self.task == "classify":
            return [v.tolist() for v in self.model.classify(batch, types)]
        states = self.model.encode(batch, types)
        return [v.tolist() for v in self.pooling(states, [len(ids) for ids in batch])]

    def check_ranks(self) -> None:
        """(one rank: nothing to watch)"""


class DecoderPoolingRunner:
    """A causal LM's final hidden states, pooled. The scratch cache holds the longer of one
    step's token budget and one longest sequence, in 16-token blocks; `fits` tells the
    core how many sequences one step can take."""
    BLOCK = 16

    def __init__(self, config: EngineConfig, model_dir):
        from cpuserve.worker.model_runner import ModelRunner, max_model_len

        t0 = time.perf_counter()
        longest = max_model_len(load_config(model_dir, config.hf_overrides), config.max_model_len)
        tokens = max(config.resolve_batched_tokens(longest), longest)
        scratch = dataclasses.replace(config, block_size=self.BLOCK, enable_prefix_caching=False,
                                      num_kv_blocks=blocks_for([tokens], self.BLOCK))
        self.model_dir = model_dir
        self.runner = ModelRunner(scratch, model_dir=model_dir)
        self.pooling = Pooling.from_dir(model_dir, decoder=True)
        self.max_model_len = min(n for n in (longest, self.pooling.max_len) if n)
        self.vocab_size, self.num_blocks = self.runner.vocab_size, 0  # (its scratch cache is not for generation)
        self.task = "classify" if hasattr(self.runner.model, "classify_states") else "embed"
        self.dtype, self.binding = self.runner.dtype, self.runner.binding
        self.idle_work = self.runner.idle_work
        self.load_seconds = time.perf_counter() - t0
        _log_loaded(model_dir, self.pooling if self.task == "embed" else None, self.max_model_len,
                    self.load_seconds)

    def fits(self, lengths: list[int]) -> bool:
        return blocks_for(lengths, self.BLOCK) <= self.runner.num_blocks

    @torch.inference_mode()
    def embed(self, batch: list[list[int]], types=None) -> list[list[float]]:
        """Each sequence's pooled embedding, or a classifier's logits from its last token (a causal
        LM has no token types: `types` is None)."""
        states = self.runner.hidden_states(batch).float()
        lengths = [len(ids) for ids in batch]
        if self.task == "classify":
            last = torch.tensor(lengths).cumsum(0) - 1
            return [v.tolist() for v in self.runner.model.classify_states(states[last])]
        return [v.tolist() for v in self.pooling(states, lengths)]

    def check_ranks(self) -> None:
        """(one rank: nothing to watch)"""


def _log_loaded(model_dir, pooling: Pooling | None, max_len: int, seconds: float) -> None:
    how = ("a classifier" if pooling is None else
           f"embedding model, {pooling.mode} pooling{' + L2 normalization' if pooling.normalize else ''}")
    log.info("%s: %s, up to %d tokens, loaded in %.1fs", model_dir, how, max_len, seconds)
