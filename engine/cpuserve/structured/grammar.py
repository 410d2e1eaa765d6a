"""The grammar engine behind structured output: llguidance (Microsoft's guidance
parser; vLLM's `guidance` backend). It needs no transformers and no torch: the
tokenizer is built from the model's own tokenizer.json, so the engine images can
carry it. Where its wheel does not exist (s390x), `available()` is False and
constrained requests are refused with a 400, never served unconstrained.

A `GrammarSpec` compiles to an `LLMatcher` (a parser state over token ids); each
sequence has its own. Per step, `Masks.fill` computes the allowed-token bitmask of
every constrained row in parallel (llguidance's executor, native threads, GIL
released) and `apply` sets the others to -inf in the logits.
"""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from cpuserve.structured.spec import GrammarSpec, closed_schema, schema_text

try:  # a wheel for x86_64 and arm64; none for s390x
    import llguidance as _llg
    from llguidance import numpy as _llg_np
except ImportError:  # pragma: no cover - exercised only on images without the wheel
    _llg = None

UNAVAILABLE = ("structured output is not available in this build: the grammar engine (llguidance) "
               "has no wheel for this architecture")


def available() -> bool:
    return _llg is not None


# The free reasoning before a constraint, by reasoning parser: a lazy lexeme (the shortest text
# that ends in </think>), then whitespace, then the constraint's own grammar (@answer).
# deepseek_r1: the template opened <think>; qwen3: reasoning only where the answer opens with it.
REASONING_HEADS = {
    "deepseek_r1": "start: think gap @answer\nthink[lazy]: /(?s:.*)<\\/think>/\ngap: /[ \\t\\r\\n]*/",
    "qwen3": "start: (think gap)? @answer\nthink[lazy]: /<think>(?s:.*)<\\/think>/\ngap: /[ \\t\\r\\n]*/",
}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (a Lark grammar, or GBNF translated to Lark)."""
    if spec.after_reasoning is not None:
        return after_reasoning(grammar_text(replace(spec, after_reasoning=None)), spec.after_reasoning)
    if spec.kind in ("json", "json_object"):  # a schema closed as vLLM's xgrammar reads it (closed_schema)
        schema = schema_text(closed_schema(json.loads(spec.text))) if spec.kind == "json" else \
            json.dumps({"type": "object"})
        return _llg.LLMatcher.grammar_from_json_schema(schema, defaults=json_layout(spec.whitespace))
    if spec.kind == "regex":  # \d and \w as ASCII classes, as JSON Schema and xgrammar read them
        return _llg.grammar_from("lark", f"start: /{_llg.regex_to_lark(spec.text, 'dw')}/")
    return _llg.grammar_from(spec.kind, spec.text)  # "choice" (a JSON list), "grammar" (GBNF or Lark)


def after_reasoning(inner: str, parser: str) -> str:
    """A grammar (llguidance's JSON form or Lark text) preceded by the parser's free reasoning."""
    inner = inner.strip()
    parts = json.loads(inner)["grammars"] if inner.startswith("{") else [{"lark_grammar": inner}]
    parts[0] = {**parts[0], "name": "answer"}
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": REASONING_HEADS[parser]}, *parts]})


def json_layout(whitespace: str | None) -> dict:
    """One line, separated as Python's json.dumps does, unless the request names the whitespace
    it allows (vLLM's guided_whitespace_pattern): free whitespace lets a small model pad a
    document with newlines until max_tokens, and the test of 200 schemas saw it do so."""
    if whitespace:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def validate(spec: GrammarSpec) -> str:
    """'' when the constraint compiles, else the grammar engine's message (the client's error).
    Needs no tokenizer: the API process checks a request before accepting it."""
    if _llg is None:
        return UNAVAILABLE
    try:
        msg = _llg.LLMatcher.validate_grammar(grammar_text(spec))
    except ValueError as e:
        return str(e)
    return "" if msg.startswith("WARNING") else msg


class GrammarCompiler:
    """Compiles specs against the model's vocabulary; one prototype matcher per distinct
    spec is kept (an LRU), and each sequence gets a copy of it."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: set[int], cache_size: int = 256):
        if _llg is None:
            raise ValueError(UNAVAILABLE)
        text = (Path(model_dir) / "tokenizer.json").read_text()
        eos = sorted(eos_token_ids)
        self.tokenizer = _llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self._proto = functools.lru_cache(maxsize=cache_size)(self._compile)

    def _compile(self, spec: GrammarSpec):
        m = _llg.LLMatcher(self.tokenizer, grammar_text(spec))
        if m.is_error():
            raise ValueError(f"the output constraint does not compile: {m.get_error()}")
        return m

    def matcher(self, spec: GrammarSpec):
        """A fresh parser state for one sequence (ValueError when the spec does not compile)."""
        return self._proto(spec).deep_copy()


class Masks:
    """Per-step bitmasks of the constrained rows of a batch, filled in parallel."""

    def __init__(self, vocab_size: int, threads: int = 2):
        self.vocab_size = vocab_size
        self._executor = _llg.LLExecutor(max(1, threads))
        self._buf = _llg_np.allocate_token_bitmask(1, vocab_size)

    def fill(self, matchers: list):
        """A bool [len(matchers), vocab] tensor: True where the token is allowed."""
        import torch

        n = len(matchers)
        if self._buf.shape[0] < n:
            self._buf = _llg_np.allocate_token_bitmask(n, self.vocab_size)
        buf = self._buf[:n]
        _llg_np.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], buf)
        # bit j of word w is token 32w + j: little-endian bytes, each unpacked least significant bit first
        bits = np.unpackbits(buf.astype("<i4", copy=False).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size]).bool()


def apply(logits, allowed) -> None:
    """Masks a [V] or [R, V] logits tensor in place (the model's vocabulary may be wider
    than the tokenizer's: the extra ids are never allowed)."""
    v = allowed.shape[-1]
    logits[..., :v].masked_fill_(~allowed, float("-inf"))
    logits[..., v:] = float("-inf")
