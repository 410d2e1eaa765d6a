"""The GGUF conversion without transformers: the tokenizer it writes encodes and
decodes as transformers' GGUF conversion does on the real model, and quantized
blocks from a file of the other byte order dequantize to the same values."""
import json

import numpy as np
import pytest

from cpuserve.loading import gguf_loader
from cpuserve.loading.gguf_tokenizer import bytes_to_unicode, write_tokenizer

TEXTS = [
    "Hello world", " Hello  world\n\n", "The capital of France is Paris.", "naïve café — déjà vu 😀 日本語",
    "def f(x):\n\treturn x**2  # square\n", "<|im_start|>user\nHi<|im_end|>\n", "1234567 + 89 = ?",
    "I'm sure it's what they've said, isn't it?", "   leading and trailing   ", "<|endoftext|>tail",
    "\u00a0non-breaking\u2009thin", "ÀÉÎÕÜ ß ĳ ﬁ", "a\r\nb\rc",
]


@pytest.fixture(scope="module")
def converted(model_path, tmp_path_factory):
    import gguf
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(gguf.GGUFReader(str(model_path)), model_path, out)
    return out


@pytest.fixture(scope="module")
def reference(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


def test_tokenizer_matches_transformers_on_the_real_model(converted, reference):
    from cpuserve.loading.tokenizer import Tokenizer
    ours = Tokenizer(converted)
    assert len(ours) == len(reference)
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=True)
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == \
        (reference.bos_token, reference.eos_token, reference.pad_token, reference.unk_token)
    msgs = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(msgs) == reference.apply_chat_template(msgs, tokenize=False,
                                                                           add_generation_prompt=True)


def test_tokenizer_config_holds_template_and_flags(converted):
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in cfg["chat_template"]


def test_bytes_to_unicode_is_a_printable_bijection():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256 and all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16"])
def test_blocks_of_the_other_byte_order_dequantize_the_same(name):
    import gguf
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(0)
    size, fields = gguf_loader.BLOCK_FIELDS[name]
    if name.endswith("_K"):  # gguf-py has no quantizer for these: random blocks with finite scales
        raw = rng.integers(0, 256, (4, 2 * size), dtype=np.uint8)
        for off, width in fields:
            for b in range(2):
                scale = np.array([rng.uniform(0.01, 0.1)], np.float16 if width == 2 else np.uint32)
                raw[:, b * size + off:b * size + off + width] = scale.view(np.uint8)
    else:
        x = rng.standard_normal((4, 512)).astype(np.float32)
        raw = gguf.quants.quantize(x, qtype)
        assert np.abs(gguf_loader.dequantize(raw, qtype, swapped=False).reshape(x.shape) - x).max() < 0.5
    expect = gguf_loader.dequantize(raw, qtype, swapped=False)
    other = gguf_loader.swap_block_fields(raw, name)  # the same blocks as a big-endian file holds them
    assert not np.array_equal(other, raw)
    np.testing.assert_array_equal(gguf_loader.dequantize(other, qtype, swapped=True), expect)


def test_float_tensors_of_the_other_byte_order_read_by_value():
    import gguf
    x = np.linspace(-2, 2, 64, dtype=np.float32)
    for qtype, dtype in ((gguf.GGMLQuantizationType.F32, ">f4"), (gguf.GGMLQuantizationType.F16, ">f2")):
        np.testing.assert_allclose(gguf_loader.dequantize(x.astype(dtype), qtype, swapped=True), x, atol=1e-3)


def test_unsupported_type_in_the_other_byte_order_is_refused():
    with pytest.raises(ValueError, match="IQ2_XXS.*other byte order"):
        gguf_loader.swap_block_fields(np.zeros(66, np.uint8), "IQ2_XXS")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "uint8"])
def test_safetensors_bytes_read_by_value_on_a_big_endian_host(dtype):
    import torch

    from cpuserve.loading.model_loader import from_le_bytes
    want = (torch.arange(-6, 6) * 3).to(getattr(torch, dtype)).reshape(3, 4)
    le = bytearray(want.numpy().tobytes() if dtype != "bfloat16" else want.view(torch.int16).numpy().tobytes())
    assert torch.equal(from_le_bytes(bytearray(le), want.dtype, (3, 4), big_endian_host=False), want)
    # what a big-endian host holds after its read: the same values, each element's bytes reversed
    size = want.element_size()
    host = bytearray(b"".join(bytes(le[i:i + size][::-1]) for i in range(0, len(le), size)))
    swapped = from_le_bytes(bytearray(le), want.dtype, (3, 4), big_endian_host=True)
    assert bytes(swapped.view(torch.uint8).numpy().tobytes()) == bytes(host)


def test_a_ggufs_recommended_sampling_becomes_its_generation_config(model_path, tmp_path, monkeypatch):
    """llama.cpp reads general.sampling.* as a model's default sampling; the converted directory
    carries them as the generation_config.json the server reads its defaults from."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    from cpuserve.core.generation_config import sampling_defaults
    monkeypatch.setenv("CPUSERVE_CACHE", str(tmp_path / "cache"))
    reader = gguf.GGUFReader(str(model_path))
    out = tmp_path / "recommended.gguf"
    writer = gguf.GGUFWriter(str(out), arch=reader.fields["general.architecture"].contents(),
                             endianess=reader.endianess)
    writer.add_sampling_temp(0.6)
    writer.add_sampling_top_k(20)
    writer.add_sampling_top_p(0.95)
    writer.add_sampling_penalty_last_n(64)  # llama.cpp's own, with no generation-config name
    copy_with_new_metadata(reader, writer, {}, [])
    d = sampling_defaults(gguf_loader.converted_dir(out))
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (pytest.approx(0.6), 20, pytest.approx(0.95), 0.0)
    assert not (gguf_loader.converted_dir(model_path) / "generation_config.json").exists()
