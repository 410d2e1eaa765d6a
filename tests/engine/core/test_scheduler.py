"""The block manager and the scheduler as pure logic (no model)."""
import pytest

from cpuserve.core.block_manager import BlockManager
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.core.scheduler import Scheduler
from cpuserve.core.sequence import FinishReason, Sequence, SequenceStatus

BS = 16


def seq(n, start=0, max_tokens=8):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, batch):
    """What the engine does after the model ran: tokens computed, a token sampled at the end."""
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_computed_tokens += n
        sched.bm.commit_full_blocks(s)
        if s.num_computed_tokens == len(s):
            s.token_ids.append(7)


def computed(bm, n, start=0):
    """A sequence of n tokens whose KV is computed and whose full blocks are registered."""
    s = seq(n, start)
    bm.allocate_slots(s, n)
    s.num_computed_tokens = n
    bm.commit_full_blocks(s)
    return s


def test_prefix_blocks_are_shared_and_counted():
    bm = BlockManager(10, BS)
    a = computed(bm, 40)
    b = seq(40)  # same tokens
    hit = bm.match_prefix(b)
    assert hit == a.block_table[:2]  # 2 full blocks (the third is partial)
    bm.allocate_prefix(b, hit)
    assert b.num_computed_tokens == 32 and bm.blocks[hit[0]].ref_count == 2
    assert bm.prefix_hits == 32 and bm.prefix_queries == 40


def test_prefix_match_never_covers_the_last_token():
    bm = BlockManager(10, BS)
    a = computed(bm, 32)
    assert len(bm.match_prefix(seq(32))) == 1  # the block holding the last token is recomputed


def test_freed_cached_blocks_are_revived_or_evicted_lru():
    bm = BlockManager(4, BS)
    a = computed(bm, 33)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    b = seq(40)
    hit = bm.match_prefix(b)
    assert len(hit) == 2
    assert bm.can_allocate(b, 40 - 32, hit)
    bm.allocate_prefix(b, hit)
    bm.allocate_slots(b, 8)
    assert bm.num_free_blocks == 1
    bm.free_seq(b)
    c = seq(64, start=1000)  # unrelated: needs all 4 blocks, evicting the cached ones
    bm.allocate_slots(c, 64)
    assert bm.cached == {} and bm.num_free_blocks == 0


def test_token_budget_chunks_prefills_and_keeps_fcfs():
    bm = BlockManager(100, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=50, max_model_len=1000)
    a, b, c = seq(70), seq(30, 500), seq(10, 900)
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()
    assert batch.seqs == [a] and batch.num_tokens == [50]  # chunk of a; b may not overtake
    run_step(s, batch)
    batch = s.schedule()
    assert batch.seqs == [a, b] and batch.num_tokens == [20, 30]
    run_step(s, batch)
    batch = s.schedule()  # a and b decode, c prefills
    assert batch.seqs == [a, b, c] and batch.num_tokens == [1, 1, 10]


def test_prompt_tokens_capped_only_in_steps_that_decode():
    bm = BlockManager(100, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1000,
                  max_prefill_tokens_while_decoding=20)
    a, b, c, d = seq(40), seq(30, 100), seq(30, 200), seq(30, 300)
    for x in (a, b):
        s.add(x)
    batch = s.schedule()  # nothing decodes yet: the whole budget goes to prompts
    assert batch.seqs == [a, b] and batch.num_tokens == [40, 24]
    run_step(s, batch)
    s.add(c)
    s.add(d)
    batch = s.schedule()  # a decodes: b's last chunk and c's first share 20 prompt tokens, d waits
    assert batch.seqs == [a, b, c] and batch.num_tokens == [1, 6, 14]
    run_step(s, batch)
    batch = s.schedule()  # c's rest and the first of d within 20; a and b decode
    assert batch.seqs == [a, b, c, d] and batch.num_tokens == [1, 1, 16, 4]
    run_step(s, batch)
    s.finish(a, FinishReason.LENGTH)
    s.finish(b, FinishReason.LENGTH)
    batch = s.schedule()  # c decodes: d's chunk is held to 20 although 63 tokens are free
    assert batch.seqs == [c, d] and batch.num_tokens == [1, 20]


def test_prompt_chunk_held_back_lets_later_decodes_run():
    bm = BlockManager(100, BS)
    s = Scheduler(bm, 8, 64, 1000, max_prefill_tokens_while_decoding=8)
    a, b = seq(4), seq(60, 100)
    s.add(a)
    run_step(s, s.schedule())
    s.add(b)
    run_step(s, s.schedule())  # a decodes, b takes 8 of its 60
    c = seq(4, 300)
    s.add(c)
    batch = s.schedule()  # b (running, before c) takes the 8; c, a short prompt, waits
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 8]
    run_step(s, batch)
    s.max_prefill_tokens_while_decoding = 0  # 0: no cap
    batch = s.schedule()
    assert batch.seqs == [a, b, c] and batch.num_tokens == [1, 44, 4]


def test_prompt_cap_ignored_without_chunked_prefill():
    bm = BlockManager(100, BS)
    s = Scheduler(bm, 8, 64, 1000, enable_chunked_prefill=False, max_prefill_tokens_while_decoding=8)
    a, b = seq(4), seq(40, 100)
    s.add(a)
    run_step(s, s.schedule())
    s.add(b)
    batch = s.schedule()  # a prompt cannot be split without chunking: b is taken whole
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 40]


def test_no_chunking_waits_for_budget():
    bm = BlockManager(100, BS)
    s = Scheduler(bm, 8, 64, 1000, enable_chunked_prefill=False)
    a, b = seq(40), seq(40, 100)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.seqs == [a]  # b does not fit the remaining 24 tokens and is not split


def test_max_num_seqs_caps_running():
    bm = BlockManager(100, BS)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=1000)
    for i in range(3):
        s.add(seq(5, i * 100))
    assert len(s.schedule().seqs) == 2 and len(s.waiting) == 1


def test_preemption_frees_the_newest_and_requeues_it_first():
    bm = BlockManager(4, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000, max_model_len=1000)
    a, b = seq(32), seq(32, 100)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # both prefilled: 2 blocks each, cache full
    assert bm.num_free_blocks == 0
    # a's 33rd token needs a third block: b (newest) is preempted
    batch = s.schedule()
    assert batch.seqs == [a] and batch.preempted == [b]
    assert b.status == SequenceStatus.WAITING and s.waiting[0] is b and b.block_table == []
    assert s.num_preemptions == 1


def test_finish_frees_blocks():
    bm = BlockManager(8, BS)
    s = Scheduler(bm, 8, 1000, 1000)
    a = seq(20)
    s.add(a)
    run_step(s, s.schedule())
    s.finish(a, FinishReason.STOP)
    assert bm.num_free_blocks == 8 and a.is_finished and not s.has_unfinished()


def test_admission_refuses_impossible_requests():
    s = Scheduler(BlockManager(4, BS), 8, 1000, max_model_len=100)
    with pytest.raises(ValueError, match="maximum context length"):
        s.check_admissible(100, 10)
    with pytest.raises(ValueError, match="whole cache holds 4 blocks"):
        s.check_admissible(60, 20)
    s.check_admissible(60, 4)


# -- tensor-parallel shard sizing (pure) -------------------------------------------------
def test_shard_sizes_balanced_not_required_to_divide():
    from cpuserve.model_executor.parallel import split_sizes
    from cpuserve.model_executor.layers.linear import qkv_head_split

    assert split_sizes(3, 2) == [2, 1] and split_sizes(49152, 2, 64) == [24576, 24576]
    assert split_sizes(50257, 2, 64) == [25152, 25105]  # GPT-2's vocabulary: the rest to the last rank
    # SmolLM2: 9 query / 3 kv heads on two ranks: 5 + 4 query heads, kv head 1 on both
    assert qkv_head_split(9, 3, 2) == [(0, 5, 0, 2), (5, 4, 1, 2)]
    assert qkv_head_split(8, 4, 2) == [(0, 4, 0, 2), (4, 4, 2, 2)]  # divisible: plain Megatron split
    assert qkv_head_split(8, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]  # kv replicated
    assert qkv_head_split(6, 3, 4) == [(0, 2, 0, 1), (2, 2, 1, 1), (4, 1, 2, 1), (5, 1, 2, 1)]
    with pytest.raises(ValueError, match="cannot be split"):
        qkv_head_split(2, 1, 4)
