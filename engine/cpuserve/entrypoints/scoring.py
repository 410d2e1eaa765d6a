"""Scores of text pairs on an embedding model, as vLLM scores with a bi-encoder: the cosine
similarity of the two texts' embeddings. Pure: the server's /v1/score and /v1/rerank and the
offline LLM.score share it."""
from __future__ import annotations

import math
from dataclasses import dataclass


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
