"""What a request gives back (vLLM's shapes), and what the engine core sends
the API process. Plain dataclasses: the API process imports them without torch."""
from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A logprob as the offline API gives it: a float (arithmetic, comparison and JSON as before),
    with vLLM's Logprob fields beside it: `.logprob`, `.rank` (1: the most likely token; None where
    the entry does not show it: a sampled token outside the top N), `.decoded_token`."""
    __slots__ = ("rank", "decoded_token")

    def __new__(cls, value: float, rank: int | None = None, decoded_token: str | None = None):
        lp = super().__new__(cls, value)
        lp.rank, lp.decoded_token = rank, decoded_token
        return lp

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    @property
    def logprob(self) -> float:
        return float(self)


def logprob_entry(entry: dict[int, float], decode, token: int, top: int, rank: int | None = None) -> dict[int, Logprob]:
    """An engine logprobs entry ({token id: logprob}: `token`'s own, then the `top` most likely) as
    vLLM's {token id: Logprob}. A rank counts the entry's larger values: exact for the top tokens,
    which all larger ones are among; `token`'s is `rank` where known (a prompt token's), else
    None when it is not one of the top (the entry then holds one key more than `top`)."""
    out = {}
    for tid, lp in entry.items():
        r = 1 + sum(1 for other in entry.values() if other > lp)
        if tid == token:
            r = rank if rank is not None else (r if len(entry) <= top else None)
        out[tid] = Logprob(lp, r, decode(tid))
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs, where logprobs were asked for (else None)."""
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs)))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    queued_s: float | None = None  # arrival -> first scheduled, once the first token is out
    # with SamplingParams.prompt_logprobs, once the first token is out: entry i for prompt token i
    # ({token id: logprob}, the token's own and the top N), None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # beside them, prompt token i's rank in its distribution (1: the most likely), None for the first
    prompt_logprob_ranks: list[int | None] | None = None


@dataclass
class SeqOutput:
    """One step's result for one sequence: a new token and/or its end."""
    request_id: str
    index: int
    token_id: int | None
    logprobs: dict[int, float] | None = None
    finish_reason: str | None = None       # stop | length | abort
    stop_reason: int | None = None         # the stop token id, when one ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queued_s: float | None = None          # arrival -> first scheduled, on the first output
    prompt_logprobs: list | None = None    # the prompt's logprobs (asked for), with the first token
    prompt_ranks: list | None = None       # and its tokens' ranks


STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(prompt_tokens: int, decode_rows: int) -> str:
    """What a step ran: only sequences decoding (`decode`), only prompt tokens (`prefill`: new
    prompts, chunks of them, or a pooling model's inputs), or both (`mixed`)."""
    if prompt_tokens == 0:
        return "decode"
    return "mixed" if decode_rows else "prefill"


@dataclass
class CoreStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    # start-up work left for the engine's idle time (worker/idle.py; rank 0's) not yet done:
    # until then the weights and the KV cache are not all on their huge pages. True until the
    # core says otherwise.
    startup_work_pending: bool = True
    running_loras: tuple[str, ...] = ()  # the LoRA adapters of running requests, sorted
    waiting_loras: tuple[str, ...] = ()  # and of waiting ones
    # by step kind (STEP_KINDS), since the start: steps, their wall seconds (scheduling, the model,
    # sampling and the outputs' bookkeeping) and the tokens they ran (prompt tokens + decode rows)
    kind_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    kind_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    kind_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))

    def count_step(self, prompt_tokens: int, decode_rows: int, tokens: int, seconds: float) -> None:
        """One step that ran `tokens` tokens, `prompt_tokens` of them prompts' and `decode_rows` of
        them sequences' last tokens, in `seconds`."""
        kind = step_kind(prompt_tokens, decode_rows)
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.kind_steps[kind] += 1
        self.kind_seconds[kind] += seconds
        self.kind_tokens[kind] += tokens


@dataclass
class EmbeddingOutput:
    """One input's embedding (a pooling model's answer: no tokens, no KV cache)."""
    request_id: str
    embedding: list[float]
    num_tokens: int
    finished: bool = True
