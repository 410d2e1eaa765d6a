"""Paged KV-cache block allocation with prefix caching.

A full block is identified by a chain hash of (parent block's hash, its token
ids), so equal prefixes map to equal blocks. Blocks are shared by reference
count; a block whose count drops to zero keeps its contents and its hash and
goes to the back of the free queue, to be reused by a later hit or evicted in
LRU order when a fresh block is needed.
"""
from __future__ import annotations

from collections import OrderedDict

from cpuserve.core.sequence import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.tokens: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}   # chain hash -> block id
        self.prefix_queries = 0            # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0               # of those, tokens found

    # -- accounting -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix cache ---------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full: int) -> list[int]:
        hashes, parent = [], seq.cache_root
        for i in range(num_full):
            parent = chain_hash(parent, tuple(seq.block_tokens(i, self.block_size)))
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq (never its last token:
        at least one token must be computed to produce logits); none for a sequence that asks for
        its prompt's logprobs: every prompt token is then computed (as vLLM does)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        num_full = (len(seq) - 1) // self.block_size
        hits = []
        for i, h in enumerate(self._block_hashes(seq, num_full)):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].tokens != tuple(seq.block_tokens(i, self.block_size)):
                break
            hits.append(bid)
        return hits

    # -- allocation -----------------------------------------------------------------
    def _take_free(self) -> Block:
        bid, _ = self.free.popitem(last=False)  # least recently freed
        block = self.blocks[bid]
        if block.hash is not None:  # evict its cached contents
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.tokens = None, None
        block.ref_count = 1
        return block

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] = ()) -> bool:
        """Whether seq (with `prefix` blocks reused from the cache) can get slots for num_new_tokens."""
        if seq.block_table:
            need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
            return need <= len(self.free)
        # a new sequence: prefix blocks are reused, and those sitting in the free
        # queue (ref count 0) are taken out of it by the hit
        need = self.blocks_needed(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
        revived = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        return need <= len(self.free) - revived

    def allocate_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Attach cached prefix blocks to a sequence that has none yet."""
        assert not seq.block_table
        for bid in prefix:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        n = len(prefix) * self.block_size
        seq.num_computed_tokens = n
        seq.num_cached_tokens = n
        self.prefix_queries += len(seq)
        self.prefix_hits += n

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError("allocate_slots called without can_allocate")
        for _ in range(need):
            seq.block_table.append(self._take_free().block_id)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Registers blocks that became full (their KV computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks  # blocks before it are registered already: no rewalk per step
        parent = self.blocks[seq.block_table[start - 1]].hash if start else seq.cache_root
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:  # a prefix-cache hit, or shared with another sequence
                parent = block.hash
                continue
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = chain_hash(parent, tokens)
            block.hash, block.tokens = h, tokens
            self.cached.setdefault(h, block.block_id)
            parent = h
        seq.num_hashed_blocks = max(start, num_full)

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # no contents worth keeping: reuse first
                else:
                    self.free[bid] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0  # num_cached_tokens stays: it is the request's statistic

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.hash is not None:
                self.cached.pop(block.hash, None)
                block.hash, block.tokens = None, None
