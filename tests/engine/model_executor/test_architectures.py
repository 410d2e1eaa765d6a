"""Each registered architecture against transformers, on small random-weight
models built from transformers configs (the real SmolLM2 parity is in
test_parity.py). Sequences span several cache blocks and, where the
architecture has one, a sliding window shorter than the sequence."""
import shutil

import pytest
import torch
import transformers as tf

from cpuserve import LLM, SamplingParams

VOCAB = 49152  # the SmolLM2 tokenizer is copied into each model directory
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, tie_word_embeddings=False, **COMMON),
    # 6 query / 3 kv heads: two ranks take 2 and 1 GQA groups; vocab split unevenly in 64s
    "llama-uneven": lambda: tf.LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                           num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True,
                                           **COMMON),
    "mistral-swa": lambda: tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, sliding_window=8, **COMMON),
    "qwen2": lambda: tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, **COMMON),
    "qwen3": lambda: tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, **COMMON),
    "opt": lambda: tf.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                word_embed_proj_dim=64, init_std=0.1, vocab_size=VOCAB, max_position_embeddings=256),
    "opt-postnorm-proj": lambda: tf.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                              word_embed_proj_dim=32, do_layer_norm_before=False, init_std=0.1,
                                              vocab_size=VOCAB, max_position_embeddings=256),
    "gpt2": lambda: tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=VOCAB,
                                  initializer_range=0.1),
    "gemma3": lambda: tf.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                          query_pre_attn_scalar=32, **COMMON),
}


def build_tiny(name, tmp_path_factory, llm_f32):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(path))
    src = llm_f32.engine.runner.model_dir
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return name, model, path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory, llm_f32):
    return build_tiny(request.param, tmp_path_factory, llm_f32)


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_greedy_match_transformers(tiny, tp):
    """tp=2: two rank processes (one core each here), sharded attention and MLP,
    shared-memory all-reduce, vocab-sharded LM head."""
    name, hf, path = tiny
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_space=0.05, tensor_parallel_size=tp)
    try:
        check_against_transformers(name, hf, llm)
    finally:
        llm.engine.runner.close()


@pytest.fixture(scope="module")
def uneven(tmp_path_factory, llm_f32):
    return build_tiny("llama-uneven", tmp_path_factory, llm_f32)


def test_four_ranks_with_partial_gqa_groups(uneven):
    """6 query / 3 kv heads on 4 ranks: 2+2+1+1 query heads, the last two ranks
    each holding half of kv head 2's group (query-head offset 1 on rank 3)."""
    name, hf, path = uneven
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_space=0.05, tensor_parallel_size=4)
    try:
        check_against_transformers(name, hf, llm)
    finally:
        llm.engine.runner.close()


def check_against_transformers(name, hf, llm):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = llm.engine.runner.logits_for(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))

    # greedy: ours (batched with another prompt, chunked) vs a plain HF greedy loop
    prompt = ids[:21]
    ref, seq = [], list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = hf(torch.tensor([seq])).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            ref.append((int(logits.argmax()), float(top2[0] - top2[1])))
            seq.append(ref[-1][0])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": ids[5:30]}], params)[0]
    for i, (tok, (want_tok, gap)) in enumerate(zip(out.outputs[0].token_ids, ref)):
        if tok != want_tok:
            assert gap < 1e-3 * float(want.abs().max()), f"{name}: diverged at step {i} (gap {gap})"
            break


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_close(tiny, dtype):
    name, hf, path = tiny
    llm = LLM(str(path), dtype=dtype, block_size=16, kv_cache_space=0.05)
    ids = list(range(100, 140))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = llm.engine.runner.logits_for(ids)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.05, f"{name} {dtype}: relative logit error {err:.4f}"
