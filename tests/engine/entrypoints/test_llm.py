"""The offline API's vLLM-shaped extras on the real model: LLM.generate's and LLM.chat's
use_tqdm, LLM.chat's tools, CompletionOutput.cumulative_logprob, the generation config's defaults."""
import math

from cpuserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_use_tqdm_shows_a_bar_of_finished_requests_and_changes_nothing_else(llm_f32, capsys):
    quiet = llm_f32.generate(["Hello", "Goodbye"], GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err
    shown = llm_f32.generate(["Hello", "Goodbye"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]
    chat = llm_f32.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=True)
    assert chat[0].outputs[0].token_ids and "1/1" in capsys.readouterr().err


def test_chat_passes_tools_to_the_template(llm_f32):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    convo = [{"role": "user", "content": "Weather?"}]
    tok = llm_f32.get_tokenizer()
    with_tools = llm_f32.chat(convo, GREEDY, chat_template=template, add_generation_prompt=False, tools=tools)[0]
    without = llm_f32.chat(convo, GREEDY, chat_template=template, add_generation_prompt=False)[0]
    assert tok.decode(with_tools.prompt_token_ids) == "[get_weather]Weather?"
    assert tok.decode(without.prompt_token_ids) == "Weather?"


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens_logprobs(llm_f32):
    for params in (SamplingParams(temperature=0, max_tokens=5, logprobs=0),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=2)):
        c = llm_f32.generate("The capital of France is", params)[0].outputs[0]
        want = sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs))
        assert math.isclose(c.cumulative_logprob, want) and c.cumulative_logprob < 0
    assert llm_f32.generate("Hi", GREEDY)[0].outputs[0].cumulative_logprob is None


def test_logprobs_are_vllms_logprob_objects_and_still_floats(llm_f32):
    tok = llm_f32.get_tokenizer()
    out = llm_f32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                                      prompt_logprobs=2))[0]
    c = out.outputs[0]
    for t, entry in zip(c.token_ids, c.logprobs):
        assert entry[t].logprob == entry[t] == max(entry.values()) and entry[t].rank == 1  # greedy: the top token
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert all(lp.decoded_token == tok.decode([tid]) for tid, lp in entry.items())
    for t, entry, rank in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:]):
        assert entry[t].rank == rank  # a prompt token's own rank, top N or not
    drawn = llm_f32.generate("Once upon a time", SamplingParams(temperature=1.5, seed=11, max_tokens=40, logprobs=1))
    entries = [(t, e) for t, e in zip(drawn[0].outputs[0].token_ids, drawn[0].outputs[0].logprobs)]
    outside = [e[t] for t, e in entries if len(e) == 2]  # drawn outside the top 1: its rank is not shown
    assert outside and all(lp.rank is None for lp in outside)
    assert all(e[t].rank == 1 for t, e in entries if len(e) == 1)


def test_the_generation_config_gives_the_default_sampling_params(tmp_path):
    from cpuserve import LLM
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 4}')
    llm = LLM(dtype="float32", block_size=16, kv_cache_space=0.25, generation_config=str(tmp_path),
              override_generation_config={"repetition_penalty": 1.1})
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.max_tokens, p.repetition_penalty, p.top_p) == (0.0, 4, 1.1, 1.0)
    out = llm.generate(["Once upon a time", "Once upon a time"])
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids  # greedy, from the config
    own = llm.generate("Hi", SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(own.token_ids) == 6  # a call's own parameters are used as given


def test_logprobs_beyond_max_logprobs_are_refused(llm_f32):
    import pytest
    with pytest.raises(ValueError, match=r"logprobs of 21 is more than the 20 this engine returns \(--max-logprobs\)"):
        llm_f32.generate("Hi", SamplingParams(max_tokens=1, logprobs=21))
    assert len(llm_f32.generate("Hi", SamplingParams(max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0]) >= 20
