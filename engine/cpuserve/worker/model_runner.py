"""One rank's model and KV cache: loads the weights, sizes and allocates the
cache, and runs one scheduled batch per step. Input preparation lives in
input_batch.py, the cache in kv_cache.py, the other ranks in tp_ranks.py."""
from __future__ import annotations

import itertools
import logging
import math
import time
import weakref
from pathlib import Path

import torch

from cpuserve.config import EngineConfig
from cpuserve.core.scheduler import ScheduledBatch
from cpuserve.core.sequence import Sequence
from cpuserve.loading.model_loader import checkpoint_quantization, load_config, load_state_dict, resolve, \
    safetensors_header
from cpuserve.model_executor import models, ops
from cpuserve.model_executor.context import ForwardContext, set_context
from cpuserve.model_executor.lora import lora_batch
from cpuserve.model_executor.models.common import Weights
from cpuserve.model_executor.parallel import TPGroup
from cpuserve.platform import pages
from cpuserve.platform.isa import resolve_dtype, resolve_kv_dtype
from cpuserve.platform.malloc import release_free_heap, tune_malloc
from cpuserve.worker import kv_cache
from cpuserve.worker.idle import IdleWork
from cpuserve.worker.input_batch import (DecodeInputs, blocks_for, packed_inputs, prepare_inputs,
                                         prompt_logprob_rows, scoring_inputs)
from cpuserve.worker.sampler import Sampler, record_prompt_logprobs

log = logging.getLogger("cpuserve")


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def tensor_bytes(root) -> int:
    """Bytes of every tensor reachable from `root`: the union of the address ranges their
    elements span, so that views of one tensor count once and tensors placed side by side in one
    region (platform/pages.py's weight arena) count their own bytes, not the region's."""
    ranges, seen_obj, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel():
                span = sum((n - 1) * abs(st) for n, st in zip(obj.shape, obj.stride())) + 1
                ranges.append((obj.data_ptr(), obj.data_ptr() + span * obj.element_size()))
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return _union_bytes(ranges)


def _union_bytes(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, 0
    for lo, hi in sorted(ranges):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def packed_weights(root) -> list:
    """Every GEMM weight reachable from a model (ops.pack's results, stacked ones by part)."""
    from cpuserve.model_executor import ops

    out, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        if ops.is_stacked(obj):
            stack.extend(obj.parts)
        elif ops.is_packed(obj):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return out


def storage_summary(root) -> str:
    """'Q4_1 62.5 MiB (210), Q8_0 29.9 MiB (1)': the GEMM weights' bytes per storage format."""
    from cpuserve.model_executor import ops

    by: dict[str, list[int]] = {}
    for w in packed_weights(root):
        entry = by.setdefault(ops.storage_name(w), [0, 0])
        entry[0] += w.nbytes
        entry[1] += 1
    return ", ".join(f"{k} {b / 2**20:.1f} MiB ({n})" for k, (b, n) in sorted(by.items(), key=lambda e: -e[1][0]))


def _checkpoint_files(p: Path) -> list[Path]:
    return [p] if p.is_file() else [f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf", ".pt")]


def weights_in_memory(model_dir: Path, dtype: torch.dtype, quantization: str = "none") -> int:
    """The weights' bytes once loaded as `dtype`, from the safetensors headers (element counts)
    without reading the tensors; other formats count their files' size."""
    from cpuserve.loading import gguf_loader

    p = Path(model_dir)
    if p.is_dir() and gguf_loader.gguf_source(p) is not None:
        return gguf_loader.weight_bytes(p, dtype if quantization == "none" else None)
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for f in _checkpoint_files(p):
        if f.suffix != ".safetensors":
            total += f.stat().st_size
            continue
        for t in safetensors_header(f)[0].values():
            total += math.prod(t["shape"]) * size
    return total


def checkpoint_names(model_dir: Path) -> set[str] | None:
    """The tensor names of a converted GGUF or of safetensors files (their headers), None where
    other files (.bin, .pt) would have to be read."""
    from cpuserve.loading import gguf_loader

    p = Path(model_dir)
    if p.is_dir() and gguf_loader.gguf_source(p) is not None:
        return set(gguf_loader.converted_index(p)["tensors"])
    names = set()
    for f in _checkpoint_files(p):
        if f.suffix != ".safetensors":
            return None
        names.update(safetensors_header(f)[0])
    return names


def head_bytes_beyond_files(vocab: int, hidden: int, elem: int, tied: bool, ranks: int, greedy_copies: bool) -> int:
    """What loading dense weights (`elem` bytes an element) adds to the checkpoint's tensors at the
    vocabulary: a tied LM head's own packed copy of the embedding table (layers/embedding.py), the
    table replicated on every further rank (only the head is split), and, for greedy rows of a
    float32 head on one rank, its bfloat16 and Q8_0 copies with a float32 norm and error per column
    (LMHead)."""
    table = vocab * hidden
    extra = table * elem * (int(tied) + ranks - 1)
    if greedy_copies:
        extra += table * 2 + table // 32 * 34 + vocab * 8
    return extra


def loaded_weight_bytes(model_dir: Path, hf_config, dtype: torch.dtype, quantization: str = "none",
                        ranks: int = 1) -> int:
    """weights_in_memory, with head_bytes_beyond_files for dense weights (a quantized checkpoint's
    table stays in its blocks, which a tied head shares). Float32 SmolLM2: its tensors 513 MiB,
    this 704, loaded 706."""
    total = weights_in_memory(model_dir, dtype, quantization)
    vocab, hidden = getattr(hf_config, "vocab_size", None), getattr(hf_config, "hidden_size", None)
    if quantization != "none" or not vocab or not hidden:
        return total
    from cpuserve.model_executor.layers.embedding import greedy_head_enabled

    names = checkpoint_names(model_dir)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) or (names is not None and "lm_head.weight" not in names)
    greedy = dtype == torch.float32 and ranks == 1 and greedy_head_enabled() \
        and not getattr(hf_config, "final_logit_softcapping", None)
    elem = torch.tensor([], dtype=dtype).element_size()
    return total + head_bytes_beyond_files(vocab, hidden, elem, tied, ranks, greedy)


_LORA_SERIALS = itertools.count(1)


class ModelRunner:
    """One rank's model and KV cache. Rank 0 (the only rank without tensor
    parallelism) also binds itself and starts and drives the other ranks."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, model_dir=None, binding_report=None):
        t0 = time.perf_counter()
        self.config = config
        self.ranks = None
        self.model_dir = Path(model_dir) if model_dir else resolve(config.model)
        self.hf_config = load_config(self.model_dir, config.hf_overrides)
        cls = models.model_class(self.hf_config)  # unknown architecture: fail before reading weights
        self.dtype = resolve_dtype(config.dtype, checkpoint_dtype(self.hf_config))
        self.quantization = checkpoint_quantization(self.model_dir, config.quantization)
        kv = config.kv_cache_dtype
        self.kv_dtype = resolve_kv_dtype(kv, self.dtype)
        self.block_size = config.block_size
        self.decode_inputs = DecodeInputs(self.block_size)  # decode steps' inputs, rewritten in place
        self.max_model_len = max_model_len(self.hf_config, config.max_model_len)
        if tp is None:  # rank 0: what the container's memory allows is settled before any rank starts
            self.memory_limit = self._check_memory()
            tp, binding_report = self._start_rank0()
        else:
            self.memory_limit = None  # (rank 0 checked the whole container)
        self.tp, self.binding = tp, binding_report
        try:
            self._load(cls)
        except BaseException as e:
            self._abort_ranks(e)
            raise
        self.sampler = Sampler(eos_token_ids(self.hf_config))
        self.loras: dict = {}  # name -> loading.lora.LoRAAdapter
        for name, path in (config.lora_modules or {}).items():
            self.add_lora(name, path)
        self.malloc = tune_malloc()  # after loading: the weights' temporaries go back to the kernel as before
        self.load_seconds = time.perf_counter() - t0
        log.info("rank %d/%d loaded %s (%s) in %.2fs: dtype=%s kv=%s blocks=%d x %d tokens, max_model_len=%d",
                 tp.rank, tp.size, self.model_dir, type(self.model).__name__, self.load_seconds, self.dtype,
                 self.kv_dtype, self.num_blocks, self.block_size, self.max_model_len)
        log.info("rank %d/%d malloc: %s", tp.rank, tp.size, self.malloc)
        log.info("rank %d/%d weights: %.1f MiB resident, quantization=%s; GEMM weights as stored: %s", tp.rank,
                 tp.size, self.weight_bytes / 2**20, self.quantization, storage_summary(self.model))

    def _start_rank0(self):
        from cpuserve.worker.tp_ranks import start_rank0

        tp, report, self.ranks = start_rank0(self.config, str(self.model_dir))
        if self.ranks is not None:
            weakref.finalize(self, self.ranks.shutdown)
        return tp, report

    def _load(self, cls) -> None:
        """Weights, then the KV cache; rank 0 then waits for the other ranks to be ready."""
        arena = pages.HugeArena(mode=pages.hugepages_mode(self.config.weight_hugepages))
        with ops.quantized_activations(self.config.quantized_activations), ops.weights_in(arena):
            self.model = cls(self.hf_config, Weights(load_state_dict(self.model_dir, self.quantization)), self.dtype,
                             self.tp)
        self.weight_bytes = tensor_bytes(self.model)  # before the KV cache is bound to the layers
        release_free_heap()  # the load's freed temporaries, before the KV cache is checked against the limit
        self.num_blocks, self.kv_cache, kv_idle = self._allocate_kv_cache()
        self.idle_work = IdleWork(arena.collapser(), *kv_idle)
        if self.ranks is not None:
            self.rank_info = self.ranks.wait_ready()
            self.ranks.comm.unlink()  # every rank has attached: nothing is left behind in /dev/shm

    def _check_memory(self) -> int | None:
        """Rank 0, before anything is read: sizes the KV cache per rank from the container's memory
        limit when none was given (logged), and refuses what cannot fit the limit: the weights,
        every rank's KV cache and each further rank's own runtime. Returns the limit."""
        limit, used = kv_cache.memory_budget()
        size = self.config.tensor_parallel_size
        weights = loaded_weight_bytes(self.model_dir, self.hf_config, self.dtype, self.quantization, size)
        others = (size - 1) * kv_cache.process_baseline() if limit is not None else 0
        if self.config.kv_cache_space_default:
            self._size_kv_cache(limit, used + others, weights)
        # (an exact block count is checked once allocated, when the block's size is known)
        kv = int(self.config.kv_cache_space * kv_cache.GiB) if self.config.num_kv_blocks is None else 0
        ranks = f" x {size} ranks" if size > 1 else ""
        kv_cache.check_fits_container(
            f"the weights ({weights / kv_cache.GiB:.2f} GiB as {str(self.dtype).replace('torch.', '')}) and the "
            f"KV cache ({kv / kv_cache.GiB:.2f} GiB{ranks}), on top of the {(used + others) / kv_cache.GiB:.2f} "
            "GiB in use,", used + others + weights + kv * size, limit)
        return limit

    def _size_kv_cache(self, limit: int | None, used: int, weights: int) -> None:
        """No KV cache size was given: the container's memory limit decides it (logged)."""
        c = self.hf_config
        hidden = c.hidden_size
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "ffn_dim", None) or 4 * hidden
        size = self.config.tensor_parallel_size
        reserve = size * kv_cache.runtime_reserve(hidden, ffn, c.vocab_size,
                                                  self.config.resolve_batched_tokens(self.max_model_len),
                                                  self.config.max_num_seqs)
        kv, how = kv_cache.default_kv_bytes(limit, used, weights, reserve, ranks=size)
        self.config.kv_cache_space = kv / kv_cache.GiB
        self.config.kv_cache_space_default = False  # settled: the other ranks receive it as given
        log.info("KV cache %.2f GiB%s: %s (VLLM_CPU_KVCACHE_SPACE sets it)", kv / kv_cache.GiB,
                 " per rank" if size > 1 else "", how)

    def _allocate_kv_cache(self) -> tuple[int, torch.Tensor, tuple]:
        layers = self.model.attention_layers
        own = kv_cache.block_bytes(layers, self.kv_dtype, self.block_size)
        blocks = kv_cache.num_blocks(self.config, kv_cache.largest_block_bytes(own, self.tp))
        kv_cache.check_fits_node(self.tp.rank, self.binding, self.weight_bytes, blocks * own)
        if self.tp.size == 1 and self.memory_limit is not None:
            _, used = kv_cache.memory_budget()
            kv_cache.check_fits_container(f"the KV cache ({blocks * own / kv_cache.GiB:.2f} GiB), on top of the "
                                          f"{used / kv_cache.GiB:.2f} GiB in use,", used + blocks * own,
                                          self.memory_limit)
        mode = pages.populate_mode(self.config.kv_populate)
        huge = pages.hugepages_mode(self.config.weight_hugepages) != "off"
        return blocks, *kv_cache.allocate(layers, blocks, self.block_size, self.kv_dtype, mode, huge)

    def _abort_ranks(self, e: BaseException) -> None:
        """A failed load on rank 0 stops the other ranks; their own error, if one failed, is raised instead."""
        if self.ranks is None:
            return
        err = self.ranks.failure(e) if isinstance(e, RuntimeError) else e
        self.ranks.comm.abort()
        self.ranks.shutdown()
        if err is not e:
            raise err from None

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

    # -- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def add_lora(self, name: str, path: str) -> None:
        """Loads a LoRA adapter under `name` (--lora-modules, or an offline LoRARequest's first use)."""
        from cpuserve.loading.lora import load_adapter
        from cpuserve.model_executor.lora import check_shapes, pack

        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need enable_lora=True (--enable-lora)")
        if name in self.loras:
            if self.loras[name].path != str(path):
                raise ValueError(f"a LoRA adapter named {name!r} is loaded from {self.loras[name].path}, not {path}")
            return
        if not getattr(self.model, "supports_lora", False):
            raise ValueError(f"LoRA adapters are applied to Llama, Mistral and Qwen decoders, not "
                             f"{type(self.model).__name__}")
        if len(self.loras) >= self.config.max_loras:
            raise ValueError(f"{len(self.loras)} LoRA adapters are loaded: max_loras={self.config.max_loras}")
        adapter = load_adapter(name, path, self.hf_config.num_hidden_layers, self.config.max_lora_rank)
        check_shapes(adapter, self.hf_config)
        pack(adapter, self.hf_config)
        adapter.serial = next(_LORA_SERIALS)  # keys its prefix-cache blocks: a name loaded again is new
        self.loras[name] = adapter
        log.info("LoRA adapter %s from %s: rank %d, scaling %g, %d layers, %.1f MiB", name, path, adapter.rank,
                 adapter.scaling, len(adapter.layers), adapter.nbytes() / 2**20)

    def remove_lora(self, name: str) -> None:
        """Unloads an adapter (its requests must have finished: EngineCore checks)."""
        if self.loras.pop(name, None) is None:
            raise KeyError(name)
        log.info("LoRA adapter %s unloaded", name)

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[dict | None]]:
        """Runs the model on the batch; returns the sequences that sampled, their tokens and logprobs."""
        decode = self.decode_inputs(batch)
        input_ids, ctx, samplers = decode or prepare_inputs(batch, self.block_size)
        # the adapters' rows; None (the native path) where the step has none, set on every step
        # (a decode step's context is kept from step to step)
        ctx.lora = lora_batch(self.loras, [s.lora for s in batch.seqs], ctx.query_start_loc.tolist()) \
            if self.loras else None
        prompt_rows = [] if decode else prompt_logprob_rows(batch)
        if samplers and not prompt_rows and self.ranks is None and self.model.lm_head.greedy_copy is not None \
                and self.sampler.plain(samplers):
            tokens = self._run(input_ids, ctx, "argmax")
            return samplers, tokens.tolist(), [None] * len(samplers)
        logits = self._run(input_ids, ctx, bool(samplers or prompt_rows))
        if prompt_rows:
            record_prompt_logprobs(logits[len(samplers):], prompt_rows)
            logits = logits[:len(samplers)]
        if not samplers:
            return [], [], []
        tokens, logprobs = self.sampler(logits, samplers)
        return samplers, tokens, logprobs

    @torch.inference_mode()
    def logits_for(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence (tests and scoring), using a
        scratch sequence in blocks taken from the end of the cache."""
        nblk = (len(token_ids) + self.block_size - 1) // self.block_size
        if nblk > self.num_blocks:
            raise ValueError("sequence longer than the KV cache")
        table = list(range(self.num_blocks - nblk, self.num_blocks))
        input_ids, ctx = scoring_inputs(token_ids, table, self.block_size)
        return self._run(input_ids, ctx, True)

    @torch.inference_mode()
    def hidden_states(self, batch: list[list[int]]) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of whole sequences prefilled together into
        the cache from block 0 (a pooling runner's scratch cache; one rank)."""
        if self.ranks is not None:
            raise ValueError("hidden states are read on one rank: tensor_parallel_size must be 1")
        if blocks_for([len(ids) for ids in batch], self.block_size) > self.num_blocks:
            raise ValueError("the batch does not fit the cache")
        input_ids, ctx = packed_inputs(batch, self.block_size)
        set_context(ctx)
        try:
            return self.model.forward(input_ids, ctx.positions)
        finally:
            set_context(None)

    def _run(self, input_ids: torch.Tensor, ctx: ForwardContext, want_logits: bool | str) -> torch.Tensor | None:
        """Rank 0: the step on every rank."""
        if self.ranks is None:
            return self.forward(input_ids, ctx, want_logits)
        self.ranks.broadcast(("forward", input_ids, ctx, want_logits))
        try:
            return self.forward(input_ids, ctx, want_logits)
        except RuntimeError as e:
            raise self.ranks.failure(e) from None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, want_logits: bool | str) -> torch.Tensor | None:
        """This rank's part of one step; the logits (gathered over ranks) at ctx.logits_indices, or
        with want_logits "argmax" their argmax alone (one rank, a head with a greedy copy)."""
        set_context(ctx)
        try:
            hidden = self.model.forward(input_ids, ctx.positions)
        finally:
            set_context(None)
        if not want_logits:
            return None
        if not ctx.every_token_samples:  # else every row in order (decode steps, scoring): no gather
            hidden = hidden[ctx.logits_indices].contiguous()
        if want_logits == "argmax":
            return self.model.lm_head.greedy(hidden)
        return self.model.compute_logits(hidden)


def max_model_len(hf_config, want: int | None) -> int:
    """The context length to serve: the model's own, or a smaller one asked for."""
    native = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None) or 2048
    if want is None:
        return native
    if want < 1:
        raise ValueError(f"max_model_len must be >= 1, got {want}")
    if want > native:
        raise ValueError(f"max_model_len {want} exceeds the model's maximum context of {native} tokens")
    return want


def eos_token_ids(hf_config) -> set[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
