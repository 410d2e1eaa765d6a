"""The offline engine: the engine core and the output processor in one process."""
from __future__ import annotations

from cpuserve.config import EngineConfig
from cpuserve.engine.output_processor import OutputProcessor
from cpuserve.engine.outputs import EmbeddingOutput, RequestOutput
from cpuserve.engine.pooling_core import make_core
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.core.generation_config import sampling_defaults
from cpuserve.loading.tokenizer import load_tokenizer


_IS = {"embed": "an embedding model: use LLM.embed or LLM.score",
       "classify": "a classification model (a cross-encoder): use LLM.classify or LLM.score"}
_NOT_FOR = {"embed": "is not an embedding model: embeddings need one such as all-MiniLM-L6-v2, or a causal LM "
                     "with runner='pooling'",
            "classify": "is not a classification model: LLM.classify needs a *ForSequenceClassification "
                        "checkpoint (a cross-encoder such as ms-marco-MiniLM-L-6-v2)"}


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        sampling_defaults(None, config.generation_config, config.override_generation_config)  # before loading
        self.core = make_core(config)  # the generation core, or the pooling one of an embedding model
        self.task = getattr(self.core, "task", "generate")
        self.tokenizer = load_tokenizer(self.core.runner.model_dir)
        self.output = OutputProcessor(self.tokenizer)
        # the parameters a request without its own gets (the model's generation config)
        self.defaults = sampling_defaults(self.core.runner.model_dir if self.task == "generate" else None,
                                          config.generation_config, config.override_generation_config)

    # the core's parts, for tests and tools
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    stats = property(lambda self: self.core.stats)
    max_model_len = property(lambda self: self.core.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    final_only: bool = False, lora: str | None = None) -> None:
        """final_only: step() returns the request's output only once it finished (OutputProcessor);
        lora: a loaded LoRA adapter's name (runner.add_lora)."""
        if self.task != "generate":
            raise ValueError(f"{self.core.runner.model_dir} is {_IS[self.task]}")
        params = params or self.defaults.as_sampling_params()
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        self.core.add_request(request_id, ids, params, lora=lora)
        self.output.add_request(request_id, text, ids, params, final_only)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self.output.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.requests)

    def step(self) -> list[RequestOutput]:
        outputs, to_stop = self.output.process(self.core.step())
        for request_id, index in to_stop:
            self.core.stop_sequence(request_id, index)
        return outputs

    def embed(self, prompts: list[str | list[int]]) -> list[EmbeddingOutput]:
        """Embeddings of an embedding model, in the order given (batched by the core)."""
        return self.pool([(self.tokenizer.encode(p) if isinstance(p, str) else list(p), None) for p in prompts],
                         "embed")

    def pool(self, inputs: list[tuple[list[int], list[int] | None]], task: str) -> list[EmbeddingOutput]:
        """A pooling model's outputs for (token ids, token type ids or None), in the order given,
        batched by the core: embeddings (task "embed") or a classifier's logits ("classify")."""
        if self.task != task:
            raise ValueError(f"{self.core.runner.model_dir} {_NOT_FOR[task]}")
        for ids, types in inputs:  # all checked before any is queued: a refusal leaves nothing behind
            self.core.validate(ids, types)
        for i, (ids, types) in enumerate(inputs):
            self.core.add_request(str(i), ids, types)
        got: dict[str, EmbeddingOutput] = {}
        while self.core.has_unfinished():
            got.update((o.request_id, o) for o in self.core.step())
        return [got[str(i)] for i in range(len(inputs))]

    def prefix_cache_stats(self) -> dict[str, int]:
        return {"queries": self.core.block_manager.prefix_queries, "hits": self.core.block_manager.prefix_hits}
