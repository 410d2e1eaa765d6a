"""A causal LM as an embedding model (`runner="pooling"`, vLLM's last-token pooling) on the
default model, against transformers' final hidden state of the same GGUF: packed batches
give what each sequence gives alone, steps are bounded by the scratch cache, and an encoder
cannot be asked to generate."""
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
    with pytest.raises(ValueError, match="embedding model .*runner='generate'"):
        LLM(PACKAGED_EMBEDDER, runner="generate")
    with pytest.raises(ValueError, match="runner must be"):
        LLM(runner="embed")
