"""Shared fixtures. The real model is the packaged SmolLM2-135M-Instruct GGUF;
the transformers reference loads the same file with transformers' own GGUF
loader (its own dequantization and name mapping), independent of ours."""
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines built inside the test process must not pin it (its threads, and every
# process it starts, would inherit one CPU). Binding is tested in tests/platform,
# and served engines run with the default `auto` (tests.engine.entrypoints.openai.conftest.py).
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 23?\nA:",
    "List of the planets of the solar system:\n1.",
    "The three laws of thermodynamics are",
    "<|im_start|>user\nGive me a short recipe for pancakes.<|im_end|>\n<|im_start|>assistant\n",
    "In machine learning, a transformer is",
]


@pytest.fixture(scope="session")
def model_path():
    from cpuserve.loading.model_loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    return AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def llm_f32():
    from cpuserve import LLM
    return LLM(dtype="float32", block_size=16, kv_cache_space=1.0)


@pytest.fixture(scope="session")
def tokenizer(llm_f32):
    return llm_f32.get_tokenizer()
