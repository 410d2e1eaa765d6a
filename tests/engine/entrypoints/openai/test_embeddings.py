"""POST /v1/embeddings on all-MiniLM-L6-v2 served by `cpuserve serve`: the reference's
vectors through the official client, float and base64, many inputs batched as one, and
the client's mistakes; /v1/score and /v1/rerank as the reference's cosine similarities; a
generative model refuses the routes and vice versa."""
import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from cpuserve.loading.model_loader import PACKAGED_EMBEDDER, resolve

from .conftest import Server

TEXTS = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium.",
         "A man is playing guitar.", "Embeddings batch with each other."]


@pytest.fixture(scope="module")
def embed_server():
    s = Server(PACKAGED_EMBEDDER)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModel, AutoTokenizer
    d = str(resolve(PACKAGED_EMBEDDER))
    hf, tok = AutoModel.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)

    def embed(text):
        with torch.no_grad():
            h = hf(**tok(text, return_tensors="pt")).last_hidden_state[0]
        return torch.nn.functional.normalize(h.mean(0), dim=0)
    return embed


def test_vectors_match_the_reference_float_and_base64(embed_server, reference):
    from openai import OpenAI
    c = OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0)
    r = c.embeddings.create(model=PACKAGED_EMBEDDER, input=TEXTS)
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == PACKAGED_EMBEDDER
    for text, d in zip(TEXTS, r.data):
        assert len(d.embedding) == 384
        assert float(torch.dot(reference(text), torch.tensor(d.embedding))) > 0.9999
    raw = httpx.post(embed_server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    b = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(b) // 4}f", b)) == pytest.approx(r.data[0].embedding, abs=1e-7)
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)


def test_concurrent_requests_batch_and_give_what_each_gives_alone(embed_server):
    def one(text):
        return httpx.post(embed_server.url + "/v1/embeddings", json={"input": text}, timeout=60).json()
    alone = [one(t)["data"][0]["embedding"] for t in TEXTS]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, TEXTS * 8))
    for i, r in enumerate(together):
        assert r["data"][0]["embedding"] == pytest.approx(alone[i % len(TEXTS)], abs=1e-5)
    tokens = httpx.post(embed_server.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = httpx.post(embed_server.url + "/v1/embeddings", json={"input": [tokens]}).json()
    assert by_ids["data"][0]["embedding"] == pytest.approx(alone[0], abs=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "word " * 300}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": [[999999]]}, "input"),
])
def test_mistakes(embed_server, body, param):
    r = httpx.post(embed_server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_score_and_rerank_are_the_embeddings_cosine_similarities(embed_server, reference):
    query = "How is the weather?"
    want = [float(torch.dot(reference(query), reference(t))) for t in TEXTS]
    r = httpx.post(embed_server.url + "/v1/score", json={"text_1": query, "text_2": TEXTS}, timeout=60).json()
    assert [d["index"] for d in r["data"]] == list(range(len(TEXTS))) and r["object"] == "list"
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=2e-4)
    assert r["usage"]["prompt_tokens"] > len(TEXTS)
    pairwise = httpx.post(embed_server.url + "/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:4]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [float(torch.dot(reference(a), reference(b))) for a, b in zip(TEXTS[:2], TEXTS[2:4])], abs=2e-4)
    best = sorted(range(len(TEXTS)), key=lambda i: -want[i])
    rr = httpx.post(embed_server.url + "/v1/rerank", json={"query": query, "documents": TEXTS, "top_n": 3}).json()
    assert [x["index"] for x in rr["results"]] == best[:3]
    assert rr["results"][0] == {"index": best[0], "relevance_score": pytest.approx(want[best[0]], abs=2e-4),
                                "document": {"text": TEXTS[best[0]]}}
    bare = httpx.post(embed_server.url + "/v2/rerank", json={"query": query, "documents": TEXTS,
                                                             "return_documents": False}).json()
    assert [x["index"] for x in bare["results"]] == best and "document" not in bare["results"][0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/rerank", {"query": "x", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "x", "documents": ["word " * 300]}, "documents"),
])
def test_score_and_rerank_mistakes(embed_server, path, body, param):
    r = httpx.post(embed_server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_routes_follow_the_model_task(embed_server, server):
    r = httpx.post(server.url + "/v1/rerank", json={"query": "x", "documents": ["y"]})
    assert r.status_code == 400 and "generative" in r.json()["error"]["message"]
    r = httpx.post(embed_server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400 and "generative" in r.json()["error"]["message"]


def test_a_causal_lm_served_with_runner_pooling_embeds_by_its_last_token(hf_model, tokenizer):
    s = Server("--runner", "pooling", "--max-model-len", "512")
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=60).json()
        for text, d in zip(TEXTS, r["data"]):
            with torch.no_grad():
                h = hf_model.model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1]
            assert float(torch.dot(torch.nn.functional.normalize(h, dim=0), torch.tensor(d["embedding"]))) > 0.9999
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    finally:
        s.stop()
