"""A classification model served by `cpuserve serve` (the packaged MiniLM's encoder under a
seeded classifier head, tests/engine/cross_encoders.py): /v1/score and /v1/rerank as a
cross-encoder scores, /classify's probabilities and labels, each against transformers, and
the routes each kind of model refuses."""
import json

import httpx
import pytest
import torch
import transformers

from tests.engine.cross_encoders import minilm_classifier

from .conftest import Server

QUERY = "What is the capital of France?"
DOCS = ["The cat sat on the mat.", "Paris is the capital and largest city of France.",
        "France is a country in Western Europe.", "Bananas are yellow."]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    path = minilm_classifier(tmp_path_factory.mktemp("ce") / "ce")
    s = Server(str(path), "--served-model-name", "ce")
    yield s, path
    s.stop()


def reference(path, *texts):
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return model(**tok(*texts, return_tensors="pt")).logits[0]


def test_score_and_rerank_read_each_pair_together(cross):
    s, path = cross
    want = [torch.sigmoid(reference(path, QUERY, d))[0].item() for d in DOCS]
    r = httpx.post(s.url + "/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert body["usage"]["prompt_tokens"] == sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
    r = httpx.post(s.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=60).json()
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r["results"]] == best
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx([want[i] for i in best], abs=1e-5)
    pairwise = httpx.post(s.url + "/score", json={"text_1": [QUERY, DOCS[0]], "text_2": DOCS[:2]}).json()
    assert pairwise["data"][1]["score"] == pytest.approx(torch.sigmoid(reference(path, DOCS[0], DOCS[1]))[0].item(),
                                                         abs=1e-5)


def test_classify_gives_probabilities_and_labels(tmp_path):
    path = minilm_classifier(tmp_path / "three", num_labels=3, seed=1, id2label=LABELS,
                             label2id={v: k for k, v in LABELS.items()})
    texts = ["I love this!", "Terrible, awful service."]
    s = Server(str(path))
    try:
        r = httpx.post(s.url + "/classify", json={"input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        for text, d in zip(texts, r.json()["data"]):
            want = torch.softmax(reference(path, text), 0)
            assert d["probs"] == pytest.approx(want.tolist(), abs=1e-5) and d["num_classes"] == 3
            assert d["label"] == LABELS[int(want.argmax())]
        one = httpx.post(s.url + "/v1/classify", json={"input": texts[0]}).json()  # one text; SGLang's path
        assert one["data"][0]["probs"] == pytest.approx(r.json()["data"][0]["probs"], abs=1e-6)
        r = httpx.post(s.url + "/v1/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 400 and "3 labels" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/classify", json={"input": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    finally:
        s.stop()


def test_routes_follow_the_model_kind(cross, server):
    s, _ = cross
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(s.url + path, json=body)
        assert r.status_code == 400 and "classification model" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/classify", json={"input": "x"})
    assert r.status_code == 400 and "ForSequenceClassification" in r.json()["error"]["message"]


def test_a_causal_lm_served_as_a_reranker_through_hf_overrides(hf_model, tokenizer):
    """vLLM's recipe for Qwen3 rerankers on the packaged model: --hf-overrides makes the LM head's
    "no" and "yes" rows the classifier; a pair's score is softmax(no, yes)'s "yes" after the
    query and the document read as one sequence."""
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "method": "from_2_way_softmax"}
    s = Server("--hf-overrides", json.dumps(overrides), "--max-model-len", "512")
    try:
        r = httpx.post(s.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        rows = [tokenizer._tok.token_to_id(t) for t in ("no", "yes")]
        for x in r.json()["results"]:
            ids = tokenizer.encode_pair(QUERY, DOCS[x["index"]])[0]
            with torch.no_grad():
                want = torch.softmax(hf_model(torch.tensor([ids])).logits[0, -1, rows], 0)[1].item()
            assert x["relevance_score"] == pytest.approx(want, abs=2e-4)
        c = httpx.post(s.url + "/classify", json={"input": "Is the sky blue?"}).json()["data"][0]
        assert c["label"] == "yes" and c["num_classes"] == 1
    finally:
        s.stop()

