"""Soak drill: mixed traffic at twice the rate the server sustains, against a real
`cpuserve serve` on loopback, with a KV cache small enough to force preemption.

  python -m tests.engine.entrypoints.openai.soak --minutes 20 --out docs/reliability/soak.json

The mix: short and long prompts, prompts sharing a prefix, streaming and not, n = 1
and 2, clients that cancel at a random moment and streams dropped midway. What it
checks (see `verdict`): every request ends in a completion or a clean error (a JSON
4xx/503), none hangs; the RSS of the API process and the engine core stays within a
bound after warm-up; every KV block is free again when idle; the server's counters
agree with the client's. Bounded in count and time; loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.engine.entrypoints.openai.conftest import Server

SERVER_ARGS = ("--kv-cache-space", "0.05", "--max-waiting-requests", "32", "--max-model-len", "1024")
PREFIX = ("You are a helpful assistant for a bakery. Answer in one or two sentences, politely, and never "
          "invent prices. ") * 3
REQUEST_TIMEOUT_S = 120.0   # a request still open after this long counts as hung
RSS_BOUND_MIB = 128         # growth allowed after warm-up, per process


@dataclass
class Tally:
    ok: int = 0
    ok_choices: int = 0                           # vllm:request_success counts completions (choices)
    left_choices: int = 0                         # choices of requests the client cancelled or dropped
    ok_tokens: int = 0
    rejected: dict = field(default_factory=dict)  # status -> count (clean JSON errors)
    cancelled: int = 0
    dropped: int = 0                              # streams the client closed midway
    bad: list = field(default_factory=list)       # anything else: 5xx, hangs, malformed


def make_request(rng: random.Random, i: int) -> tuple[str, dict, str]:
    """(path, body, client behaviour) for the i-th request of the mix."""
    long = rng.random() < 0.3
    topic = f"order {i}: {rng.choice(['bread', 'croissants', 'a cake', 'cookies', 'rye'])}"
    text = PREFIX + (f"Describe in detail how {topic} is made. " * (8 if long else 1))
    body = {"max_tokens": rng.choice([8, 32, 96]), "temperature": rng.choice([0, 0.8]), "n": rng.choice([1, 1, 2]),
            "stream": rng.random() < 0.5, "ignore_eos": True}
    if rng.random() < 0.5:
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {**body, "prompt": text}
    behaviour = rng.choices(["wait", "cancel", "drop"], [0.8, 0.1, 0.1])[0]
    return path, body, behaviour


async def one(client: httpx.AsyncClient, url: str, path: str, body: dict, behaviour: str, rng, tally: Tally):
    try:
        if behaviour == "cancel":
            await asyncio.wait_for(_send(client, url, path, body, False, tally), rng.uniform(0.05, 3.0))
        else:
            await asyncio.wait_for(_send(client, url, path, body, behaviour == "drop", tally), REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        if behaviour == "cancel":
            tally.cancelled += 1
            tally.left_choices += body["n"]
        else:
            tally.bad.append(f"hung: {path} {json.dumps(body)[:120]}")
    except httpx.HTTPError as e:
        tally.bad.append(f"transport error: {type(e).__name__}: {e}")


async def _send(client, url, path, body, drop: bool, tally: Tally):
    if not body["stream"]:
        r = await client.post(url + path, json=body)
        return _judge(r.status_code, r.text, tally, body)
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return _judge(r.status_code, (await r.aread()).decode(), tally, body)
        done, finished, chunks = False, set(), 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                obj = json.loads(line[6:])
                if "error" in obj:
                    return _judge(obj["error"].get("code") or 500, line[6:], tally, body)
                chunks += 1
                finished |= {c["index"] for c in obj["choices"] if c.get("finish_reason")}
                if drop and chunks >= 3:
                    tally.dropped += 1
                    tally.left_choices += body["n"]
                    return
        n = body["n"]
        if done and len(finished) == n:
            tally.ok += 1
            tally.ok_choices += n
        else:
            tally.bad.append(f"stream ended without [DONE] or finish reasons: {path}")


def _judge(status: int, text: str, tally: Tally, body: dict) -> None:
    if status == 200:
        obj = json.loads(text)
        if all(c.get("finish_reason") for c in obj["choices"]) and len(obj["choices"]) == body["n"]:
            tally.ok += 1
            tally.ok_choices += body["n"]
            tally.ok_tokens += obj["usage"]["completion_tokens"]
            return
        tally.bad.append(f"200 without finish reasons: {text[:200]}")
    elif status in (400, 413, 429, 503):
        try:
            json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            tally.bad.append(f"{status} without an OpenAI error body: {text[:200]}")
            return
        tally.rejected[status] = tally.rejected.get(status, 0) + 1
    else:
        tally.bad.append(f"status {status}: {text[:200]}")


async def sustainable_rate(url: str, seconds: float, concurrency: int = 8) -> float:
    """Requests per second the server completes with `concurrency` clients in a closed loop."""
    rng, done, t_end = random.Random(1), 0, time.monotonic() + seconds

    async def worker(k):
        nonlocal done
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as c:
            while time.monotonic() < t_end:
                path, body, _ = make_request(rng, k)
                r = await c.post(url + path, json={**body, "stream": False})
                done += r.status_code == 200
    t0 = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.monotonic() - t0)


async def drive(url: str, rate: float, seconds: float, pids: list[int], seed: int = 0):
    """Open-loop arrivals at `rate` per second (Poisson) for `seconds`; samples RSS."""
    rng, tally, tasks, rss, i = random.Random(seed), Tally(), [], {p: [] for p in pids}, 0
    procs = {p: psutil.Process(p) for p in pids}
    t0 = time.monotonic()
    next_sample = t0
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64)) as client:
        while time.monotonic() - t0 < seconds:
            path, body, behaviour = make_request(rng, i)
            tasks.append(asyncio.create_task(one(client, url, path, body, behaviour, rng, tally)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
            if time.monotonic() >= next_sample:
                for p, proc in procs.items():
                    rss[p].append((round(time.monotonic() - t0, 1), proc.memory_info().rss))
                next_sample += 5.0
        await asyncio.gather(*tasks)
    return tally, rss, i


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def idle_metrics(url: str) -> dict[str, float]:
    """Metrics once the server is idle (the core reports its stats after each step,
    so a one-token request carries the final state out)."""
    deadline = time.monotonic() + 60
    while True:
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
        m = metrics(url)
        if m.get("vllm:num_requests_running", 1) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def run(minutes: float, seed: int = 0) -> dict:
    s = Server(*SERVER_ARGS)
    try:
        api = psutil.Process(s.proc.pid)
        core = next(c for c in api.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())
                    and "resource_tracker" not in " ".join(c.cmdline()))
        calib = min(30.0, 60 * minutes / 4)
        rate = asyncio.run(sustainable_rate(s.url, calib))
        before = metrics(s.url)
        tally, rss, sent = asyncio.run(drive(s.url, 2 * rate, 60 * minutes - calib, [api.pid, core.pid], seed))
        after = idle_metrics(s.url)
        return report(minutes, rate, tally, rss, sent, before, after, {api.pid: "api", core.pid: "engine core"})
    finally:
        s.stop()


def report(minutes, rate, tally: Tally, rss, sent, before, after, names) -> dict:
    def growth(samples):
        warm = samples[len(samples) // 4:] or samples
        return (max(v for _, v in warm) - warm[0][1]) / 2**20
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        "minutes": minutes, "sustainable_rps": round(rate, 2), "offered_rps": round(2 * rate, 2), "sent": sent,
        "ok": tally.ok, "ok_choices": tally.ok_choices, "left_choices": tally.left_choices, "rejected": tally.rejected, "cancelled": tally.cancelled, "dropped": tally.dropped,
        "bad": tally.bad[:20], "bad_count": len(tally.bad),
        "rss_growth_mib_after_warmup": {names[p]: round(growth(v), 1) for p, v in rss.items()},
        "rss_mib_last": {names[p]: round(v[-1][1] / 2**20, 1) for p, v in rss.items() if v},
        "rss_bound_mib": RSS_BOUND_MIB,
        "idle": {k: after.get(k, 0) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                              "vllm:kv_cache_usage_perc")},
        "server_finished": delta.get("vllm:request_success_total", 0),
        "server_generation_tokens": delta.get("vllm:generation_tokens_total", 0),
        "client_ok_tokens_nonstreamed": tally.ok_tokens,
        "preemptions": delta.get("vllm:num_preemptions_total", 0),
    }


def verdict(r: dict) -> list[str]:
    """What is wrong with a soak report (empty: the drill passed)."""
    wrong = []
    if r["bad_count"]:
        wrong.append(f"{r['bad_count']} requests ended badly: {r['bad'][:5]}")
    for who, mib in r["rss_growth_mib_after_warmup"].items():
        if mib > r["rss_bound_mib"]:
            wrong.append(f"{who} RSS grew {mib} MiB after warm-up (bound {r['rss_bound_mib']})")
    if any(r["idle"].values()):
        wrong.append(f"not idle afterwards: {r['idle']}")
    # the server counts each completion of a request once its last output is out: every choice
    # the client got, plus those of cancelled or dropped requests that finished before the
    # client left (+1: the idle probe)
    if not r["ok_choices"] <= r["server_finished"] - 1 <= r["ok_choices"] + r["left_choices"]:
        wrong.append(f"server finished {r['server_finished'] - 1} completions, the client got {r['ok_choices']} "
                     f"and left {r['left_choices']}")
    if r["server_generation_tokens"] < r["client_ok_tokens_nonstreamed"]:
        wrong.append("the server counted fewer generated tokens than the client received")
    return wrong


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report here as JSON")
    a = ap.parse_args()
    r = run(a.minutes, a.seed)
    r["verdict"] = verdict(r) or "passed"
    text = json.dumps(r, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0 if r["verdict"] == "passed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
