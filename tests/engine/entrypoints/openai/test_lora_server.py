"""LoRA adapters served (--enable-lora --lora-modules): a request names the adapter as its
model and gets transformers' greedy tokens with the adapter merged, the base model's requests
beside it are untouched, /v1/models lists the adapter under the base model, and an adapter
that cannot load stops the server with the reason."""
import httpx
import pytest
import torch

from tests.engine.lora_adapters import make_adapter, merged

from .conftest import Server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter(hf_model, tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("lora") / "sql", hf_model.config, seed=1)


@pytest.fixture(scope="module")
def lora_server(adapter):
    s = Server("--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8")
    yield s
    s.stop()


def complete(server, model):
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 10,
                                                         "temperature": 0, "return_tokens_as_token_ids": True,
                                                         "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["model"], [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_a_request_names_the_adapter_as_its_model(lora_server, adapter, hf_model, tokenizer):
    cards = httpx.get(lora_server.url + "/v1/models").json()["data"]
    base = cards[0]["id"]
    assert {"id": "sql", "parent": base, "root": str(adapter)}.items() <= cards[-1].items()
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        want = merged(hf_model, adapter).generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    model, tokens = complete(lora_server, "sql")
    assert (model, tokens) == ("sql", want[0, len(ids):].tolist())
    model, plain = complete(lora_server, base)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert (model, plain) == (base, ref[0, len(ids):].tolist()) and plain != tokens
    chat = httpx.post(lora_server.url + "/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=60).json()
    assert chat["model"] == "sql" and chat["choices"][0]["message"]["content"]
    r = httpx.post(lora_server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "`sql`" in r.json()["error"]["message"]


def test_an_adapter_that_cannot_load_stops_the_server(tmp_path, hf_model):
    bad = make_adapter(tmp_path / "bad", hf_model.config, seed=2, rank=32, layers=[0])
    with pytest.raises(RuntimeError, match="rank 32 is above --max-lora-rank 16"):
        Server("--enable-lora", "--lora-modules", f"bad={bad}")
    with pytest.raises(RuntimeError, match="lora_modules need enable_lora"):
        Server("--lora-modules", f"bad={bad}")
