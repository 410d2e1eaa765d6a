"""The offline engine: the engine core and the output processor in one process."""
from __future__ import annotations

from cpuserve.config import EngineConfig
from cpuserve.engine.engine_core import EngineCore
from cpuserve.engine.output_processor import OutputProcessor
from cpuserve.engine.outputs import RequestOutput
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.loading.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = load_tokenizer(self.core.runner.model_dir)
        self.output = OutputProcessor(self.tokenizer)

    # the core's parts, for tests and tools
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    stats = property(lambda self: self.core.stats)
    max_model_len = property(lambda self: self.core.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        self.core.add_request(request_id, ids, params)
        self.output.add_request(request_id, text, ids, params)

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

    def prefix_cache_stats(self) -> dict[str, int]:
        return {"queries": self.core.block_manager.prefix_queries, "hits": self.core.block_manager.prefix_hits}
