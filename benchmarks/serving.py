"""`make bench`, serving part: the running server under a concurrency sweep.

For each concurrency C (1, 4, 16, 64), C clients stream completions back to back
(prompt of 128 random token ids, 128 output tokens, greedy, ignore_eos) over
loopback; then 4 clients with 1,024 output tokens (long streams: what the API
process spends a token must not grow with the output). Reported per level: time
to first token and inter-token latency (p50/p99), output tokens/s, and the API
process's CPU time per output token (on a machine with few cores, CPU the
engine's threads lose), and the client's own. The client is aiohttp's, as vLLM's
benchmark_serving: on the 2-CPU build VM httpx's streaming client took 100-180 us of
CPU an output token, aiohttp's 37-62, CPU the server under test loses beside it. Batch-1 inter-token latency is also set against the
offline engine's decode latency measured in the same process tree, which is
what the API process adds per token. Writes docs/bench/serving.{md,json,png}.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

import readme_tables

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench"
LEVELS = [int(x) for x in os.environ.get("BENCH_CONCURRENCY", "1,4,16,64").split(",")]
INPUT_LEN, OUTPUT_LEN = 128, 128
LONG = (4, 1024)  # streams, output tokens each


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def start_server(dtype: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    weights = ["--quantization", "gguf"] if dtype == "gguf" else ["--dtype", dtype, "--quantization", "none"]
    proc = subprocess.Popen([sys.executable, "-m", "cpuserve", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *weights, *os.environ.get("BENCH_SERVER_ARGS", "").split()],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server failed:\n{log.read().decode()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def wait_settled(url: str, limit_s: float = 300) -> float | None:
    """Waits until a cpuserve server has done the start-up work it leaves for its idle time (the
    weights' and KV cache's huge pages, the cache's pages populated: its /metrics'
    cpuserve:startup_work_pending at 0), so that the levels measure the server as it runs from
    then on, not its first minute (16 float32 streams on the Zen 4 VM: 1.06x the tok/s settled);
    the peers do all theirs before they answer /health. Returns the seconds waited; None for a
    server without that gauge."""
    from cpuserve.entrypoints.openai.metrics import startup_pending

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        pending = startup_pending(httpx.get(url + "/metrics", timeout=30).text)
        if not pending:
            return None if pending is None else time.perf_counter() - t0
        time.sleep(0.2)
    raise RuntimeError(f"{url}: the server's start-up work was not done {limit_s:.0f} s after it was ready")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int],
                      output_len: int = OUTPUT_LEN) -> dict:
    """One streamed completion: its time to the first token with text, the gaps between the
    following ones, and when it started and ended (perf_counter)."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{url}: a streamed completion came back with no text")
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "end": stamps[-1],
            "start": t0}


def engine_steps(url: str) -> dict[str, dict[str, float]]:
    """cpuserve's step counters by kind (metrics.step_totals) from its /metrics now."""
    from cpuserve.entrypoints.openai.metrics import step_totals
    return step_totals(httpx.get(url + "/metrics", timeout=30).text)


def step_profile(before: dict, after: dict, wall: float) -> dict:
    """Where the engine's time went over a window of `wall` seconds, from its step counters before
    and after: per kind its steps, their mean ms and mean tokens; `busy`: the steps' share of the
    window (the rest: the engine waiting for requests or for its own loop)."""
    kinds = {}
    for kind, now in after.items():
        n = now["steps"] - before[kind]["steps"]
        sec = now["seconds"] - before[kind]["seconds"]
        kinds[kind] = {"steps": n, "seconds": sec, "ms": sec / n * 1e3 if n else 0.0,
                       "tokens": (now["tokens"] - before[kind]["tokens"]) / n if n else 0.0}
    return {"kinds": kinds, "busy": sum(k["seconds"] for k in kinds.values()) / wall}


async def level(url: str, concurrency: int, prompts: list[list[int]], keepalive: bool = True,
                output_len: int = OUTPUT_LEN, server_pid: int | None = None) -> dict:
    """`keepalive=False`: a new connection per request (llama-server closes a connection after a
    streamed response, and a reused one then fails). With `server_pid` (cpuserve's own server),
    that process's CPU time per output token and the engine's steps by kind (the timed part only).
    The client's own CPU a token (this process's, the timed part) comes with every level."""
    per_client = max(1, 4 // concurrency) if concurrency < 4 else (2 if concurrency <= 16 else 1)
    results = []

    async def client_loop(c, i):
        for k in range(per_client):
            results.append(await one_request(c, url, prompts[(i * per_client + k) % len(prompts)], output_len))

    connector = aiohttp.TCPConnector(limit=0, force_close=not keepalive)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as c:
        await one_request(c, url, prompts[0], output_len)  # warm-up
        cpu0 = cpu_seconds(server_pid) if server_pid else 0.0
        steps0 = engine_steps(url) if server_pid else None
        client0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client_loop(c, i) for i in range(concurrency)))
        wall, client = time.perf_counter() - t0, time.process_time() - client0
        cpu = cpu_seconds(server_pid) - cpu0 if server_pid else None
        steps = step_profile(steps0, engine_steps(url), wall) if server_pid else None
    ttft = [r["ttft"] * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r["itl"]]
    tokens = len(results) * output_len
    return {"concurrency": concurrency, "output_len": output_len, "requests": len(results), "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "api_cpu_us_per_token": cpu / tokens * 1e6 if cpu is not None else None,
            "client_cpu_us_per_token": client / tokens * 1e6, "engine_steps": steps}


def offline_decode_ms(dtype: str) -> float:
    kw = "quantization='gguf'" if dtype == "gguf" else f"dtype={dtype!r},quantization='none'"
    code = ("import time,torch;from cpuserve import LLM,SamplingParams;llm=LLM(%s);e=llm.engine;"
            "e.add_request('x',list(range(1000,1128)),SamplingParams(temperature=0,max_tokens=%d,ignore_eos=True));"
            "e.step();t=time.perf_counter();n=0\nwhile e.has_unfinished_requests(): e.step();n+=1\n"
            "print((time.perf_counter()-t)/n*1e3)") % (kw, OUTPUT_LEN)
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.strip().splitlines()[-1])


def main() -> None:
    import torch
    dtype = os.environ.get("BENCH_DTYPE", "gguf")  # gguf: the default model's Q4_1 blocks
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49000, (INPUT_LEN,), generator=g).tolist() for _ in range(128)]
    proc, url = start_server(dtype)
    try:
        settled = wait_settled(url)
        print(f"[serving] start-up work done {settled:.1f} s after ready", flush=True)
        rows = []
        for c, n in [(c, OUTPUT_LEN) for c in LEVELS] + [LONG]:
            rows.append(asyncio.run(level(url, c, prompts, output_len=n, server_pid=proc.pid)))
            r = rows[-1]
            print(f"[serving c={c}, {n} out] {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.0f} ms, "
                  f"ITL p50 {r['itl_p50']:.1f} ms, API CPU {r['api_cpu_us_per_token']:.0f} us/token", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    offline = offline_decode_ms(dtype)
    write(rows, offline, dtype)


def served_step_note(one: dict, offline_ms: float) -> str:
    """How much of the 1-stream overhead is the engine's own decode step (from its step counters)
    running slower beside the API process and the client, rather than latency the API adds."""
    p = one.get("engine_steps")
    if not p or not p["kinds"]["decode"]["steps"]:
        return ""
    ms = p["kinds"]["decode"]["ms"]
    return (f" The engine's decode steps in that row took {ms:.2f} ms ({ms - offline_ms:+.2f} against offline: "
            f"the same CPUs shared with the API process and the client); the API's latency the other "
            f"{one['itl_p50'] - ms:+.2f} ms.")


def step_table(rows: list[dict]) -> list[str]:
    """Where the engine's time went at each level (the server's cpuserve:engine_step* counters)."""
    out = ["Where the engine's time went in each row (the server's `cpuserve:engine_step_*` counters over "
           "the timed part): the share of the wall time spent in steps, and per kind of step their number, "
           "mean ms and mean tokens (decode: only sequences decoding, one row each; mixed: prompt tokens "
           "and decode rows together; prefill: prompt tokens only).", "",
           "| concurrency | output tokens | in steps | decode steps: n / ms / rows | mixed: n / ms / tokens | "
           "prefill: n / ms / tokens |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("engine_steps"):
            out.append(f"| {r['concurrency']} | {r['output_len']:,} | " + " | ".join(step_cells(r["engine_steps"])) + " |")
    return out


def step_cells(p: dict) -> list[str]:
    """A step profile (step_profile) as table cells: the share of the wall time in steps, then
    n / mean ms / mean tokens for decode, mixed and prefill steps."""
    return [f"{100 * p['busy']:.0f}%"] + [f"{k['steps']:.0f} / {k['ms']:.1f} / {k['tokens']:.1f}" if k["steps"] else "0"
                                          for k in (p["kinds"][kind] for kind in ("decode", "mixed", "prefill"))]


def write(rows: list[dict], offline_ms: float, dtype: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    one = next((r for r in rows if r["concurrency"] == 1), None)
    sweep = [r for r in rows if r["output_len"] == OUTPUT_LEN]  # the plot: the concurrency sweep
    weights = "its Q4_1 blocks" if dtype == "gguf" else f"{dtype} weights"
    lines = ["# Serving benchmark (`make bench`)", "",
             f"Machine: {readme_tables.cpu_name()}, {os.cpu_count()} CPUs; {readme_tables.run_stamp()}. "
             f"`cpuserve serve` ({weights}) on the default model, streaming completions over loopback: "
             f"{INPUT_LEN}-token prompts (random ids), {OUTPUT_LEN} greedy output tokens ({LONG[1]:,} in the last "
             f"row), C concurrent clients sending back to back. API CPU: the API process's CPU time per output token "
             f"(on this {os.cpu_count()}-CPU machine, time the engine's threads lose); client CPU: the "
             f"benchmark's own client's (aiohttp), which shares the same CPUs. The levels start once the "
             f"server has done the start-up work it leaves for idle time (`cpuserve:startup_work_pending` 0).", "",
             "| concurrency | output tokens | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "ITL p99 ms | API CPU us/token | client CPU us/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['output_len']:,} | {r['requests']} | {r['tok_s']:.1f} | "
                     f"{r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} | {r['itl_p99']:.1f} | "
                     f"{r['api_cpu_us_per_token']:.0f} | {r['client_cpu_us_per_token']:.0f} |")
    if one:
        lines += ["", f"API process overhead per token at 1 stream: ITL p50 {one['itl_p50']:.2f} ms served vs "
                  f"{offline_ms:.2f} ms offline decode step = {one['itl_p50'] - offline_ms:+.2f} ms." +
                  served_step_note(one, offline_ms)]
    lines += ["", *step_table(rows)]
    lines += ["", "vLLM's OpenAI server and `llama-server` on the same client, model and machine, run side by side "
              "with `cpuserve serve`: `make bench-peers` (docs/bench/PEERS.md).", ""]
    (OUT / "serving.md").write_text("\n".join(lines))
    readme_tables.update("serving", lines[2:])
    (OUT / "serving.json").write_text(json.dumps({"levels": rows, "offline_decode_ms": offline_ms}, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cs = [r["concurrency"] for r in sweep]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    axes[0].plot(cs, [r["tok_s"] for r in sweep], "o-")
    axes[0].set_title("output tokens/s")
    axes[1].plot(cs, [r["ttft_p50"] for r in sweep], "o-", label="p50")
    axes[1].plot(cs, [r["ttft_p99"] for r in sweep], "s--", label="p99")
    axes[1].set_title("time to first token (ms)")
    axes[2].plot(cs, [r["itl_p50"] for r in sweep], "o-", label="p50")
    axes[2].plot(cs, [r["itl_p99"] for r in sweep], "s--", label="p99")
    axes[2].set_title("inter-token latency (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
    axes[1].legend()
    axes[2].legend()
    fig.suptitle(f"cpuserve serve, SmolLM2-135M {dtype}, {os.cpu_count()} CPUs")
    fig.tight_layout()
    fig.savefig(OUT / "serving.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
