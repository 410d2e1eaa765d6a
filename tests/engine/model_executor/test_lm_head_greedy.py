"""Greedy rows' LM head on its bfloat16 copy, and a step of one row on its Q8_0 copy
(layers/embedding.py LMHead.greedy, kernels/greedy_head.hpp), on the real model in float32 and on
random weights off the Q8_0 grid: the same tokens as the float32 logits' argmax, bit for bit, and
taken only where a step's every row is plain greedy."""
import pytest
import torch

from cpuserve import SamplingParams
from cpuserve.loading.quant_tensor import quantize_q8_0
from cpuserve.model_executor import ops
from cpuserve.model_executor.layers.embedding import LMHead
from cpuserve.model_executor.parallel import TPGroup
from tests.engine.conftest import PROMPTS


@pytest.fixture(scope="module")
def llm_f32():
    """The default model with every weight widened to float32 (the benchmarks' float32 rows; the
    shared llm_f32 keeps its GGUF blocks, whose head is quantized)."""
    from cpuserve import LLM
    return LLM(dtype="float32", quantization="none", block_size=16, kv_cache_space=0.5)


@pytest.fixture()
def head(llm_f32):
    head = llm_f32.engine.runner.model.lm_head
    assert head.greedy_copy is not None, "a float32 head on one rank keeps a bfloat16 copy for greedy rows"
    assert head.greedy_q8 is not None, "and a Q8_0 copy for steps of one row"
    return head


@pytest.fixture()
def calls(head, monkeypatch):
    """How many times the runner asked the head for greedy tokens (rows in total)."""
    seen = []
    original = type(head).greedy

    def counted(self, x):
        seen.append(x.shape[0])
        return original(self, x)
    monkeypatch.setattr(type(head), "greedy", counted)
    return seen


def _generate(llm, params, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt": p} for p in prompts], params)]


def test_same_tokens_as_float32_logits(llm_f32, head, calls):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with_copy = _generate(llm_f32, params)
    assert sum(calls) >= 48 * len(PROMPTS) - len(PROMPTS)  # every decode row went through it
    copy, head.greedy_copy = head.greedy_copy, None
    try:
        without = _generate(llm_f32, params)
    finally:
        head.greedy_copy = copy
    assert with_copy == without


def test_one_row_steps_take_the_q8_0_copy(llm_f32, head, calls, monkeypatch):
    """One prompt decoding alone: every step one row, through the Q8_0 copy, and the same tokens
    as without any copy (every float32 logit computed)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    q8_rows = []
    linear = ops.linear
    monkeypatch.setattr(ops, "linear", lambda x, w, *a, **kw: (
        q8_rows.append(x.shape[0]) if w is head.greedy_q8 else None, linear(x, w, *a, **kw))[1])
    with_copy = _generate(llm_f32, params, PROMPTS[2:3])
    assert calls and set(calls) == {1} and len(q8_rows) == len(calls)
    copies = head.greedy_copy, head.greedy_q8
    head.greedy_copy = head.greedy_q8 = None
    try:
        without = _generate(llm_f32, params, PROMPTS[2:3])
    finally:
        head.greedy_copy, head.greedy_q8 = copies
    assert with_copy == without


def test_decides_every_real_row(llm_f32, head):
    """On the model's own final hidden states (prompts and their continuations, scored in one
    pass each): no row left to the float32 fallback, and each token the float32 argmax."""
    runner = llm_f32.engine.runner
    hidden = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: (hidden.append(h.clone()), original(h))[1]
    try:
        for p in PROMPTS[:4]:
            runner.logits_for(llm_f32.get_tokenizer().encode(p) + list(range(500, 564)))
    finally:
        runner.model.compute_logits = original
    x = torch.cat(hidden)
    tokens, undecided = ops.greedy_head(ops.linear(x, head.greedy_copy), x, head.weight, head.greedy_norms,
                                        head.greedy_norm_max)
    assert undecided == 0 and x.shape[0] > 200
    assert torch.equal(tokens, ops.argmax(head(x)))
    assert torch.equal(head.greedy(x), tokens)
    q8, undecided = ops.greedy_head(ops.linear(x, head.greedy_q8), x, head.weight, head.greedy_q8_errors,
                                    head.greedy_q8_error_max, error_norms=True)
    assert undecided == 0 and torch.equal(q8, tokens)
    assert all(int(head.greedy(x[i:i + 1])) == int(tokens[i]) for i in range(0, x.shape[0], 7))


def test_q8_0_copy_off_its_grid_keeps_the_float32_argmax():
    """A head whose weights are not Q8_0 values (the default model's are: its GGUF stores the head
    as Q8_0), near ties closer than the copy can tell, an exact tie, a zero row: every one-row
    step's token the float32 argmax, the ties' the first index."""
    torch.manual_seed(3)
    w = torch.randn(5000, 96) * 0.1
    w[900] = w[7] * (1 + 1e-6 * (torch.arange(96) % 3))  # 7 ~ 900
    w[301] = w[300]
    head = LMHead(w, torch.float32, TPGroup())
    packed, values = quantize_q8_0(w)
    assert head.greedy_q8 is not None and not torch.equal(values, w)
    assert (values - w).abs().max() <= w.abs().max() / 254 * 1.01
    x = torch.randn(40, 96)
    x[1], x[2], x[3] = w[7], 3 * w[300], 0
    want = ops.argmax(head(x))
    got = torch.cat([head.greedy(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(got, want) and int(got[2]) == 300 and int(got[3]) == 0


def test_other_rows_keep_the_float32_logits(llm_f32, calls):
    """A step with a sampled row, or a greedy row that asks for logprobs or a penalty, computes
    every row's float32 logits; the greedy row's tokens are the same either way."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = _generate(llm_f32, greedy, PROMPTS[:1])[0]
    calls.clear()
    for other in (SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0, logprobs=2, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)):
        outs = llm_f32.generate([{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}], [greedy, other])
        assert outs[0].outputs[0].token_ids == alone
        assert calls == []


def test_bench_counts_what_a_greedy_step_reads(llm_f32, head):
    """`cpuserve bench`'s bytes a token: the Q8_0 copy in place of the float32 head for our greedy
    steps of one row, the float32 head for a step that computes every logit (the peers' bound)."""
    from cpuserve.entrypoints import bench
    greedy_bytes, params = bench.model_size(llm_f32)
    full_bytes, full_params = bench.model_size(llm_f32, greedy=False)
    assert params == full_params
    assert full_bytes - greedy_bytes == head.weight.nbytes - head.greedy_q8.nbytes
    assert head.greedy_q8.nbytes == head.weight.nbytes // 4 * 34 // 32
