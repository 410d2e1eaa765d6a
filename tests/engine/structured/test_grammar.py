"""The grammar engine against the real model's vocabulary, in the sampler and in the
engine: masks against a reference built token by token, the grammar's precedence over
the request's own masks, and constrained sequences beside free ones."""
import json

import pytest
import torch

from cpuserve import SamplingParams
from cpuserve.core.sequence import Sequence
from cpuserve.structured import grammar
from cpuserve.structured.spec import GrammarSpec, from_fields
from cpuserve.worker.sampler import Sampler

pytestmark = pytest.mark.skipif(not grammar.available(), reason=grammar.UNAVAILABLE)
CHOICE = GrammarSpec("choice", json.dumps(["yes", "no", "maybe"]))


@pytest.fixture(scope="module")
def compiler(llm_f32):
    core = llm_f32.engine.core
    return grammar.GrammarCompiler(core.runner.model_dir, core.vocab_size, core.eos_token_ids)


def test_mask_is_the_set_of_tokens_that_keep_the_parse_alive(compiler, tokenizer):
    """The reference: for each vocabulary token, whether a fresh parser accepts it."""
    m = compiler.matcher(CHOICE)
    allowed = grammar.Masks(compiler.vocab_size).fill([m])[0]
    want = {t for t in range(compiler.vocab_size) if compiler.matcher(CHOICE).try_consume_tokens([t]) == 1}
    assert set(torch.nonzero(allowed).flatten().tolist()) == want
    assert {tokenizer.decode([t]) for t in want} >= {"yes", "no"}
    assert all(any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no", "maybe")) for t in want)


def test_json_properties_come_in_the_schemas_order(compiler, tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    spec = from_fields(guided_json=schema)

    def accepted(text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        return compiler.matcher(spec).try_consume_tokens(ids) == len(ids)
    assert accepted('{"name": "Ann", "age": 31}')
    assert not accepted('{"age": 31, "name": "Ann"}')


def test_an_object_gets_no_keys_its_schema_does_not_name_unless_it_allows_them(compiler, tokenizer):
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def accepted(schema, text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        return compiler.matcher(from_fields(guided_json=schema)).try_consume_tokens(ids) == len(ids)
    assert accepted(city, '{"city": "Paris"}')
    assert not accepted(city, '{"city": "Paris", "location": "Paris"}')
    assert accepted({**city, "additionalProperties": True}, '{"city": "Paris", "location": "Paris"}')
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert accepted(pair, '[1, "a"]') and not accepted(pair, '[1, "a", 2]')


@pytest.mark.parametrize("spec, answer", [
    (from_fields(guided_json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     '{"a": 5}'),
    (from_fields(guided_regex="[A-Z][a-z]+"), "Hello"), (CHOICE, "maybe"),
    (from_fields(guided_grammar='root ::= "hi" | "bye"'), "bye"),
])
def test_after_reasoning_the_constraint_holds_from_the_end_of_the_think_block(compiler, tokenizer, spec, answer):
    """vLLM starts structured output after a thinking model's reasoning: the reasoning is free text
    up to its first </think>, then whitespace, then the constraint."""
    from dataclasses import replace

    def accepted(parser, text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        m = compiler.matcher(replace(spec, after_reasoning=parser))
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    thought = "<think>Is it 4? {not json} </thi ... yes.</think>\n\n"
    assert accepted("deepseek_r1", thought + answer) and accepted("deepseek_r1", thought[7:] + answer)
    assert not accepted("deepseek_r1", answer)  # its template opened <think>: the answer follows a </think>
    assert not accepted("deepseek_r1", thought + answer + " and more")
    assert accepted("qwen3", thought + answer) and accepted("qwen3", answer)  # qwen3: thinking is optional
    assert not accepted("qwen3", thought[7:] + answer)
    assert grammar.validate(replace(spec, after_reasoning="qwen3")) == ""


def test_constrained_row_only_samples_allowed_tokens_and_the_grammar_wins(compiler, tokenizer):
    eos = min(compiler.tokenizer.eos_tokens)
    free = Sequence([1, 2, 3], SamplingParams(temperature=0))
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0, min_tokens=5))
    seq.matcher = compiler.matcher(CHOICE)
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert seq.matcher.consume_token(t)
    logits = torch.randn(2, compiler.vocab_size)
    logits[:, eos] = -50.0  # the model would rather not stop; min_tokens bans EOS too
    tokens, _ = Sampler({eos})(logits, [free, seq])
    assert tokens == [int(logits[0].argmax()), eos]  # the free row is untouched; the finished grammar allows only EOS


def test_structured_and_free_sequences_in_one_engine_step(llm_f32):
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm_f32.generate(["The capital of France is"], free)[0].outputs[0].token_ids
    outs = llm_f32.generate(["The capital of France is", "Is water wet? Answer:"],
                            [free, SamplingParams(temperature=0, max_tokens=12, structured=GrammarSpec(
                                "regex", " (yes|no)[.!]"))])
    assert outs[0].outputs[0].token_ids == alone
    assert outs[1].outputs[0].text in (" yes.", " no.", " yes!", " no!") and outs[1].outputs[0].finish_reason == "stop"


def test_a_constraint_that_does_not_compile_is_refused_before_any_sequence_runs(llm_f32):
    with pytest.raises(ValueError, match="does not compile"):
        llm_f32.generate(["x"], SamplingParams(max_tokens=2, structured=GrammarSpec("regex", "(")))
    assert not llm_f32.engine.core.has_unfinished()
