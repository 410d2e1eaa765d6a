"""Batch invariance on the real model: every prompt gives the same greedy tokens
alone and inside a batch of 32 mixed-length prompts, with prefix caching on and
off, chunked prefill on and off, prompt tokens capped in steps that decode, and with a cache small enough to force
preemption. (Exact equality: the kernels make a row's result independent of the
batch it is computed in.)"""
import pytest

from cpuserve import LLM, SamplingParams

MAX_TOKENS = 24
TEXT = ("The history of computing is a story of abstraction layered on abstraction. Early machines were "
        "programmed by rewiring; stored programs made software possible, and compilers made it portable. "
        "Operating systems then multiplexed one machine among many users, virtual memory gave every process "
        "its own address space, and caches hid the growing gap between processor and memory speeds. Today a "
        "language model served on a CPU touches every one of these layers: the scheduler decides which "
        "requests run, the cache keeps attention state in fixed-size blocks, and vector units do the math.")
SYSTEM = "You are a careful assistant. Answer briefly and precisely, and never invent facts. "


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer.encode(TEXT)
    sys_ids = tokenizer.encode(SYSTEM)
    out = []
    for i in range(32):
        n = 3 + (i * 37) % (len(ids) - 3)   # 3 .. ~120 tokens, mixed
        body = ids[(i * 7) % 20:(i * 7) % 20 + n] or ids[:n]
        out.append((sys_ids + body) if i % 2 else body)  # half share a prefix (prefix cache hits)
    return out


@pytest.fixture(scope="module")
def alone(llm_f32, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [llm_f32.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]


def _batched(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_same_tokens_in_a_batch(llm_f32, prompts, alone):
    assert _batched(llm_f32, prompts) == alone


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=False),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=2048),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=48),   # prompts split into many chunks
    dict(block_size=32, max_num_seqs=5),
    dict(max_num_batched_tokens=256, max_prefill_tokens_while_decoding=16),  # prompts trickle in beside decodes
], ids=["no-prefix-cache", "no-chunked-prefill", "small-chunks", "block32-maxseqs5", "prefill-capped-while-decoding"])
def test_same_tokens_across_engine_settings(prompts, alone, kwargs):
    llm = LLM(dtype="float32", **{"block_size": 16, "kv_cache_space": 0.5, **kwargs})
    assert _batched(llm, prompts) == alone


def test_same_tokens_under_preemption(prompts, alone):
    # 24 blocks of 16 tokens: the longest request fits alone (~150 tokens), the batch does not.
    llm = LLM(dtype="float32", block_size=16, num_kv_blocks=24)
    assert _batched(llm, prompts) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24  # everything returned


def test_prefix_cache_hits_are_counted(llm_f32, prompts):
    before = llm_f32.engine.prefix_cache_stats()
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm_f32.generate({"prompt_token_ids": prompts[-1]}, params)[0]
    again = llm_f32.generate({"prompt_token_ids": prompts[-1]}, params)[0]
    after = llm_f32.engine.prefix_cache_stats()
    assert again.num_cached_tokens >= 16 and again.num_cached_tokens % 16 == 0
    assert after["hits"] - before["hits"] >= again.num_cached_tokens
    assert after["queries"] > before["queries"]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_same_tokens_past_one_attention_partition(llm_f32, tokenizer):
    """Prompts of 2,100-2,600 tokens, past one attention partition (2,048 keys: kernels/attention.hpp
    kPartitionKeys). Decoded alone, a row's partitions are shared among the threads and merged after
    them; in a batch each row walks its partitions itself; chunked prefill and a preemption's
    recompute take the same positions as prefill rows: the same greedy tokens in every case."""
    ids = tokenizer.encode(TEXT * 30)
    prompts = [ids[s:s + n] for s, n in ((0, 2100), (5, 2300), (11, 2600))]  # no prefix shared
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [llm_f32.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    run = lambda llm: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert run(llm_f32) == alone
    small = LLM(dtype="float32", block_size=16, num_kv_blocks=277, max_num_batched_tokens=512)  # 132 + 144 admitted
    assert run(small) == alone
    assert small.engine.scheduler.num_preemptions > 0
