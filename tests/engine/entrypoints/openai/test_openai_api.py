"""The running server through the official openai client: completions and chat,
streaming and not, n > 1, logprobs, stop sequences; and its utility endpoints."""
import httpx
import openai
import pytest

from cpuserve import SamplingParams

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three fruits."}]


def test_completion_matches_offline_engine(client, llm_f32):
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0)
    want = llm_f32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(llm_f32.get_tokenizer().encode(PROMPT))


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): the counts never fall and
    end at the final chunk's; without include_usage it asks for nothing."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": CHAT, "n": 2})):
        chunks = list(create(model="smollm2", max_tokens=12, temperature=0, stream=True, stream_options=opts,
                             extra_body={"ignore_eos": True}, **kw))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 12 * kw.get("n", 1) and not chunks[-1].choices
        plain = list(create(model="smollm2", max_tokens=4, temperature=0, stream=True,
                            stream_options={"continuous_usage_stats": True}, **kw))
        assert all(c.usage is None for c in plain)


def test_chat_stream_and_not(client, llm_f32):
    full = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=30, temperature=0)
    want = llm_f32.chat(CHAT, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert full.choices[0].message.content == want.text and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=30, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_chat_echo_puts_the_continued_message_before_the_answer(client):
    """vLLM's chat echo: the last message's text first where it has the answer's role (an assistant
    turn continued); after a user turn and a generation prompt, nothing."""
    convo = CHAT + [{"role": "assistant", "content": "Apples,"}]
    kw = dict(model="smollm2", messages=convo, max_tokens=8, temperature=0,
              extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    kw["extra_body"] = {**kw["extra_body"], "echo": True}
    echoed = client.chat.completions.create(**kw).choices[0].message.content
    assert echoed == "Apples," + plain
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    asked = dict(model="smollm2", messages=CHAT, max_tokens=6, temperature=0)
    assert client.chat.completions.create(**asked, extra_body={"echo": True}).choices[0].message.content == \
        client.chat.completions.create(**asked).choices[0].message.content


def test_n_and_seed(client):
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, n=2, temperature=1, seed=1)
    assert len(chat.choices) == 2


def test_multiple_prompts(client):
    r = client.completions.create(model="smollm2", prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]


def test_logprobs(client):
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(5))  # greedy = top-1
    c = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


def test_return_tokens_as_token_ids_names_each_token_by_its_id(client, llm_f32):
    """vLLM's return_tokens_as_token_ids: "token_id:{id}" wherever logprobs name a token (its text
    may be part of a character, or shared by several tokens); the text and its offsets unchanged."""
    kw = dict(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    by_id = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    tok = llm_f32.get_tokenizer()
    ids = [int(t.removeprefix("token_id:")) for t in by_id.logprobs.tokens]
    assert by_id.text == plain.text and [tok.decode([i]) for i in ids] == plain.logprobs.tokens
    assert by_id.logprobs.text_offset == plain.logprobs.text_offset
    assert all(k.startswith("token_id:") for top in by_id.logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    first = chat.choices[0].logprobs.content[0]
    assert first.token.startswith("token_id:") and bytes(first.bytes).decode() == first.token
    assert all(t.token.startswith("token_id:") for t in first.top_logprobs)


def test_echo_with_prompt_logprobs(server, client, llm_f32):
    """echo (lm-evaluation-harness's loglikelihood asks for it): the prompt before the choice's text,
    with logprobs its tokens' first (None for the first token), streamed and not; max_tokens 0 gives
    the prompt alone, and without echo it is a 400; token ids outside the vocabulary are a 400."""
    tok = llm_f32.get_tokenizer()
    prompt_ids = tok.encode(PROMPT)
    want = llm_f32.generate({"prompt_token_ids": prompt_ids},
                            SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))[0]
    kw = dict(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    r = client.completions.create(**kw)
    c, n = r.choices[0], len(prompt_ids)
    assert c.text == PROMPT + want.outputs[0].text and r.usage.completion_tokens == 4
    assert len(c.logprobs.tokens) == n + 4 and "".join(c.logprobs.tokens) == c.text
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    for i in range(1, n):
        assert abs(c.logprobs.token_logprobs[i] - want.prompt_logprobs[i][prompt_ids[i]]) < 1e-3  # other blocks
        assert len(c.logprobs.top_logprobs[i]) == 2
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(x.choices[0].text for x in streamed if x.choices) == c.text
    assert sum((x.choices[0].logprobs.token_logprobs for x in streamed if x.choices), []) == c.logprobs.token_logprobs
    alone = client.completions.create(**{**kw, "max_tokens": 0}).choices[0]
    assert alone.text == PROMPT and alone.finish_reason == "length"
    assert alone.logprobs.token_logprobs == c.logprobs.token_logprobs[:n]
    r = httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    for ids in ([-1], [5, 10**9], [[5], [-7]]):  # echo decodes token-id prompts: out of the vocabulary, a 400
        r = httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": ids, "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (ids, r.text)


def test_prompt_logprobs_on_both_endpoints(server, llm_f32):
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the token's own entry first with its rank, then the top k ranked 1..k; on each
    completions choice and on the chat answer; refused with stream, which would carry them nowhere."""
    tok = llm_f32.get_tokenizer()
    ids = tok.encode(PROMPT)
    want = llm_f32.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2,
                                                                      prompt_logprobs=2))[0]
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["prompt_logprobs"] for c in r["choices"]][0] == r["choices"][1]["prompt_logprobs"]
    got = r["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        first, *top = got[i].items()
        assert first[0] == str(ids[i]) and first[1]["rank"] == want.prompt_logprob_ranks[i]
        assert abs(first[1]["logprob"] - want.prompt_logprobs[i][ids[i]]) < 1e-3
        assert first[1]["decoded_token"] == tok.decode([ids[i]])
        ranks = [e["rank"] for t, e in top]
        assert ranks == sorted(ranks) and set(ranks) | {first[1]["rank"]} >= {1, 2}
        assert len(got[i]) == (2 if first[1]["rank"] <= 2 else 3)
    assert "prompt_logprobs" not in httpx.post(server.url + "/v1/completions", json={**body, "prompt_logprobs": None},
                                               timeout=60).json()["choices"][0]
    chat = {"model": "smollm2", "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}
    c = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in c["prompt_logprobs"][1:])
    for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        r = httpx.post(server.url + path, json={**req, "stream": True}, timeout=60)
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_continue_final_message_and_template_kwargs(server, client, llm_f32):
    """The last (assistant) message continued, as offline LLM.chat does it; chat_template_kwargs as
    template variables; their conflicts as 400s naming the field."""
    conv = [{"role": "user", "content": "Write a haiku about the sea."}, {"role": "assistant", "content": "Waves"}]
    kw = dict(add_generation_prompt=False, continue_final_message=True)
    r = client.chat.completions.create(model="smollm2", messages=conv, max_tokens=12, temperature=0, extra_body=kw)
    want = llm_f32.chat(conv, SamplingParams(temperature=0, max_tokens=12), **kw)[0]
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert llm_f32.get_tokenizer().decode(want.prompt_token_ids).endswith("assistant\nWaves")
    t = httpx.post(server.url + "/tokenize", json={"messages": conv, **kw}).json()
    assert t["tokens"] == want.prompt_token_ids
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, extra_body={
        "chat_template": template, "chat_template_kwargs": {"greeting": "Hello there. "}})
    assert r.usage.prompt_tokens == len(llm_f32.get_tokenizer().encode("Hello there. " + CHAT[0]["content"],
                                                                       add_special_tokens=False))
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "smollm2", "messages": conv, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_vllm_extras_allowed_tokens_truncation_and_unknown_fields(server, client, llm_f32):
    tok = llm_f32.get_tokenizer()
    paris = tok.encode(" Paris", add_special_tokens=False)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_body={"allowed_token_ids": paris})
    assert r.choices[0].text == " Paris" * 3
    ids = tok.encode("one two three four five six")
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=2, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text.startswith(tok.decode(ids[-3:]))
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for body, param in (({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
                        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"use_beam_search": True}, None), ({"bad_words": ["x"]}, None)):
        r = httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": PROMPT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 1,
                                                         "not_a_field_here": 1})
    assert r.status_code == 200  # ignored, as OpenAI's shape allows, and named in the server's log
    assert "ignored the request's fields not_a_field_here" in server.output()


def test_stop_sequences(client):
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = full.split()[3]
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_models_tokenize_detokenize_version(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert client.models.retrieve("smollm2").max_model_len == client.models.list().data[0].max_model_len
    with pytest.raises(openai.NotFoundError, match="the model `other/model` does not exist"):
        client.models.retrieve("other/model")
    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and "token_strs" not in t
    strs = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["Hello", "Ġworld"]  # the vocabulary's pieces, as transformers' tokenizer names them
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > t["count"]
    assert httpx.get(server.url + "/version").json()["version"]


def test_topology_says_where_the_engine_runs(server):
    """GET /topology: the engine core's own threads' CPUs and memory node, as the kernel has them."""
    import psutil

    from tests.engine.live_topology import allowed, node_of, numa_calls_allowed

    (rank,) = httpx.get(server.url + "/topology").json()["ranks"]
    core = next(p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline()))
    threads = {t.id for t in core.threads()}
    cpus = set(parse_cpus(rank["cpus"]))
    assert rank["rank"] == 0 and cpus and cpus <= set(allowed()) and threads
    if numa_calls_allowed():
        assert rank["memoryNode"] == node_of(min(cpus)) and rank["membind"] == f"bound to node {rank['memoryNode']}"
    else:
        assert rank["memoryNode"] is None and rank["membind"].startswith("refused")


def test_step_metrics_by_kind(server, client):
    from cpuserve.entrypoints.openai.metrics import step_totals
    before = step_totals(httpx.get(server.url + "/metrics").text)
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
    after = step_totals(httpx.get(server.url + "/metrics").text)
    assert set(after) == {"decode", "mixed", "prefill"}
    delta = {k: {f: after[k][f] - before[k][f] for f in after[k]} for k in after}
    prompt_steps = delta["prefill"]["steps"] + delta["mixed"]["steps"]
    # the prompt's step(s), then one step a token after the first
    assert delta["decode"]["steps"] >= 3 and prompt_steps >= 1
    assert delta["decode"]["tokens"] >= delta["decode"]["steps"] and delta["decode"]["seconds"] > 0


def parse_cpus(text):
    out = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def test_request_id_echoed(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert httpx.get(server.url + "/health").headers["x-request-id"]


def test_metrics_named_as_vllm(server, client):
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket",
                 "vllm:request_success_total", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:request_inference_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:gpu_cache_usage_perc"):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3

    def count(name):
        return float(next(ln for ln in text.splitlines() if ln.startswith(name + "_count")).split()[-1])
    # observed, not only declared: a first token, the two gaps after it, the request's end
    assert count("vllm:time_to_first_token_seconds") >= 1 and count("vllm:inter_token_latency_seconds") >= 2
    assert count("vllm:e2e_request_latency_seconds") >= 1 and count("vllm:request_queue_time_seconds") >= 1
    assert count("vllm:request_decode_time_seconds") == count("vllm:e2e_request_latency_seconds")
    assert count("vllm:time_per_output_token_seconds") == count("vllm:inter_token_latency_seconds")

    def bucket(name, le):
        return float(next(ln for ln in text.splitlines() if ln.startswith(f'{name}_bucket{{le="{le}"')).split()[-1])
    # the 3-token request: in the 5 bucket of generated tokens, not in the 2 one
    assert bucket("vllm:request_generation_tokens", "5.0") - bucket("vllm:request_generation_tokens", "2.0") >= 1
