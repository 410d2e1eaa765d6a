"""The model's default sampling parameters (vLLM's --generation-config and
--override-generation-config): which of a generation_config.json's fields count, how the
overrides and a request's own fields sit over them, and the errors that name what is wrong."""
import json

import pytest

from cpuserve.core.generation_config import SamplingDefaults, sampling_defaults
from cpuserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def model_dir(tmp_path, config: dict | str):
    (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return tmp_path


def test_the_models_sampling_fields_become_the_defaults(tmp_path):
    d = sampling_defaults(model_dir(tmp_path, QWEN))
    assert d == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert d.changed() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_transformers_own_defaults_in_the_file_say_nothing(tmp_path):
    # GenerationConfig's top_k 50 and temperature 1.0 are what transformers writes unasked: vLLM reads
    # the file through to_diff_dict, which drops them, so the request's plain defaults stay
    d = sampling_defaults(model_dir(tmp_path, {"top_k": 50, "temperature": 1.0, "top_p": 0.9, "max_length": 20}))
    assert d == SamplingDefaults(top_p=0.9)


def test_no_file_or_vllm_gives_the_plain_defaults(tmp_path):
    assert sampling_defaults(tmp_path) == SamplingDefaults()
    assert sampling_defaults(model_dir(tmp_path, QWEN), "vllm") == SamplingDefaults()
    assert sampling_defaults(None, "auto") == SamplingDefaults()


def test_a_directory_of_its_own_and_overrides_over_it(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    model_dir(other, {"temperature": 0.2, "max_new_tokens": 64})
    d = sampling_defaults(model_dir(tmp_path, QWEN), str(other), {"top_k": 0, "min_p": 0.05})
    assert d == SamplingDefaults(temperature=0.2, top_k=-1, min_p=0.05, max_tokens=64)


@pytest.mark.parametrize("source,overrides,message", [
    ("/nowhere", None, "--generation-config /nowhere: no generation_config.json there"),
    ("auto", {"temprature": 0.5}, "--override-generation-config: temprature not among"),
    ("auto", {"temperature": -1}, "--override-generation-config: temperature must be >= 0"),
    ("auto", {"top_k": 2.5}, "--override-generation-config: top_k must be an integer, got 2.5"),
    ("auto", {"max_new_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("auto", [1, 2], "--override-generation-config is a JSON object"),
])
def test_unusable_options_are_refused_naming_them(source, overrides, message):
    with pytest.raises(ValueError, match=message):
        sampling_defaults(None, source, overrides)


def test_a_broken_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config.json: not a readable generation config"):
        sampling_defaults(model_dir(tmp_path, "{temperature: 0.7"))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        sampling_defaults(model_dir(tmp_path, {"top_p": 1.5}))


def test_max_new_tokens_caps_every_request():
    d = SamplingDefaults(max_tokens=32)
    assert [d.cap(None), d.cap(8), d.cap(100)] == [32, 8, 32]
    assert [SamplingDefaults().cap(None), SamplingDefaults().cap(100)] == [None, 100]


QWENISH = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=50)


def test_a_request_gets_the_defaults_for_what_it_leaves_out():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    p = chat.sampling_params(1000, None, defaults=QWENISH)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.7, 0.8, 20, 0.0, 1.05, 50)
    p = CompletionRequest(prompt="Hi", max_tokens=None).sampling_params(None, None, defaults=QWENISH)
    assert (p.temperature, p.max_tokens) == (0.7, 50)
    p = ResponsesRequest(input="Hi").sampling_params(1000, None, QWENISH)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.7, 0.8, 20, 1.05, 50)


def test_a_requests_own_fields_win_even_where_they_are_zero():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], temperature=0, top_p=1, top_k=0,
                                 min_p=0, repetition_penalty=1.0)
    p = chat.sampling_params(10, None, defaults=QWENISH)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.0, 1.0, -1, 0.0, 1.0, 10)


def test_without_a_generation_config_a_request_keeps_openais_defaults():
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}]).sampling_params(1000, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (1.0, 1.0, -1, 0.0, 1.0, 1000)


def test_the_offline_defaults_are_vllms_over_the_models():
    assert SamplingDefaults().as_sampling_params().max_tokens == 16  # vLLM's SamplingParams default
    p = QWENISH.as_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.7, 0.8, 20, 1.05, 50)
