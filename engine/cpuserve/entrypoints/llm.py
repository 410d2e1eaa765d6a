"""The offline API, as vLLM users know it:

    llm = LLM()                      # the packaged SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])
    vecs = LLM("all-MiniLM-L6-v2").embed(["Hello"])   # an embedding model
    sims = LLM("all-MiniLM-L6-v2").score("Hello", ["Hi", "Bye"])  # cosine similarities: [o.outputs.score ...]
    LLM(cross_encoder_dir).score(query, docs)   # a cross-encoder's relevance scores
    LLM(classifier_dir).classify(["Great!"])    # class probabilities: [o.outputs.probs ...]
"""
from __future__ import annotations

import functools
import itertools
from typing import Sequence as Seq

from cpuserve.config import EngineConfig
from cpuserve.engine.llm_engine import LLMEngine
from cpuserve.engine.outputs import EmbeddingOutput, RequestOutput, logprob_entry
from cpuserve.core.lora_request import LoRARequest
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.entrypoints.scoring import (ClassificationOutput, ClassificationRequestOutput, ClassifierHead,
                                         ScoringOutput, ScoringRequestOutput, cosine, pairs)
from cpuserve.loading.tokenizer import apply_chat_template

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use where they are given no SamplingParams: the model's generation
        config (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) over vLLM's
        defaults (max_tokens 16); EngineConfig's generation_config and override_generation_config
        choose it, as vLLM's LLM(generation_config=..., override_generation_config=...)."""
        return self.engine.defaults.as_sampling_params()

    def embed(self, prompts: str | list[int] | Seq[str | list[int]]) -> list[EmbeddingOutput]:
        """One EmbeddingOutput (`.embedding`, `.num_tokens`) per prompt, from an embedding model."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.embed(list(prompts))

    def classify(self, prompts: str | list[int] | Seq[str | list[int]]) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify on a classification model: each prompt's class probabilities
        (`.outputs.probs`, softmax over the labels or sigmoid where the model says so)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tok = self.engine.tokenizer
        ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        outs = self.engine.pool([(x, None) for x in ids], "classify")
        head = ClassifierHead.from_dir(self.engine.core.runner.model_dir, self.engine.config.hf_overrides)
        return [ClassificationRequestOutput(f"classify-{next(self._ids)}", ClassificationOutput(head.probs(o.embedding)),
                                            x) for x, o in zip(ids, outs)]

    def score(self, text_1: str | list[str], text_2: str | list[str]) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score (`.outputs.score`), one text against each of a list or two lists item by
        item: on an embedding model each pair's cosine similarity, each distinct text embedded once;
        on a cross-encoder the classifier's score of the two texts read together."""
        todo = pairs(text_1, text_2)
        if self.engine.task == "classify":
            return self._cross_scores(todo)
        tok = self.engine.tokenizer
        ids = {t: tok.encode(t) for p in todo for t in p}
        vecs = dict(zip(ids, self.engine.embed(list(ids.values()))))
        return [ScoringRequestOutput(f"score-{next(self._ids)}", ScoringOutput(cosine(vecs[a].embedding,
                                                                                    vecs[b].embedding)),
                                     ids[a] + ids[b]) for a, b in todo]

    def _cross_scores(self, todo: list[tuple[str, str]]) -> list[ScoringRequestOutput]:
        head = ClassifierHead.from_dir(self.engine.core.runner.model_dir, self.engine.config.hf_overrides)
        head.check_scores()  # a multi-label classifier is refused before any pair runs
        encoded = [self.engine.tokenizer.encode_pair(a, b) for a, b in todo]
        outs = self.engine.pool(encoded, "classify")
        return [ScoringRequestOutput(f"score-{next(self._ids)}", ScoringOutput(head.score(o.embedding)), ids)
                for (ids, _), o in zip(encoded, outs)]

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.generate: one RequestOutput per prompt, in order. `use_tqdm`: a progress bar of
        finished requests (vLLM shows one by default; here it is asked for). `lora_request`: the
        LoRA adapter of every prompt, or one per prompt (None: the base model); each is loaded on
        its first use (the engine needs enable_lora=True)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = self._loras(lora_request, len(prompts))
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = f"offline-{next(self._ids)}"
                if isinstance(prompt, dict):
                    if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
                    prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
                self.engine.add_request(rid, prompt, p, final_only=True, lora=lora)
                ids.append(rid)
            return self._logprob_objects(self._run(ids, use_tqdm), params)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise

    def _loras(self, lora_request, n: int) -> list[str | None]:
        """Each prompt's adapter name, the adapters loaded (once each) before any request starts."""
        reqs = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(reqs) != n:
            raise ValueError(f"{len(reqs)} LoRA requests for {n} prompts")
        for r in reqs:
            if r is not None:
                self.engine.runner.add_lora(r.lora_name, r.lora_path)
        return [None if r is None else r.lora_name for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = False,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template (with `tools`, OpenAI-shaped
        function definitions, as template variables), its last message answered, or
        (continue_final_message, with add_generation_prompt False) continued."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        variables = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts = [tok.encode(apply_chat_template(tok, conv, add_generation_prompt, chat_template,
                                                  continue_final_message, **variables),
                              add_special_tokens=False) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _logprob_objects(self, outs: list[RequestOutput], params: list[SamplingParams]) -> list[RequestOutput]:
        """Logprobs entries as vLLM's {token id: Logprob} (floats with .logprob, .rank, .decoded_token)."""
        decode = functools.lru_cache(maxsize=4096)(lambda t: self.engine.tokenizer.decode([t]))
        for out, p in zip(outs, params):
            for c in out.outputs:
                if c.logprobs is not None:
                    c.logprobs = [logprob_entry(e, decode, t, p.logprobs) for t, e in zip(c.token_ids, c.logprobs)]
            if out.prompt_logprobs is not None:
                ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
                out.prompt_logprobs = [None if e is None else logprob_entry(e, decode, t, p.prompt_logprobs, r)
                                       for t, e, r in zip(out.prompt_token_ids, out.prompt_logprobs, ranks)]
        return outs

    def _run(self, ids: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in ids]


def _progress(total: int):
    """A tqdm bar of finished requests, or None where tqdm is not installed (it is no dependency)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Processed prompts", unit="req")
