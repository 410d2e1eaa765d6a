"""vLLM's server-wide usage, logprob and logging options on the real model:
--enable-prompt-tokens-details (usage names the prompt tokens the prefix cache held),
--enable-force-include-usage (every stream ends with its usage), --return-tokens-as-token-ids (a
request's own field still wins), --enable-log-requests / --enable-log-outputs / --max-log-len, and
several --served-model-name names, --max-logprobs."""
import json

import httpx
import pytest

from tests.engine.entrypoints.openai.conftest import Server

PROMPT = "Here is a list of the planets of the solar system in order from the sun, with one fact about each: "


@pytest.fixture(scope="module")
def s():
    server = Server("--enable-prompt-tokens-details", "--enable-force-include-usage", "--return-tokens-as-token-ids",
                    "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "12",
                    "--served-model-name", "smollm2", "small-chat", "--max-logprobs", "30")
    yield server
    server.stop()


def post(s, path, **body):
    r = httpx.post(s.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_usage_names_the_cached_prompt_tokens(s):
    first = post(s, "/v1/completions", prompt=PROMPT, max_tokens=2).json()["usage"]
    again = post(s, "/v1/completions", prompt=PROMPT, max_tokens=2).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] > 16
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 16 <= again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]  # whole 16-token blocks
    chat = post(s, "/v1/chat/completions", messages=[{"role": "user", "content": PROMPT}], max_tokens=2).json()
    assert "cached_tokens" in chat["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_every_stream_ends_with_its_usage(s, path, body):
    r = post(s, path, **body, max_tokens=3, ignore_eos=True, stream=True)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]


def test_logprobs_name_tokens_by_id_unless_the_request_says_otherwise(s):
    ids = post(s, "/v1/completions", prompt="Hi", max_tokens=2, logprobs=1).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in ids["tokens"])
    text = post(s, "/v1/completions", prompt="Hi", max_tokens=2, logprobs=1,
                return_tokens_as_token_ids=False).json()["choices"][0]["logprobs"]
    assert not any(t.startswith("token_id:") for t in text["tokens"])
    chat = post(s, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert all(t["token"].startswith("token_id:") for t in chat)


def test_requests_and_answers_are_logged_cut_to_the_max_log_len(s):
    r = post(s, "/v1/completions", prompt="The quick brown fox jumps over the lazy dog", max_tokens=3,
             ignore_eos=True, temperature=0).json()
    rid = r["id"].removeprefix("cmpl-")
    log = s.output()
    assert f"Received request {rid}-0: prompt: 'The quick br', params: SamplingParams(" in log
    assert "temperature=0" in log and "prompt_token_ids: [" in log
    answer = r["choices"][0]["text"]
    assert f"Generated response {rid}-0 (choice 0): output: {answer[:12]!r}" in log and "finish_reason: length" in log
    post(s, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert "prompt: '<|im_start|>" in s.output()  # chat: the rendered conversation


def test_every_served_name_is_served_and_answers_name_the_first(s):
    assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["smollm2", "small-chat"]
    r = post(s, "/v1/completions", model="small-chat", prompt="Hi", max_tokens=1).json()
    assert r["model"] == "smollm2"
    assert httpx.get(s.url + "/v1/models/small-chat").json()["id"] == "small-chat"
    other = httpx.post(s.url + "/v1/completions", json={"model": "big", "prompt": "Hi"})
    assert other.status_code == 404 and "(served: `smollm2`, `small-chat`)" in other.json()["error"]["message"]


def test_max_logprobs_bounds_what_a_request_may_ask(s, server):
    r = post(s, "/v1/completions", prompt="Hello there, friend", max_tokens=2, logprobs=25,
             prompt_logprobs=30).json()["choices"][0]
    assert [len(top) for top in r["logprobs"]["top_logprobs"]] == [25, 25]  # named by id: no two alike
    assert max(len(e) for e in r["prompt_logprobs"] if e) >= 30
    chat = post(s, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, logprobs=True,
                top_logprobs=30).json()["choices"][0]["logprobs"]["content"]
    assert len(chat[0]["top_logprobs"]) == 30
    for body, field in (({"logprobs": 31}, "logprobs"), ({"prompt_logprobs": 31}, "prompt_logprobs")):
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 21})
    assert r.status_code == 400 and "logprobs of 21 is more than the 20" in r.json()["error"]["message"]


def test_without_the_options_usage_is_openais_plain_one(client):
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1)
    assert r.usage.prompt_tokens_details is None
    chunks = list(client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, stream=True))
    assert all(c.usage is None for c in chunks)
