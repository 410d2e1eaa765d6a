"""The periodic stats line vLLM's server logs: its figures over an interval, silence while
idle, its interval from VLLM_LOG_STATS_INTERVAL, and on the real server while it works."""
import asyncio
import logging
import time
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest

from cpuserve.engine.outputs import CoreStats
from cpuserve.entrypoints.openai.metrics import idle, log_stats, stats_interval, stats_line
from tests.engine.entrypoints.openai.conftest import Server

BEFORE = CoreStats(prompt_tokens=100, generation_tokens=50, prefix_cache_queries=64, prefix_cache_hits=0, steps=7)


def test_the_line_gives_the_intervals_rates_and_the_current_state():
    after = replace(BEFORE, prompt_tokens=1100, generation_tokens=250, prefix_cache_queries=264,
                    prefix_cache_hits=150, steps=40, num_running=3, num_waiting=2, kv_cache_usage=0.125)
    assert stats_line(BEFORE, after, 10.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 75.0%")
    assert "Prefix cache hit rate: 0.0%" in stats_line(BEFORE, BEFORE, 10.0)  # no lookups: no rate


def test_idle_means_no_step_and_nothing_queued():
    assert idle(BEFORE, BEFORE)
    assert not idle(BEFORE, replace(BEFORE, steps=8))
    assert not idle(BEFORE, replace(BEFORE, num_waiting=1))


def test_a_busy_interval_is_logged_then_the_first_idle_one_then_nothing(caplog):
    engine = SimpleNamespace(stats=BEFORE)
    busy = [replace(BEFORE, steps=8, generation_tokens=60), replace(BEFORE, steps=9, generation_tokens=70)]
    intervals = iter([BEFORE, *busy, busy[-1], busy[-1], busy[-1]])  # idle, busy twice, idle three times

    async def sleep(_):  # each interval ends with the engine's next snapshot
        try:
            engine.stats = next(intervals)
        except StopIteration:
            raise asyncio.CancelledError from None

    with caplog.at_level(logging.INFO, logger="test.stats"), pytest.raises(asyncio.CancelledError):
        asyncio.run(log_stats(engine, 10.0, logging.getLogger("test.stats"), sleep))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # the two busy intervals and the one that saw the work end
    assert ["Avg generation throughput: 0.0 tokens/s" in line for line in lines] == [False, False, True]


@pytest.mark.parametrize("value, want", [(None, 10.0), ("2.5", 2.5)])
def test_the_interval_is_vllms_variable(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
    assert stats_interval() == want


@pytest.mark.parametrize("value", ["0", "-3", "ten"])
def test_a_bad_interval_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL must be a positive number of seconds"):
        stats_interval()


def test_the_server_logs_its_stats_while_it_works():
    s = Server(env={"VLLM_LOG_STATS_INTERVAL": "0.5"})
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Count:", "max_tokens": 40, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200
        time.sleep(1.2)  # an interval ends after the request
    finally:
        log = s.stop()
    stats = [line for line in log.splitlines() if "cpuserve.stats" in line]
    assert stats and any("Avg generation throughput" in line and " 0.0 tokens/s, Running" not in line
                         for line in stats), log[-3000:]
