"""Classification models (cross-encoders) against transformers: tiny random BERT and
(XLM-)RoBERTa checkpoints, token types and RoBERTa's positions included, and the packaged
all-MiniLM-L6-v2's real encoder under a seeded classifier head (no real cross-encoder can be
fetched here), offline through LLM.classify and LLM.score."""
import pytest
import torch
import transformers

from cpuserve.entrypoints.scoring import ClassifierHead, activate
from cpuserve.loading.model_loader import PACKAGED_EMBEDDER, load_config, load_state_dict
from cpuserve.loading.tokenizer import load_tokenizer
from cpuserve.model_executor.models import model_class
from cpuserve.model_executor.models.common import Weights
from tests.engine.cross_encoders import minilm_classifier, tiny

PAIRS = [("What is the capital of France?", "Paris is the capital and largest city of France."),
         ("What is the capital of France?", "The cat sat on the mat."),
         ("how do plants make food", "Photosynthesis turns light, water and CO2 into sugar in the leaves."),
         ("x", "y")]


def ours(path):
    cfg = load_config(path)
    return model_class(cfg)(cfg, Weights(load_state_dict(path)), torch.float32)


@pytest.mark.parametrize("arch, config", [
    ("BertForSequenceClassification", {"num_labels": 3}),
    ("RobertaForSequenceClassification", {"num_labels": 2, "pad_token_id": 1}),
    ("XLMRobertaForSequenceClassification", {"num_labels": 1, "pad_token_id": 1}),
    ("XLMRobertaModel", {"pad_token_id": 1}),
])
def test_tiny_random_checkpoints_match_transformers(tmp_path, arch, config):
    path = tiny(tmp_path / arch, arch, **config)
    model, ref = ours(path), getattr(transformers, arch).from_pretrained(str(path)).eval()
    # a pair (segments 0 and 1), a single text, and a pad id inside a sequence (RoBERTa's position rule)
    batch = [[101, 2000, 3000, 102, 4000, 5000, 102], [101, 7, 8, 9, 102], [101, 1, 2345, 1, 102]]
    types = [[0, 0, 0, 0, 1, 1, 1], None, None]
    packed = model.classify(batch, types) if hasattr(model, "classify") else None
    for i, (ids, t) in enumerate(zip(batch, types)):
        segs = {"token_type_ids": torch.tensor([t])} if t and arch.startswith("Bert") else {}
        with torch.no_grad():
            out = ref(input_ids=torch.tensor([ids]), **segs)
        if packed is None:
            assert torch.allclose(model.encode([ids], [t]), out.last_hidden_state[0], atol=1e-5)
        else:
            assert torch.allclose(packed[i], out.logits[0], atol=1e-5)  # packing leaks nothing
    if arch.startswith("Bert"):  # the second segment is read as such: other logits than all-zero types
        assert not torch.allclose(model.classify(batch[:1], types[:1]), model.classify(batch[:1], [None]))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return minilm_classifier(tmp_path_factory.mktemp("ce") / "minilm-ce")


def reference_logits(path, pairs):
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return [model(**tok(a, b, return_tensors="pt")).logits[0] for a, b in pairs]


def test_the_pair_template_gives_transformers_ids_and_token_types(cross_encoder):
    tok, ref = load_tokenizer(cross_encoder), transformers.AutoTokenizer.from_pretrained(str(cross_encoder))
    for a, b in PAIRS:
        enc = ref(a, b)
        assert tok.encode_pair(a, b) == (enc["input_ids"], enc["token_type_ids"])


def test_offline_score_and_classify_match_transformers(cross_encoder, tmp_path):
    from cpuserve import LLM
    llm = LLM(str(cross_encoder))
    assert llm.engine.task == "classify"
    want = [torch.sigmoid(x)[0].item() for x in reference_logits(cross_encoder, PAIRS)]
    got = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 0.1  # the head separates the pairs: the check can fail
    assert got[0].prompt_token_ids == load_tokenizer(cross_encoder).encode_pair(*PAIRS[0])[0]
    one = llm.score(PAIRS[0][0], [b for _, b in PAIRS[:2]])  # one query against documents
    assert [o.outputs.score for o in one] == pytest.approx(want[:2], abs=1e-5)
    [c] = llm.classify(PAIRS[0][1])  # a single-label classifier's probability is its sigmoid
    assert c.outputs.num_classes == 1 and 0 < c.outputs.probs[0] < 1
    with pytest.raises(ValueError, match="classification model .*LLM.classify or LLM.score"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match="is not an embedding model"):
        llm.embed("Hello")


def test_a_multi_label_classifier_classifies_and_refuses_to_score(tmp_path):
    from cpuserve import LLM
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    path = minilm_classifier(tmp_path / "three", num_labels=3, seed=1, id2label=labels,
                             label2id={v: k for k, v in labels.items()})
    texts = ["I love this!", "It is a table.", "Terrible, awful service."]
    llm = LLM(str(path))
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for text, out in zip(texts, llm.classify(texts)):
        with torch.no_grad():
            want = torch.softmax(ref(**tok(text, return_tensors="pt")).logits[0], 0)
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)
        assert out.prompt_token_ids == tok(text)["input_ids"]
    head = ClassifierHead.from_dir(path)
    assert head.labels == ("negative", "neutral", "positive") and head.activation == "softmax"
    steps = llm.engine.core.stats.steps
    with pytest.raises(ValueError, match="one output; this classifier has 3 labels"):
        llm.score("a", "b")
    assert llm.engine.core.stats.steps == steps  # refused before any pair ran


def test_an_embedding_model_is_not_a_classifier():
    from cpuserve import LLM
    with pytest.raises(ValueError, match="is not a classification model"):
        LLM(PACKAGED_EMBEDDER).classify("Hello")


@pytest.mark.parametrize("config, activation, score", [
    ({"id2label": {"0": "LABEL_0"}}, "sigmoid", "sigmoid"),
    ({}, "sigmoid", "sigmoid"),
    ({"id2label": {"0": "a", "1": "b"}}, "softmax", "softmax"),
    ({"id2label": {"0": "a", "1": "b"}, "problem_type": "multi_label_classification"}, "sigmoid", "sigmoid"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "sigmoid", "identity"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, "sigmoid", "tanh"),
])
def test_the_head_reads_vllms_activation_rules(config, activation, score):
    head = ClassifierHead.from_config(config)
    assert (head.activation, head.score_activation) == (activation, score)


def test_activations():
    assert activate([0.0], "sigmoid") == [0.5]
    assert activate([-1000.0, 1000.0], "sigmoid") == pytest.approx([0.0, 1.0])  # no overflow
    assert activate([1.0, 1.0, 1000.0], "softmax") == pytest.approx([0.0, 0.0, 1.0])
    assert activate([2.0], "identity") == [2.0]
    assert ClassifierHead(("a", "b", "c"), "softmax", "softmax").label([0.1, 3.0, -1.0]) == "b"
