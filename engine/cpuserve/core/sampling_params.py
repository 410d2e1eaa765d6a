"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.structured.spec import GrammarSpec


SAMPLING_EPS = 1e-5
# Size limits of one request, named in the 400 a larger one gets.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 65536


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1           # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None        # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (each prompt token's own too)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: every other token masked out
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: GrammarSpec | None = None  # the output constraint (structured output), if any
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self._stop = [self.stop]
        elif self.stop is None:
            self._stop = []
        else:
            self._stop = list(self.stop)
        if any(not isinstance(s, str) or s == "" for s in self._stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if not -100.0 <= float(b) <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {b} for token {tok}")
        self._check_sizes(bad)

    def _check_sizes(self, bad) -> None:
        """Bounds on what a request may ask the sampler and the stop-string matcher to
        carry each step (a streamed completion holds back len(longest stop) - 1 chars)."""
        if len(self._stop) > MAX_STOP_STRINGS:
            bad(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self._stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self._stop):
            bad(f"each stop string may be at most {MAX_STOP_CHARS} characters long")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.allowed_token_ids is not None and not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
            bad(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids, got {len(self.allowed_token_ids)}")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")

    def logprobs_error(self, most: int) -> tuple[str, str] | None:
        """(message, field) where the request asks for more logprobs than the engine returns
        (EngineConfig.max_logprobs, vLLM's --max-logprobs), else None."""
        for name, n in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if n is not None and n > most:
                return f"{name} of {n} is more than the {most} this engine returns (--max-logprobs)", name
        return None

    def vocab_error(self, vocab_size: int) -> tuple[str, str] | None:
        """(message, field) where a token id the request names is outside the model's vocabulary,
        else None: allowed_token_ids, and logit_bias (a bias on a token the model cannot produce
        was silently dropped before; vLLM refuses it too)."""
        allowed = self.allowed_token_ids
        if allowed and (min(allowed) < 0 or max(allowed) >= vocab_size):
            return f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids"
        outside = sorted(t for t in (self.logit_bias or {}) if not 0 <= int(t) < vocab_size)
        if outside:
            return (f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): "
                    f"{', '.join(map(str, outside[:5]))}{', ...' if len(outside) > 5 else ''}", "logit_bias")
        return None

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        # as vLLM: a temperature this small is greedy (dividing by it would overflow)
        return self.temperature < SAMPLING_EPS or self.top_k == 1
