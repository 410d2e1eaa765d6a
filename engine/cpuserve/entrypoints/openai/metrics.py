"""Prometheus metrics under vLLM's names, so existing dashboards work unchanged, and the
periodic stats line vLLM's server logs (--disable-log-stats turns it off)."""
from __future__ import annotations

import asyncio
import logging
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cpuserve.engine.outputs import STEP_KINDS

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)
# token counts: vLLM's 1-2-5 series (1, 2, 5, 10, 20, 50, ...), here up to a million tokens
_TOKENS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)


class Metrics:
    def __init__(self, model_name: str, max_loras: int | None = None):
        """`max_loras`: with LoRA adapters enabled, vLLM's vllm:lora_requests_info is kept too."""
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", lbl, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", lbl, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lbl, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lbl, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute)", lbl, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lbl, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests", lbl + ["finished_reason"],
                                       registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lbl, buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", lbl, buckets=_LATENCY,
                             registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", lbl, buckets=_LATENCY, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled", lbl,
                               buckets=_LATENCY, registry=r)
        self.inference = Histogram("vllm:request_inference_time_seconds", "Time from first scheduled to finished",
                                   lbl, buckets=_LATENCY, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Time from first scheduled to the first token",
                                 lbl, buckets=_LATENCY, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Time from the first token to finished", lbl,
                                buckets=_LATENCY, registry=r)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request", lbl,
                                        buckets=_TOKENS, registry=r)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens of each finished "
                                            "request (all its choices)", lbl, buckets=_TOKENS, registry=r)
        # vLLM's older names, which its dashboards before 0.11 query: the same observations
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time between tokens (the older name of "
                              "vllm:inter_token_latency_seconds)", lbl, buckets=_LATENCY, registry=r)
        self.gpu_cache = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (the older name of "
                               "vllm:kv_cache_usage_perc; the cache is in host memory)", lbl, registry=r)
        # where the engine core's time goes, by step kind (outputs.STEP_KINDS): cpuserve's own, no
        # vLLM equivalent. Deltas over a window give its steps' mean time and size by kind.
        kind = lbl + ["kind"]
        self.kind_steps = Counter("cpuserve:engine_steps", "Engine steps by kind: decode (only sequences "
                                  "decoding), prefill (only prompt tokens), mixed (both)", kind, registry=r)
        self.kind_seconds = Counter("cpuserve:engine_step_seconds", "Wall time of the engine's steps by kind",
                                    kind, registry=r)
        self.kind_tokens = Counter("cpuserve:engine_step_tokens", "Tokens the engine's steps ran by kind "
                                   "(prompt tokens and decode rows)", kind, registry=r)
        self.startup_pending = Gauge("cpuserve:startup_work_pending", "1 while start-up work left for the "
                                     "engine's idle time is not done (the weights' and KV cache's huge pages, "
                                     "the KV cache's pages populated): a steady-state benchmark waits for 0",
                                     lbl, registry=r)
        self.labels = {"model_name": model_name}
        self.max_loras = max_loras
        if max_loras is not None:  # vLLM's info metric: the labels carry the state, the value when it was seen
            self.lora_info = Gauge("vllm:lora_requests_info", "The LoRA adapters of running and waiting requests",
                                   ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.startup_pending.labels(**self.labels).set(1)  # until the core's first snapshot says
        for counter in (self.kind_steps, self.kind_seconds, self.kind_tokens):
            for k in STEP_KINDS:  # every kind's series from the start, at zero
                counter.labels(kind=k, **self.labels)
        # the children observed at every token, looked up once (labels() takes a lock and a dict lookup)
        self.ttft_m, self.itl_m, self.e2e_m, self.queue_m, self.tpot_m = (
            h.labels(**self.labels) for h in (self.ttft, self.itl, self.e2e, self.queue, self.tpot))
        self._last = {"queries": 0, "hits": 0, "preempt": 0, "prompt": 0, "gen": 0}

    def update_stats(self, s) -> None:
        L = self.labels
        self.running.labels(**L).set(s.num_running)
        self.waiting.labels(**L).set(s.num_waiting)
        self.kv_usage.labels(**L).set(s.kv_cache_usage)
        self.gpu_cache.labels(**L).set(s.kv_cache_usage)
        self.startup_pending.labels(**L).set(int(s.startup_work_pending))
        if self.max_loras is not None:
            self.lora_info.clear()
            self.lora_info.labels(max_lora=str(self.max_loras), running_lora_adapters=",".join(s.running_loras),
                                  waiting_lora_adapters=",".join(s.waiting_loras)).set(time.time())
        for key, counter, value in (("queries", self.prefix_queries, s.prefix_cache_queries),
                                    ("hits", self.prefix_hits, s.prefix_cache_hits),
                                    ("preempt", self.preemptions, s.num_preemptions),
                                    ("prompt", self.prompt_tokens, s.prompt_tokens),
                                    ("gen", self.generation_tokens, s.generation_tokens)):
            if value > self._last[key]:
                counter.labels(**L).inc(value - self._last[key])
                self._last[key] = value
        for name, counter, totals in (("steps", self.kind_steps, s.kind_steps),
                                      ("seconds", self.kind_seconds, s.kind_seconds),
                                      ("tokens", self.kind_tokens, s.kind_tokens)):
            for kind, value in totals.items():
                last = self._last.get((name, kind), 0)
                if value > last:
                    counter.labels(kind=kind, **L).inc(value - last)
                    self._last[(name, kind)] = value


class RequestTimer:
    """Per-request latency bookkeeping, observed into Metrics as tokens arrive."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.first: float | None = None  # seconds from the start to the first token
        self.queued = 0.0  # seconds waiting before first scheduled (the engine's)

    def token(self, queued_s: float | None = None) -> None:
        now = time.monotonic()
        if self.last is None:
            self.first = now - self.start
            self.m.ttft_m.observe(self.first)
            if queued_s is not None:
                self.queued = queued_s
                self.m.queue_m.observe(queued_s)
        else:
            self.m.itl_m.observe(now - self.last)
            self.m.tpot_m.observe(now - self.last)
        self.last = now

    def finish(self, reasons: list[str | None], prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        e2e = time.monotonic() - self.start
        self.m.e2e_m.observe(e2e)
        L = self.m.labels
        for r in reasons:
            self.m.request_success.labels(finished_reason=r or "abort", **L).inc()
        self.m.request_prompt.labels(**L).observe(prompt_tokens)
        self.m.request_generation.labels(**L).observe(generated_tokens)
        if self.first is not None:  # the phases, as vLLM splits a request's time
            self.m.inference.labels(**L).observe(max(0.0, e2e - self.queued))
            self.m.prefill.labels(**L).observe(max(0.0, self.first - self.queued))
            self.m.decode.labels(**L).observe(max(0.0, e2e - self.first))


def startup_pending(exposition: str) -> bool | None:
    """Whether a /metrics page's cpuserve:startup_work_pending says start-up work is left for the
    engine's idle time; None where the page has no such gauge (another server)."""
    for line in exposition.splitlines():
        name, _, rest = line.partition("{")
        if name == "cpuserve:startup_work_pending":
            return float(rest.rpartition("}")[2]) != 0
    return None


def step_totals(exposition: str) -> dict[str, dict[str, float]]:
    """{kind: {"steps", "seconds", "tokens"}} from a /metrics page's cpuserve:engine_step* counters
    (for a client that takes deltas over a window: benchmarks/serving.py); {} where it has none."""
    names = {"cpuserve:engine_steps_total": "steps", "cpuserve:engine_step_seconds_total": "seconds",
             "cpuserve:engine_step_tokens_total": "tokens"}
    out: dict[str, dict[str, float]] = {}
    for line in exposition.splitlines():
        name, _, rest = line.partition("{")
        if name not in names:
            continue
        labels, _, value = rest.partition("}")
        kind = next(p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("kind="))
        out.setdefault(kind, {})[names[name]] = float(value)
    return out


def stats_line(prev, cur, seconds: float) -> str:
    """vLLM's periodic stats line over an interval of `seconds` between two CoreStats snapshots:
    prompt and generation tokens a second, the batch and the queue, the KV cache's use, the prefix
    cache's hit rate over the interval's lookups."""
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    return (f"Avg prompt throughput: {(cur.prompt_tokens - prev.prompt_tokens) / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {(cur.generation_tokens - prev.generation_tokens) / seconds:.1f} tokens/s, "
            f"Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, "
            f"KV cache usage: {100 * cur.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")


def idle(prev, cur) -> bool:
    """Nothing ran between the snapshots and nothing is left to run."""
    return (cur.steps == prev.steps and cur.num_running == 0 and cur.num_waiting == 0)


def stats_interval() -> float:
    """Seconds between stats lines: VLLM_LOG_STATS_INTERVAL, as vLLM (default 10)."""
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got {raw!r}")
    return value


async def log_stats(engine, interval: float, log: logging.Logger, sleep=asyncio.sleep) -> None:
    """Logs a stats line every `interval` seconds while the engine works, and the first interval
    after it goes idle; an idle server logs nothing (as vLLM, to keep quiet logs quiet)."""
    prev, t, was_idle = engine.stats, time.monotonic(), True
    while True:
        await sleep(interval)
        cur, now = engine.stats, time.monotonic()
        quiet = idle(prev, cur)
        if not (quiet and was_idle):
            log.info("%s", stats_line(prev, cur, max(now - t, 1e-6)))
        prev, t, was_idle = cur, now, quiet
