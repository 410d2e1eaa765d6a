"""The runner of a pooling (embedding) model: an encoder run over whole sequences, no KV
cache, no sampler; its threads bound as a generation runner's are."""
from __future__ import annotations

import logging
import time

import torch

from cpuserve.config import EngineConfig
from cpuserve.loading.model_loader import load_config, load_state_dict, resolve
from cpuserve.model_executor.models import model_class
from cpuserve.model_executor.models.common import Weights
from cpuserve.model_executor.pooling import Pooling

log = logging.getLogger("cpuserve")


def is_pooling_model(model_dir) -> bool:
    return bool(getattr(model_class(load_config(model_dir)), "is_pooling", False))


class PoolingRunner:
    def __init__(self, config: EngineConfig, model_dir=None):
        from cpuserve.worker.tp_ranks import start_rank0

        t0 = time.perf_counter()
        if config.tensor_parallel_size != 1:
            raise ValueError("embedding models run on one rank: tensor_parallel_size must be 1")
        self.config = config
        self.model_dir = model_dir or resolve(config.model)
        self.hf_config = load_config(self.model_dir)
        if config.dtype not in ("auto", "float32"):
            raise ValueError(f"embedding models run in float32; dtype {config.dtype!r} is not supported for them")
        self.dtype = torch.float32
        self.tp, self.binding, self.ranks = start_rank0(config, str(self.model_dir))
        self.model = model_class(self.hf_config)(self.hf_config, Weights(load_state_dict(self.model_dir)),
                                                 self.dtype)
        self.pooling = Pooling.from_dir(self.model_dir, decoder=False)
        limits = [self.model.max_positions, self.pooling.max_len, config.max_model_len]
        self.max_model_len = min(n for n in limits if n)
        self.vocab_size, self.num_blocks = self.model.vocab_size, 0
        self.load_seconds = time.perf_counter() - t0
        log.info("embedding model %s: %s pooling%s, up to %d tokens, loaded in %.1fs", self.model_dir,
                 self.pooling.mode, " + L2 normalization" if self.pooling.normalize else "", self.max_model_len,
                 self.load_seconds)

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        states = self.model.encode(batch)
        return [v.tolist() for v in self.pooling(states, [len(ids) for ids in batch])]

    def check_ranks(self) -> None:
        """(one rank: nothing to watch)"""
