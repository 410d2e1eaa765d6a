"""LoRA adapters served (--enable-lora --lora-modules): a request names the adapter as its
model and gets transformers' greedy tokens with the adapter merged, the base model's requests
beside it are untouched, /v1/models lists the adapter under the base model, and an adapter
that cannot load stops the server with the reason. Runtime updates (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter) where VLLM_ALLOW_RUNTIME_LORA_UPDATING says so."""
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
    s = Server("--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8",
               env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield s
    s.stop()


def complete(server, model, prompt=PROMPT):
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
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


def greedy(model, tokenizer, prompt):
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()


def test_adapters_load_and_unload_at_run_time(lora_server, hf_model, tokenizer, tmp_path):
    url, long = lora_server.url, PROMPT * 8  # several full blocks: a stale prefix-cache hit would show
    first, second = (make_adapter(tmp_path / f"rt{i}", hf_model.config, seed=10 + i) for i in (1, 2))
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(first)}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt' added successfully."
    assert "rt" in [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]]
    assert complete(lora_server, "rt", long) == ("rt", greedy(merged(hf_model, first), tokenizer, long))
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(second)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt' removed successfully."
    assert httpx.post(url + "/v1/completions", json={"model": "rt", "prompt": "x"}).status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "rt"}).status_code == 404
    # the name again, other weights: its first load's cached blocks are not this load's
    httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(second)}, timeout=60)
    assert complete(lora_server, "rt", long) == ("rt", greedy(merged(hf_model, second), tokenizer, long))


def test_runtime_updates_are_served_only_where_allowed(server):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404


def test_the_metrics_name_the_adapters_running(lora_server):
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", lora_server.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the request is running
        page = httpx.get(lora_server.url + "/metrics").text
    info = [x for x in page.splitlines() if x.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'running_lora_adapters="sql"' in info[0] and 'max_lora="8"' in info[0], info

