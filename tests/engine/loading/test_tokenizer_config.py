"""Our transformers-free config and tokenizer readers against transformers itself."""
import json

import pytest

from cpuserve.loading.hf_config import _DEFAULTS, load_config
from cpuserve.loading.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "Ünïcödé — emoji 🚀 and 中文",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # comment", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
]


@pytest.fixture(scope="module")
def both(llm_f32):
    from transformers import AutoTokenizer
    d = llm_f32.engine.runner.model_dir
    return Tokenizer(d), AutoTokenizer.from_pretrained(str(d))


def test_encode_decode_match_transformers(both):
    ours, hf = both
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == hf.eos_token_id and ours.bos_token_id == hf.bos_token_id
    assert len(ours) == len(hf)


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(both, gen):
    ours, hf = both
    for conv in CONVERSATIONS:
        assert ours.apply_chat_template(conv, add_generation_prompt=gen) == \
            hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)


def test_continue_final_message_matches_transformers(both):
    ours, hf = both
    for last in ("The answer is", "  padded  ", "Line one\nline two"):
        conv = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": last}]
        got = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
        assert got == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
        assert got.endswith(last)
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(ValueError, match="needs a last message"):
        ours.apply_chat_template([{"role": "assistant", "content": ""}], add_generation_prompt=False,
                                 continue_final_message=True)


def test_template_variables_reach_the_template(both):
    ours, _ = both
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, greeting="Hey ") == \
        "Hey x"


def test_missing_chat_template_is_a_clear_error(tmp_path, llm_f32):
    import shutil
    d = llm_f32.engine.runner.model_dir
    shutil.copy(d / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


SPARSE = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}


@pytest.mark.parametrize("model_type", sorted(SPARSE))
def test_config_defaults_match_transformers(tmp_path, model_type):
    from transformers import AutoConfig
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **SPARSE[model_type]}))
    ours, theirs = load_config(tmp_path), AutoConfig.from_pretrained(str(tmp_path))
    for field in _DEFAULTS[model_type]:
        if field in ("rope_theta", "rope_local_base_freq") and not hasattr(theirs, field):
            params = theirs.rope_parameters  # transformers >= 5 keeps theta here
            if model_type == "gemma3_text":
                params = params["sliding_attention" if field == "rope_local_base_freq" else "full_attention"]
            assert params["rope_theta"] == getattr(ours, field), field
            continue
        if field == "sliding_window_pattern":
            assert getattr(theirs, "_sliding_window_pattern", getattr(theirs, field, None)) == ours.sliding_window_pattern
            continue
        assert getattr(theirs, field) == getattr(ours, field), f"{model_type}.{field}"
    if model_type not in ("opt", "gpt2"):
        assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert (ours.hidden_size, ours.num_attention_heads, ours.num_hidden_layers) == \
        (theirs.hidden_size, theirs.num_attention_heads, theirs.num_hidden_layers)
