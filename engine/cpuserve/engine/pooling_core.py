"""The engine core of an embedding or classification model: requests wait in arrival order and
each step encodes as many as fit the token budget, `max_num_seqs` and the runner's scratch space
(at least one), batched; no generation KV cache is touched. A request's output is its pooled
embedding, or its classifier's logits (`task` "classify")."""
from __future__ import annotations

import time
from collections import deque

from cpuserve.config import EngineConfig
from cpuserve.engine.outputs import CoreStats, EmbeddingOutput
from cpuserve.worker.pooling_runner import pooling_runner


class PoolingCore:
    def __init__(self, config: EngineConfig, model_dir=None):
        self.config = config
        self.runner = pooling_runner(config, model_dir)
        self.task = self.runner.task  # "embed" | "classify"
        self.max_model_len, self.vocab_size = self.runner.max_model_len, self.runner.vocab_size
        self.budget = config.resolve_batched_tokens(self.max_model_len)
        self.waiting: deque[tuple[str, list[int], list[int] | None]] = deque()
        self.stats = CoreStats()

    def validate(self, ids: list[int], types: list[int] | None = None) -> None:
        """`types`: the token type ids of a pair (a cross-encoder's), one per token, each 0 or 1."""
        if types is not None and (len(types) != len(ids) or any(t not in (0, 1) for t in types)):
            raise ValueError("token type ids must be one 0 or 1 per input token")
        if not ids:
            raise ValueError("the input is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"input token ids must be in [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the input has {len(ids)} tokens; this embedding model takes at most "
                             f"{self.max_model_len}")

    def add_request(self, request_id: str, ids: list[int], params: list[int] | None = None,
                    arrival: float | None = None) -> None:
        """`params`: the input's token type ids, or None (all segment 0)."""
        self.validate(ids, params)
        self.waiting.append((request_id, list(ids), None if params is None else list(params)))

    def abort_request(self, request_id: str) -> None:
        self.waiting = deque(r for r in self.waiting if r[0] != request_id)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """(embeddings have no sequences to stop)"""

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[EmbeddingOutput]:
        t0 = time.perf_counter()
        batch, tokens = [], 0
        while self.waiting and (not batch or self._room(batch, tokens)):
            batch.append(self.waiting.popleft())
            tokens += len(batch[-1][1])
        types = [t for _, _, t in batch]
        vectors = self.runner.embed([ids for _, ids, _ in batch], types if any(t is not None for t in types) else None)
        self.stats.count_step(tokens, 0, tokens, time.perf_counter() - t0)
        return [EmbeddingOutput(rid, v, len(ids)) for (rid, ids, _), v in zip(batch, vectors)]

    def _room(self, batch: list[tuple], tokens: int) -> bool:
        """Whether the next waiting request joins this step's batch."""
        n = len(self.waiting[0][1])
        return (tokens + n <= self.budget and len(batch) < self.config.max_num_seqs
                and self.runner.fits([len(b[1]) for b in batch] + [n]))

    def snapshot_stats(self) -> CoreStats:
        s = self.stats
        s.num_running, s.num_waiting = 0, len(self.waiting)
        s.startup_work_pending = self.runner.idle_work.pending
        return s


def make_core(config: EngineConfig):
    """The generation engine core, or the pooling one for an embedding model."""
    from cpuserve.engine.engine_core import EngineCore
    from cpuserve.loading.model_loader import resolve
    from cpuserve.worker.pooling_runner import runs_pooling

    model_dir = resolve(config.model)
    return PoolingCore(config, model_dir) if runs_pooling(config, model_dir) else EngineCore(config)
