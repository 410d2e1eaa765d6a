"""A causal LM as an embedding model (`runner="pooling"`, vLLM's last-token pooling) on the
default model, against transformers' final hidden state of the same GGUF: packed batches
give what each sequence gives alone, steps are bounded by the scratch cache, and an encoder
cannot be asked to generate. And a causal LM's classifier (LlamaForSequenceClassification:
the default model's real layers under a seeded `score` head) against transformers' logits."""
import shutil

import pytest
import torch

from cpuserve.loading.model_loader import PACKAGED_EMBEDDER

from ..conftest import PROMPTS


@pytest.fixture(scope="module")
def embedder():
    from cpuserve import LLM
    return LLM(runner="pooling", dtype="float32", max_num_batched_tokens=64)


def reference(hf_model, ids):
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=0)


def test_last_token_pooling_matches_transformers(embedder, hf_model, tokenizer):
    outs = embedder.embed(PROMPTS)
    for prompt, o in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        v = torch.tensor(o.embedding)
        assert o.num_tokens == len(ids) and len(v) == hf_model.config.hidden_size
        assert float(torch.dot(reference(hf_model, ids), v)) > 0.9999
        assert torch.allclose(torch.tensor(embedder.embed([ids])[0].embedding), v, atol=1e-5)  # alone


def test_steps_are_bounded_by_the_budget_and_the_scratch_cache(embedder):
    core = embedder.engine.core
    steps = core.stats.steps
    embedder.embed(["word " * 40] * 6)  # 6 x 41 tokens over a 64-token budget: one per step
    assert core.stats.steps - steps == 6
    runner = core.runner
    assert runner.fits([runner.max_model_len]) and not runner.fits([runner.max_model_len, 1])
    with pytest.raises(ValueError, match="at most"):
        embedder.embed([[1] * (runner.max_model_len + 1)])


def test_bfloat16_stays_close(hf_model, tokenizer):
    from cpuserve import LLM
    llm = LLM(runner="pooling", dtype="bfloat16", max_model_len=256)
    ids = tokenizer.encode(PROMPTS[0])
    assert float(torch.dot(reference(hf_model, ids), torch.tensor(llm.embed([ids])[0].embedding))) > 0.99


def test_an_encoder_cannot_generate():
    from cpuserve import LLM
    with pytest.raises(ValueError, match=r"an embedding model \(an encoder\) or a classifier.*runner='generate'"):
        LLM(PACKAGED_EMBEDDER, runner="generate")
    with pytest.raises(ValueError, match="runner must be"):
        LLM(runner="embed")


@pytest.fixture(scope="module")
def smollm2_classifier(hf_model, model_path, tmp_path_factory):
    """SmolLM2's layers as LlamaForSequenceClassification with two labels (a seeded head)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from cpuserve.loading.model_loader import resolve
    fields = {k: v for k, v in hf_model.config.to_dict().items() if k != "quantization_config"}  # (the GGUF's)
    cfg = LlamaConfig(**{**fields, "architectures": ["LlamaForSequenceClassification"],
                         "id2label": {0: "no", 1: "yes"}, "label2id": {"no": 0, "yes": 1}})
    clf = LlamaForSequenceClassification(cfg).eval()
    clf.model.load_state_dict(hf_model.model.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        clf.score.weight.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("clf") / "smollm2-clf"
    clf.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve(str(model_path)) / name, out / name)
    return out, clf


def test_a_causal_lm_classifier_reads_its_last_token(smollm2_classifier, tokenizer):
    from cpuserve import LLM
    path, ref = smollm2_classifier
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=256)  # a pooling engine by its architecture
    assert llm.engine.task == "classify"
    outs = llm.classify(PROMPTS)
    for prompt, o in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            want = torch.softmax(ref(torch.tensor([ids])).logits[0], 0)
        assert o.prompt_token_ids == ids
        assert torch.allclose(torch.tensor(o.outputs.probs), want, atol=2e-4), (prompt, o.outputs.probs, want)
    assert len({round(o.outputs.probs[0], 3) for o in outs}) > 1  # the head tells the prompts apart
    with pytest.raises(ValueError, match="or a classifier: it cannot run with runner='generate'"):
        LLM(str(path), runner="generate")


RERANKER = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "method": "from_2_way_softmax"}


@pytest.mark.parametrize("overrides", [RERANKER, {**RERANKER, "classifier_from_token": ["no", "yes", "maybe"],
                                                   "method": None}])
def test_a_causal_lm_becomes_a_classifier_from_its_own_head_tokens(overrides, hf_model, tokenizer):
    """vLLM's --hf-overrides for Qwen3 rerankers on the packaged GGUF: the LM head's rows of the
    tokens are the classifier; two-way, a pair's score is softmax(no, yes)'s "yes"."""
    from cpuserve import LLM
    llm = LLM(dtype="float32", hf_overrides=overrides, max_model_len=512)
    assert llm.engine.task == "classify"
    rows = [tokenizer._tok.token_to_id(t) for t in overrides["classifier_from_token"]]
    assert None not in rows  # the tokens are whole vocabulary entries
    outs = llm.classify(PROMPTS[:4])
    for prompt, o in zip(PROMPTS, outs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokenizer.encode(prompt)])).logits[0, -1, rows]
        want = torch.softmax(logits, 0)
        if len(rows) == 2:
            assert o.outputs.probs == pytest.approx([want[1].item()], abs=2e-4)
        else:
            assert o.outputs.probs == pytest.approx(want.tolist(), abs=2e-4)
    if len(rows) == 2:
        [s] = llm.score("Is Paris in France?", "Paris is the capital of France.")
        assert 0 < s.outputs.score < 1


def test_hf_overrides_reach_the_config_and_name_their_mistakes():
    from cpuserve import LLM
    llm = LLM(dtype="float32", hf_overrides={"max_position_embeddings": 96}, kv_cache_space=0.5)
    assert llm.engine.max_model_len == 96
    with pytest.raises(ValueError, match=r"classifier_from_token: \['no-such-token'\] not in the tokenizer"):
        LLM(hf_overrides={**RERANKER, "classifier_from_token": ["no", "no-such-token"]})
    with pytest.raises(ValueError, match="no score.weight"):
        LLM(hf_overrides={"architectures": ["LlamaForSequenceClassification"]})

