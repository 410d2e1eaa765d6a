"""Sampling parameters end to end on the real model, and the sampler's arithmetic."""
import math

import pytest
import torch

from cpuserve import SamplingParams
from cpuserve.worker.sampler import Sampler
from cpuserve.core.sequence import Sequence

CHAT = [{"role": "user", "content": "Tell me a short story about a robot."}]


def _text(llm, params, msgs=CHAT):
    return llm.chat(msgs, params)[0].outputs


def test_seed_is_reproducible_and_n_gives_distinct_samples(llm_f32):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234, n=3)
    a, b = _text(llm_f32, p), _text(llm_f32, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) == 3
    c = _text(llm_f32, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=99, n=3))
    assert [o.token_ids for o in c] != [o.token_ids for o in a]


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_equal_greedy(llm_f32, kwargs):
    greedy = _text(llm_f32, SamplingParams(temperature=0, max_tokens=16))[0].token_ids
    assert _text(llm_f32, SamplingParams(temperature=0.8, seed=3, max_tokens=16, **kwargs))[0].token_ids == greedy


def test_stop_string_cuts_text(llm_f32):
    full = _text(llm_f32, SamplingParams(temperature=0, max_tokens=40))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    out = _text(llm_f32, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "zzzz-never"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.text.startswith(out.text)
    inc = _text(llm_f32, SamplingParams(temperature=0, max_tokens=40, stop=stop, include_stop_str_in_output=True))[0]
    assert inc.text.endswith(stop)


def test_stop_token_ids_and_lengths(llm_f32):
    full = _text(llm_f32, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop_id = full.token_ids[5]
    out = _text(llm_f32, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_min_tokens_ignore_eos(llm_f32):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = _text(llm_f32, SamplingParams(temperature=0, max_tokens=64), msgs)[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    assert short.token_ids[-1] in llm_f32.engine.eos_token_ids
    longer = _text(llm_f32, SamplingParams(temperature=0, max_tokens=64, min_tokens=40), msgs)[0]
    assert len(longer.token_ids) >= 40
    assert all(t not in llm_f32.engine.eos_token_ids for t in longer.token_ids[:40])
    forced = _text(llm_f32, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), msgs)[0]
    assert len(forced.token_ids) == 50 and forced.finish_reason == "length"


def test_logprobs_are_the_model_distribution(llm_f32, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = llm_f32.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, logprobs=5))[0]
    comp = out.outputs[0]
    logits = llm_f32.engine.runner.logits_for(prompt + comp.token_ids)
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        want = torch.log_softmax(logits[len(prompt) - 1 + i], -1)
        assert len(entry) == 5 and tok in entry
        top = torch.topk(want, 5)
        assert set(entry) == set(top.indices.tolist())
        assert math.isclose(entry[tok], float(want[tok]), abs_tol=1e-4)


def test_prompt_logprobs_are_the_model_distribution_over_prompt_chunks():
    """Each prompt token's logprob given the tokens before it (vLLM's prompt_logprobs), computed in
    32-token prompt chunks, for n = 2 completions; the prompt is computed whole again the second time
    (no prefix cache hit), and the completions are the same as without the logprobs."""
    from cpuserve import LLM
    llm = LLM(dtype="float32", block_size=16, kv_cache_space=0.25, max_num_batched_tokens=32)
    prompt = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 7)
    want = torch.log_softmax(llm.engine.runner.logits_for(prompt), -1)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3))[0]
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, n=2,
                                                                       prompt_logprobs=3))[0]
        assert out.num_cached_tokens == 0 and len(prompt) > 64
        assert [c.token_ids for c in out.outputs] == [plain.outputs[0].token_ids] * 2
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            top = torch.topk(want[i - 1], 3).indices.tolist()
            assert set(lps[i]) == set(top) | {prompt[i]}
            for tok, lp in lps[i].items():
                assert math.isclose(lp, float(want[i - 1, tok]), abs_tol=1e-5)
            own = want[i - 1, prompt[i]]  # its rank, up to logprobs within the two paths' rounding
            lo, hi = int((want[i - 1] > own + 1e-5).sum()) + 1, int((want[i - 1] > own - 1e-5).sum()) + 1
            assert lo <= out.prompt_logprob_ranks[i] <= hi
        assert out.prompt_logprob_ranks[0] is None and len(out.prompt_logprob_ranks) == len(prompt)


def test_prompt_logprobs_recorded_once_per_position():
    """A preempted sequence computes its prompt again: positions it recorded are not added twice."""
    from cpuserve.worker.input_batch import PromptRows
    from cpuserve.worker.sampler import record_prompt_logprobs
    s = _seq(SamplingParams(prompt_logprobs=0), prompt=(2, 0, 1))
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    record_prompt_logprobs(logits, [PromptRows(s, 0, 0, 2)])
    record_prompt_logprobs(logits, [PromptRows(s, 0, 0, 2)])
    lsm = torch.log_softmax(logits, -1)
    assert s.prompt_logprobs == [None, {0: float(lsm[0, 0])}, {1: float(lsm[1, 1])}]
    assert s.prompt_ranks == [None, 3, 2]  # 1 + the tokens strictly more likely (a tie shares the rank)


def test_allowed_token_ids_are_all_that_is_sampled(llm_f32):
    allowed = [11, 28, 30, 216, 314]
    for params in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)):
        out = _text(llm_f32, params)[0]
        assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm_f32.generate("x", SamplingParams(max_tokens=2, allowed_token_ids=[10 ** 9]))
    with pytest.raises(ValueError, match="logit_bias names token ids outside the vocabulary .*: -1, 1000000000"):
        llm_f32.generate("x", SamplingParams(max_tokens=2, logit_bias={10 ** 9: 1.0, -1: 2.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_penalties_and_logit_bias_change_the_output(llm_f32):
    base = _text(llm_f32, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    for kw in (dict(repetition_penalty=1.5), dict(presence_penalty=1.5), dict(frequency_penalty=1.5)):
        assert _text(llm_f32, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw))[0].token_ids != base
    banned = base[0]
    biased = _text(llm_f32, SamplingParams(temperature=0, max_tokens=5, logit_bias={banned: -100}))[0].token_ids
    assert biased[0] != banned


# -- the sampler's arithmetic on synthetic logits -----------------------------------

def _seq(params, prompt=(1, 2), outputs=()):
    s = Sequence(list(prompt), params)
    s.token_ids.extend(outputs)
    return s


def test_penalty_arithmetic():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seq = _seq(SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
               prompt=(0,), outputs=(1, 3, 3))
    Sampler(set())._process(row := logits[0].clone(), seq)
    # token 0: prompt only -> 2.0 / 2; token 1: -2 * 2 - 0.5 - 0.25; token 3: 0.5 / 2 - 0.5 - 0.5
    assert torch.allclose(row, torch.tensor([1.0, -4.75, 1.0, -0.75]))


def test_min_tokens_masks_eos_and_stop_ids():
    seq = _seq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]))
    toks, _ = Sampler({0})(torch.tensor([[5.0, 1.0, 4.0, 0.0]]), [seq])
    assert toks == [1]


def test_top_p_keeps_smallest_set_reaching_mass():
    torch.manual_seed(0)
    seq = _seq(SamplingParams(temperature=1.0, top_p=0.6, seed=1))
    seq.generator = torch.Generator().manual_seed(1)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {Sampler(set())(logits, [seq])[0][0] for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=6.8e-240), dict(temperature=1e-30),
                                    dict(repetition_penalty=1e-300, temperature=2.0, top_p=0.5, min_p=0.9)])
def test_extreme_valid_values_never_break_sampling(kwargs):
    """Found by the API fuzzer: a tiny penalty overflowed a logit to inf, the
    distribution became NaN and the engine core died."""
    logits = torch.tensor([[30.0, 29.0, -5.0, 1.0]])
    seq = _seq(SamplingParams(seed=1, **kwargs), prompt=(0, 1), outputs=(1,))
    seq.generator = torch.Generator().manual_seed(1)
    toks, _ = Sampler(set())(logits, [seq])
    assert 0 <= toks[0] < 4


def test_plain_greedy_rows_take_one_argmax_and_every_other_row_the_general_path():
    """Greedy rows with nothing to process, constrain or report take the argmax of the raw logits
    in one kernel call; a row with logprobs, a penalty or a sample, or logits not float32 rows,
    sends the batch down the general path, with the same greedy tokens."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    plain = [_seq(SamplingParams(temperature=0)) for _ in range(3)]
    sampler = Sampler(set())
    assert sampler._plain_argmax(logits, plain)
    assert sampler(logits, plain) == (logits.argmax(-1).tolist(), [None, None, None])
    for other in (SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, repetition_penalty=1.5),
                  SamplingParams(temperature=1.0, seed=1)):
        seqs = plain[:1] + [_seq(other)] + plain[2:]
        assert not sampler._plain_argmax(logits, seqs)
        toks, lps = sampler(logits, seqs)
        assert toks[0] == int(logits[0].argmax()) and toks[2] == int(logits[2].argmax())
        assert lps[1] is not None if other.logprobs else lps[1] is None
    wide = torch.randn(3, 100)[:, ::2]  # rows strided inside: the general path makes them contiguous
    assert not sampler._plain_argmax(wide, plain)
    assert sampler(wide, plain)[0] == wide.argmax(-1).tolist()
    half = logits.bfloat16()
    assert not sampler._plain_argmax(half, plain) and sampler(half, plain)[0] == half.float().argmax(-1).tolist()
