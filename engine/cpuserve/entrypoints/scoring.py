"""Scores of text pairs and a classifier's probabilities, as vLLM computes them: on an embedding
model (a bi-encoder) a pair's score is the cosine similarity of the two texts' embeddings; on a
classification model (a cross-encoder, which reads the pair as one input) it is the classifier's
one logit through the model's activation. Pure: the server's /v1/score, /v1/rerank and /classify
and the offline LLM.score and LLM.classify share it."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cpuserve.loading.hf_config import merged


class PairingError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list, or two lists of one length item by item."""
    one, two = ([t] if isinstance(t, str) else list(t) for t in (text_1, text_2))
    if not one or not two:
        raise PairingError("text_1 and text_2 must not be empty", "text_1" if not one else "text_2")
    if len(one) == 1:
        return [(one[0], t) for t in two]
    if len(one) != len(two):
        raise PairingError(f"text_1 has {len(one)} texts and text_2 {len(two)}: two lists pair up item by item "
                           "and must be as long (or give text_1 one text)", "text_2")
    return list(zip(one, two))


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def ranked(scores: list[float], top_n: int = 0) -> list[int]:
    """Indices, best score first (ties in their order), the first top_n (0: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n else order


_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "softmax", "Identity": "identity", "Tanh": "tanh"}


@dataclass(frozen=True)
class ClassifierHead:
    """A classification model's labels and the activations that turn its logits into /classify's
    probabilities and a cross-encoder's score, as vLLM reads them from config.json: softmax over
    several labels, sigmoid over one or where problem_type is multi-label; a score takes
    sentence-transformers' activation_fn where the model names one (some rerankers' is Identity)."""
    labels: tuple[str, ...]
    activation: str        # sigmoid | softmax
    score_activation: str  # sigmoid | softmax | identity | tanh

    @classmethod
    def from_config(cls, cfg: dict) -> "ClassifierHead":
        tokens = cfg.get("classifier_from_token") or (["no", "yes"] if cfg.get("is_original_qwen3_reranker") else [])
        if tokens:  # a causal LM's head rows (--hf-overrides): the tokens name the labels
            two_way = len(tokens) == 2 and (cfg.get("method") == "from_2_way_softmax"
                                            or bool(cfg.get("is_original_qwen3_reranker")))
            labels = (str(tokens[1]),) if two_way else tuple(map(str, tokens))
        else:
            names = cfg.get("id2label") or {"0": "LABEL_0"}
            labels = tuple(str(names[k]) for k in sorted(names, key=int))
        multi = len(labels) == 1 or cfg.get("problem_type") == "multi_label_classification"
        activation = "sigmoid" if multi else "softmax"
        st = (cfg.get("sentence_transformers") or {}).get("activation_fn") or \
            cfg.get("sbert_ce_default_activation_function") or ""
        score = next((v for k, v in _ACTIVATIONS.items() if st.endswith("." + k)), activation)
        return cls(labels, activation, score)

    @classmethod
    def from_dir(cls, model_dir, overrides: dict | None = None) -> "ClassifierHead":
        """The model directory's config.json, with --hf-overrides merged over it."""
        return cls.from_config(merged(json.loads((Path(model_dir) / "config.json").read_text()), overrides or {}))

    def probs(self, logits: list[float]) -> list[float]:
        return activate(logits, self.activation)

    def label(self, logits: list[float]) -> str:
        best = max(range(len(logits)), key=lambda i: logits[i])
        return self.labels[best] if best < len(self.labels) else f"LABEL_{best}"

    def check_scores(self, outputs: int | None = None) -> None:
        """Scoring needs one output: checked on the config's labels before any pair runs, and on
        the logits a pair got (`outputs`)."""
        n = len(self.labels) if outputs is None else outputs
        if n != 1:
            raise PairingError(f"scoring needs a cross-encoder with one output; this classifier has {n} labels "
                               "(use /classify)", "model")

    def score(self, logits: list[float]) -> float:
        """A pair's score: a cross-encoder's one output, activated."""
        self.check_scores(len(logits))
        return activate(logits, self.score_activation)[0]


def activate(logits: list[float], how: str) -> list[float]:
    if how == "softmax":
        top = max(logits)
        e = [math.exp(x - top) for x in logits]
        return [x / sum(e) for x in e]
    f = {"sigmoid": lambda x: 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x)),
         "tanh": math.tanh, "identity": lambda x: x}[how]
    return [f(x) for x in logits]


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's offline classification result: `.outputs.probs`, and the input's token ids."""
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's offline score result: `.outputs.score`, and the pair's token ids."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
