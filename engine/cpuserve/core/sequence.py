"""A sequence: one prompt plus the tokens generated for it, and its cache blocks."""
from __future__ import annotations

import enum
import itertools

from cpuserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "",
                 index: int = 0, arrival: float = 0.0, lora: str | None = None, lora_serial: int = 0):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index                 # which of the request's n completions
        self.arrival = arrival
        self.params = params
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0       # tokens whose KV is in the cache
        self.num_cached_tokens = 0         # of those, how many came from the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0         # leading full blocks registered in the prefix cache
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] = []
        # with params.prompt_logprobs: entry i for prompt token i, given the tokens before it (none
        # for the first), filled in as the prompt's chunks run
        self.prompt_logprobs: list[dict[int, float] | None] = [None]
        self.prompt_ranks: list[int | None] = [None]  # each prompt token's rank, beside its entry
        self.output_text_len = 0           # set by the detokenizer when stop strings truncate
        self.generator = None              # per-sequence torch.Generator when seeded
        self.first_scheduled: float | None = None
        self.matcher = None                # the output constraint's parser state (structured output)
        self.lora = lora                   # the LoRA adapter's name; None: the base model
        # where its prefix-cache hash chain starts: an adapter's KV differs from the base model's
        self.cache_root = None if lora is None else hash(("lora", lora, lora_serial))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
