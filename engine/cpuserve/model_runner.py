"""Loads the model, owns the KV cache, and runs one scheduled batch per step."""
from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path

import torch

from cpuserve import models
from cpuserve.config import GiB, EngineConfig
from cpuserve.context import ForwardContext, set_context
from cpuserve.distributed import TPGroup
from cpuserve.model_loader import load_config, load_state_dict, resolve
from cpuserve.models.common import Weights
from cpuserve.platform_info import resolve_dtype
from cpuserve.sampler import Sampler
from cpuserve.scheduler import ScheduledBatch
from cpuserve.sequence import Sequence

log = logging.getLogger("cpuserve")


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def tensor_bytes(root) -> int:
    """Bytes of every tensor reachable from `root` (each storage counted once)."""
    seen_obj, seen_storage, total, stack = set(), set(), 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.data_ptr() not in seen_storage:
                seen_storage.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return total


class ModelRunner:
    """One rank's model and KV cache. Rank 0 (the only rank without tensor
    parallelism) also plans the CPU binding and starts and drives the other ranks."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, model_dir=None, binding_report=None):
        t0 = time.perf_counter()
        self.config = config
        self.ranks = None
        self.model_dir = Path(model_dir) if model_dir else resolve(config.model)
        self.hf_config = load_config(self.model_dir)
        cls = models.model_class(self.hf_config)  # unknown architecture: fail before reading weights
        self.dtype = resolve_dtype(config.dtype, checkpoint_dtype(self.hf_config))
        kv = config.kv_cache_dtype
        self.kv_dtype = self.dtype if kv == "auto" else resolve_dtype(kv, None)
        if tp is None:
            tp, binding_report = self._setup_rank0()
        self.tp, self.binding = tp, binding_report
        try:
            weights = Weights(load_state_dict(self.model_dir))
            self.model = cls(self.hf_config, weights, self.dtype, tp)
            self.weight_bytes = tensor_bytes(self.model)  # before the KV cache is bound to the layers
            self.max_model_len = self._max_model_len()
            self.block_size = config.block_size
            self.num_blocks = self._allocate_kv_cache()
            if self.ranks is not None:
                self.rank_info = self.ranks.wait_ready()
                self.ranks.comm.unlink()  # every rank has attached: nothing is left behind in /dev/shm
        except BaseException as e:
            if self.ranks is not None:
                err = self.ranks.failure(e) if isinstance(e, RuntimeError) else e
                self.ranks.comm.abort()
                self.ranks.shutdown()
                if err is not e:
                    raise err from None
            raise
        self.sampler = Sampler(self._eos_ids())
        self.load_seconds = time.perf_counter() - t0
        log.info("rank %d/%d loaded %s (%s) in %.2fs: dtype=%s kv=%s blocks=%d x %d tokens, max_model_len=%d",
                 tp.rank, tp.size, self.model_dir, type(self.model).__name__, self.load_seconds, self.dtype,
                 self.kv_dtype, self.num_blocks, self.block_size, self.max_model_len)

    def _setup_rank0(self):
        from cpuserve.binding import plan_from_env
        from cpuserve.cpu_platform import apply_rank_binding, log_plan
        from cpuserve.topology import read_topology

        size = self.config.tensor_parallel_size
        topo = read_topology()
        plan = self.config.binding or plan_from_env(topo, size)
        if len(plan.ranks) != size:
            raise ValueError(f"the binding plan has {len(plan.ranks)} ranks but tensor_parallel_size is {size}")
        log_plan(plan)
        allowed_mems = sorted(topo.allowed_mems)
        if size > 1:
            from cpuserve.tp import RankProcesses

            self.ranks = RankProcesses(self.config, plan, str(self.model_dir), allowed_mems)
            weakref.finalize(self, self.ranks.shutdown)
        try:
            report = apply_rank_binding(plan.ranks[0], allowed_mems)
        except BaseException:
            if self.ranks is not None:
                self.ranks.shutdown()
            raise
        return (TPGroup(0, size, self.ranks.comm) if self.ranks else TPGroup()), report

    @property
    def vocab_size(self) -> int:
        return self.model.lm_head.vocab_size

    def check_ranks(self) -> None:
        """Raises if a tensor-parallel rank has died (called while idle)."""
        if self.ranks is not None:
            self.ranks.check_alive()

    def comm_stats(self) -> list[tuple[float, int, float]]:
        """Per rank: seconds and calls inside all-reduce/all-gather, and the part of
        those seconds spent waiting for the other ranks to arrive."""
        stats = [self.tp.stats()]
        if self.ranks is not None:
            stats += self.ranks.request(("comm_stats",))
        return stats

    def reset_comm_stats(self) -> None:
        self.tp.reset_stats()
        if self.ranks is not None:
            self.ranks.broadcast(("reset_comm_stats",))

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None

    # -- setup ----------------------------------------------------------------------
    def _max_model_len(self) -> int:
        c = self.hf_config
        native = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 2048
        want = self.config.max_model_len
        if want is None:
            return native
        if want < 1:
            raise ValueError(f"max_model_len must be >= 1, got {want}")
        if want > native:
            raise ValueError(f"max_model_len {want} exceeds the model's maximum context of {native} tokens")
        return want

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    def _allocate_kv_cache(self) -> int:
        layers = self.model.attention_layers
        a = layers[0]
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        own = 2 * len(layers) * a.num_kv_heads * self.block_size * a.head_dim * elem
        per_block = own
        if self.tp.size > 1:  # every rank needs the same block count: size it by the largest shard
            mine = torch.tensor([own], dtype=torch.int64)
            per_block = int(self.tp.all_gather_last_dim(mine.view(1, 1), [1] * self.tp.size).max())
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        else:
            num_blocks = int(self.config.kv_cache_space * GiB // per_block)
        if num_blocks < 1:
            raise ValueError(f"KV cache space of {self.config.kv_cache_space} GiB holds no block of "
                             f"{per_block / 2**20:.1f} MiB ({self.block_size} tokens); raise "
                             "VLLM_CPU_KVCACHE_SPACE / --kv-cache-space or lower --block-size")
        self._check_memory(num_blocks * own)
        # One allocation for every layer's keys and values; pages are touched as blocks fill.
        self.kv_cache = torch.empty((len(layers), 2, num_blocks, a.num_kv_heads, self.block_size, a.head_dim),
                                    dtype=self.kv_dtype)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        return num_blocks

    def _check_memory(self, kv_bytes: int) -> None:
        b = self.binding
        if b is None or b.mem_bytes is None:
            return
        weights = self.weight_bytes
        if weights + kv_bytes > b.mem_bytes:
            raise ValueError(
                f"rank {self.tp.rank} does not fit its NUMA node {b.mem_node}: weights {weights / GiB:.2f} GiB + "
                f"KV cache {kv_bytes / GiB:.2f} GiB = {(weights + kv_bytes) / GiB:.2f} GiB, but the node has "
                f"{b.mem_bytes / GiB:.2f} GiB. Lower VLLM_CPU_KVCACHE_SPACE (--kv-cache-space, GiB per rank), "
                "use a smaller dtype, or raise --tensor-parallel-size")

    # -- one step -------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardContext, list[Sequence]]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            if end == len(seq):  # reached the end of what is known: sample the next token
                logits_idx.append(qsl[-1] - 1)
                samplers.append(seq)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = torch.zeros((len(batch.seqs), max_blocks), dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        ctx = ForwardContext(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
        )
        return torch.tensor(ids, dtype=torch.int64), ctx, samplers

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[dict | None]]:
        """Runs the model on the batch; returns the sequences that sampled, their tokens and logprobs."""
        input_ids, ctx, samplers = self.prepare(batch)
        logits = self._run(input_ids, ctx, bool(samplers))
        if not samplers:
            return [], [], []
        tokens, logprobs = self.sampler(logits, samplers)
        return samplers, tokens, logprobs

    @torch.inference_mode()
    def logits_for(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence (tests and scoring), using a
        scratch sequence in blocks taken from the end of the cache."""
        n = len(token_ids)
        nblk = (n + self.block_size - 1) // self.block_size
        if nblk > self.num_blocks:
            raise ValueError("sequence longer than the KV cache")
        table = list(range(self.num_blocks - nblk, self.num_blocks))
        ctx = ForwardContext(
            positions=torch.arange(n, dtype=torch.int64),
            slot_mapping=torch.tensor([table[p // self.block_size] * self.block_size + p % self.block_size
                                       for p in range(n)], dtype=torch.int64),
            block_tables=torch.tensor([table], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            logits_indices=torch.arange(n, dtype=torch.int64),
        )
        return self._run(torch.tensor(token_ids, dtype=torch.int64), ctx, True)

    def _run(self, input_ids: torch.Tensor, ctx: ForwardContext, want_logits: bool) -> torch.Tensor | None:
        """Rank 0: the step on every rank."""
        if self.ranks is None:
            return self.forward(input_ids, ctx, want_logits)
        self.ranks.broadcast(("forward", input_ids, ctx, want_logits))
        try:
            return self.forward(input_ids, ctx, want_logits)
        except RuntimeError as e:
            raise self.ranks.failure(e) from None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, want_logits: bool) -> torch.Tensor | None:
        """This rank's part of one step; the logits (gathered over ranks) at ctx.logits_indices."""
        set_context(ctx)
        try:
            hidden = self.model.forward(input_ids, ctx.positions)
        finally:
            set_context(None)
        if not want_logits:
            return None
        return self.model.compute_logits(hidden[ctx.logits_indices].contiguous())
