"""`make bench-peers`: cpuserve against vLLM's CPU backend, llama.cpp and transformers on the
same model and the same workloads, in one run on one machine.

Peers are installed by `hack/peers/install.sh` into a cache outside the clone
(CPUSERVE_PEERS_CACHE, default ~/.cache/cpuserve-peers), tuned as their own docs say
(../shared/reference/peers.md): vLLM gets both cores (VLLM_CPU_OMP_THREADS_BIND=0-N,
no reserved CPU), 4 GiB of KV cache and its preloads (libiomp5, tcmalloc when installed);
llama.cpp runs its own tools with all threads.

The model: the default SmolLM2-135M-Instruct. cpuserve and llama.cpp read its Q4_1 GGUF and
Q8_0 / Q4_K_M / F32 files made from it with llama-quantize, cpuserve in their blocks ("cpuserve
Q4_1") and widened to float32 or bfloat16 ("cpuserve float32"); vLLM and transformers read the
same float32 weights as a Hugging Face directory (written by `cpuserve convert`-style widening).
Both cpuserve and vLLM also read an INT8 W8A8 checkpoint made from the same weights (`cpuserve
quantize --method w8a8`: compressed-tensors' layout, per-channel int8 weights, activations
quantized per token at run time, bfloat16 elsewhere): the "W8A8" rows.

Workloads (benchmarks/peer_offline.py for the Python engines): offline 64 x 128/128 greedy
with EOS ignored; batch-1 decode ms/token; a 2,048-token prompt's prefill; serving at
concurrency 1/4/16/64 (benchmarks/serving.py's client); start to first /health 200 (cold:
the first start in this run, warm: the next); peak RSS. Every figure is min/median over
REPEATS runs; cpuserve's and vLLM's offline runs on the same weights take turns (taking_turns),
so do their float32 served levels (serve_in_turns), their 2,048-token prefills prompt by prompt
with both engines up (prefill_in_turns, PEERS_PREFILL_ROUNDS) and the batch-1 runs of cpuserve
and llama.cpp (alternating_batch1). Writes
docs/bench/PEERS.md, peers.json and peers.png.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import readme_tables
import serving

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench"
CACHE = Path(os.environ.get("CPUSERVE_PEERS_CACHE", Path.home() / ".cache" / "cpuserve-peers"))
VLLM_VERSION, LLAMA_VERSION = "0.32.0", "0.3.36"
REPEATS = int(os.environ.get("PEERS_REPEATS", "2"))
LEVELS = [int(x) for x in os.environ.get("PEERS_CONCURRENCY", "1,4,16,64").split(",")]
THREADS = len(os.sched_getaffinity(0))


# -- where things are ---------------------------------------------------------------------------
def vllm_python() -> Path:
    return CACHE / f"vllm-cpu-{VLLM_VERSION}" / "venv" / "bin" / "python"


def llama_bin() -> Path:
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if re.match(r"^(flags|Features)", ln))
    digest = hashlib.sha256((flags + "\n").encode()).hexdigest()[:12]
    return CACHE / f"llama.cpp-{LLAMA_VERSION}-{digest}" / "bin"


def models() -> tuple[Path, Path]:
    """(the default Q4_1 GGUF, a Hugging Face directory of the same weights widened to float32
    for vLLM and transformers, written once into the peers cache)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from cpuserve.loading.gguf_loader import GGUFTensors
    from cpuserve.loading.model_loader import default_model_path, resolve
    gguf, meta = default_model_path(), Path(resolve(None))
    out = CACHE / "models" / f"smollm2-135m-hf-f32-{gguf.stat().st_size:x}"
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(meta, tmp, ignore=shutil.ignore_patterns("gguf_tensors.json", "cpuserve_source.json"))
        tensors = GGUFTensors(meta, dequantize=True)
        save_file({n: tensors.pop(n).to(torch.float32).contiguous() for n in list(tensors)}, str(tmp / "model.safetensors"))
        tmp.rename(out)
    return gguf, out


def llama_files(gguf: Path) -> dict[str, Path]:
    out = {"Q4_1": gguf}
    for kind in ("F32", "Q8_0", "Q4_K_M"):
        f = CACHE / "models" / f"smollm2-135m-{kind.lower()}.gguf"
        if not f.exists():
            f.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(llama_bin() / "llama-quantize"), "--allow-requantize", str(gguf), str(f), kind,
                            str(THREADS)], check=True, capture_output=True)
        out[kind] = f
    return out


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    pre = [p for p in (vllm_python().parent.parent / "lib" / "libiomp5.so",
                       Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")) if p.exists()]
    if pre:
        env["LD_PRELOAD"] = ":".join(map(str, pre))
    return env


# -- offline --------------------------------------------------------------------------------------
def offline_process(engine: str) -> tuple[str, dict]:
    """The interpreter and environment that run peer_offline.py for an engine: vLLM's virtualenv and
    tuning, or the project's (transformers: torch's threads unbound)."""
    if engine == "vllm":
        return str(vllm_python()), vllm_env()
    return sys.executable, dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind")


def python_offline(engine: str, dtype: str, model: Path, skip_prefill: bool = False, batch1_only: bool = False) -> dict:
    py, env = offline_process(engine)
    args = [py, str(ROOT / "benchmarks" / "peer_offline.py"), engine, str(model), dtype] + \
        (["--skip-prefill"] if skip_prefill else []) + (["--batch1-only"] if batch1_only else [])
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd="/tmp", timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"{engine} {dtype} failed ({r.returncode}): {r.stderr[-1500:]}")
    return json.loads(line[7:])


def llama_offline(gguf: Path) -> dict:
    b = llama_bin()
    t = str(THREADS)

    r = subprocess.run([str(b / "llama-batched-bench"), "-m", str(gguf), "-t", t, "-tb", t, "-c", "17000", "-b",
                        "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", "64"],
                       capture_output=True, text=True, check=True, timeout=3600)
    row = [ln for ln in r.stdout.splitlines() if re.match(r"^\|\s+128\s+\|\s+128\s+\|\s+64\s+\|", ln)][-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    total_s = float(cells[8])  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    return {"offline_tok_s": 64 * 128 / total_s, "batch1_ms": llama_batch1_ms(gguf),
            "prefill_2048_s": 2048 / llama_bench(gguf, 2048, 0)}


def llama_bench(gguf: Path, p: int, n: int) -> float:
    """llama-bench's tokens/s for a p-token prompt or n generated tokens, mean of 3 repetitions."""
    r = subprocess.run([str(llama_bin() / "llama-bench"), "-m", str(gguf), "-t", str(THREADS), "-p", str(p), "-n",
                        str(n), "-r", "3", "-o", "json"], capture_output=True, text=True, check=True, timeout=1800)
    return float(json.loads(r.stdout)[0]["avg_ts"])


def llama_batch1_ms(gguf: Path) -> float:
    return 1e3 / llama_bench(gguf, 0, 128)


def alternating_batch1(gguf: Path, rounds: int = int(os.environ.get("PEERS_BATCH1_ROUNDS", "5"))) -> dict:
    """Batch-1 decode of cpuserve and llama.cpp on the same weights (float32, Q4_1), the engines
    taking turns round by round: each round's runs meet the same minute of this machine's memory
    bandwidth, which the one-engine-at-a-time table cannot promise. {name: {batch1_ms, read_gbs:
    [min, median], rounds: [[ms, GB/s], ...] in order}}: every round is kept, so that a median
    that met slow minutes can be read run by run."""
    f32 = llama_files(gguf)["F32"]
    engines = {"cpuserve float32": lambda: python_offline("cpuserve", "float32", gguf, batch1_only=True)["batch1_ms"],
               "llama.cpp F32": lambda: llama_batch1_ms(f32),
               "cpuserve Q4_1": lambda: python_offline("cpuserve", "gguf", gguf, batch1_only=True)["batch1_ms"],
               "llama.cpp Q4_1": lambda: llama_batch1_ms(gguf)}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, fn in engines.items():
            before = read_gbs()
            ms = fn()
            runs[name].append((ms, max(before, read_gbs())))
    return {name: {**{key: [min(r[i] for r in rs), statistics.median(r[i] for r in rs)]
                      for i, key in enumerate(("batch1_ms", "read_gbs"))}, "rounds": [list(r) for r in rs]}
            for name, rs in runs.items()}


PREFILL_ROUNDS = int(os.environ.get("PEERS_PREFILL_ROUNDS", "10"))


class PrefillWorker:
    """An engine up and idle in `peer_offline.py --prefill-turns`: one new 2,048-token prompt to its
    first token each time it is asked. A worker that dies, or answers nothing in 15 minutes, raises
    with the tail of its stderr."""

    def __init__(self, engine: str, dtype: str, model: Path):
        py, env = offline_process(engine)
        self.name, self.err = f"{engine} {dtype}", tempfile.TemporaryFile()
        self.proc = subprocess.Popen([py, str(ROOT / "benchmarks" / "peer_offline.py"), engine, str(model), dtype,
                                      "--prefill-turns"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env, cwd="/tmp")
        self.pid = self.proc.pid
        self.expect("READY")

    def expect(self, word: str) -> str:
        import threading
        watchdog = threading.Timer(900, self.proc.kill)
        watchdog.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(word):
                    return line
        finally:
            watchdog.cancel()
        self.proc.wait()
        self.err.seek(0)
        tail = self.err.read().decode(errors="replace")[-1500:]
        raise RuntimeError(f"{self.name} prefill worker ended ({self.proc.returncode}) before {word}: {tail}")

    def prefill(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.expect("PREFILL").split()[1])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def prefill_in_turns(engines: dict, rounds: int = PREFILL_ROUNDS) -> dict:
    """The 2,048-token prefill of engines on the same weights taking turns prompt by prompt, every
    engine up (PrefillWorker): a prefill takes 0.5-3 s here, so one engine's best of three after the
    other's meets other minutes of this machine (a run's float32 ratio moved 0.91x-1.09x between
    sittings). The order flips each round (A B, B A, ...); each prefill keeps the CPU seconds the idle
    engines used meanwhile. {name: {prefill_2048_s: [min, median], idle_cpu_s: most, rounds: [[s, idle
    CPU s], ...] in order}}."""
    up: dict[str, PrefillWorker] = {}
    try:
        for name, (engine, dtype, model) in engines.items():
            up[name] = PrefillWorker(engine, dtype, model)
        runs: dict[str, list[list[float]]] = {name: [] for name in up}
        for r in range(rounds):
            for name in list(up) if r % 2 == 0 else list(up)[::-1]:
                idle = [w.pid for n, w in up.items() if n != name]
                cpu0 = sum(map(tree_cpu_seconds, idle))
                s = up[name].prefill()
                runs[name].append([s, sum(map(tree_cpu_seconds, idle)) - cpu0])
        return {name: {"prefill_2048_s": [min(x[0] for x in rs), statistics.median(x[0] for x in rs)],
                       "idle_cpu_s": max(x[1] for x in rs), "rounds": rs} for name, rs in runs.items()}
    finally:
        for w in up.values():
            w.close()


# -- serving ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(engine: str, dtype: str, port: int, hf_dir: Path, gguf: Path) -> tuple[list[str], dict]:
    if engine == "cpuserve":  # dtype "gguf": the blocks as they are ("gguf-int8": with int8 activations), else widened
        quant = ["--quantization", "gguf"] if dtype.startswith("gguf") else ["--dtype", dtype, "--quantization", "none"]
        quant += ["--quantized-activations", "int8"] if dtype == "gguf-int8" else []
        return ([sys.executable, "-m", "cpuserve", "serve", "--host", "127.0.0.1", "--port", str(port)] + quant,
                dict(os.environ))
    if engine == "vllm":
        return ([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--dtype", dtype,
                 "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096", "--served-model-name", "model"],
                vllm_env())
    return ([str(llama_bin() / "llama-server"), "-m", str(gguf), "-t", str(THREADS), "-tb", str(THREADS), "--parallel",
             "16", "--cont-batching", "-c", "16384", "--port", str(port), "--host", "127.0.0.1", "--no-cache-prompt"],
            dict(os.environ))


def start(engine: str, dtype: str, hf_dir: Path, gguf: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    cmd, env = server_cmd(engine, dtype, port, hf_dir, gguf)
    log = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/tmp")
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < 600:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{engine} server exited:\n{log.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                proc.log = log
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{engine} did not become healthy in 600 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def served_prompts() -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(serving.INPUT_LEN)] for _ in range(256)]


class Served:
    """A server started cold, stopped, started again (warm) and settled: cpuserve's levels start
    once its start-up work left for idle time is done (the peers do theirs before they are ready),
    so that every engine is measured as it runs from then on."""

    def __init__(self, engine: str, dtype: str, hf_dir: Path, gguf: Path):
        self.engine = engine
        proc, _, self.cold = start(engine, dtype, hf_dir, gguf)
        stop(proc)
        self.proc, self.url, self.warm = start(engine, dtype, hf_dir, gguf)
        try:
            self.settled = self.guarded(lambda: serving.wait_settled(self.url)) if engine == "cpuserve" else None
        except Exception:
            stop(self.proc)
            raise

    def guarded(self, fn):
        """fn(), a failure carrying the server's log."""
        try:
            return fn()
        except Exception as e:
            self.proc.log.seek(0)
            raise RuntimeError(f"{e}; server log: {self.proc.log.read().decode(errors='replace')[-1500:]}") from e

    def level(self, concurrency: int, prompts: list[list[int]]) -> dict:
        """One level with the same client for all; cpuserve's own server also reports its step
        counters and API CPU."""
        pid = self.proc.pid if self.engine == "cpuserve" else None
        return self.guarded(lambda: asyncio.run(serving.level(self.url, concurrency, prompts, keepalive=False,
                                                              server_pid=pid)))

    def result(self, levels: list[dict]) -> dict:
        return {"ready_cold_s": self.cold, "ready_warm_s": self.warm, "settled_s": self.settled, "levels": levels}


def serve(engine: str, dtype: str, hf_dir: Path, gguf: Path) -> dict:
    prompts = served_prompts()
    s = Served(engine, dtype, hf_dir, gguf)
    try:
        return s.result([s.level(c, prompts) for c in LEVELS])
    finally:
        stop(s.proc)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and every process below it (a server's engine
    and worker processes); processes that end meanwhile drop out."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {pid}, True
    while grew:
        below = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= below
        grew = bool(below)
    total = 0.0
    for p in tree:
        try:
            total += serving.cpu_seconds(p)
        except (OSError, ValueError, IndexError):
            continue
    return total


def serve_in_turns(engines: dict, hf_dir: Path, gguf: Path) -> dict:
    """Served levels of engines on the same weights taking turns level by level: every server up
    (Served), then at each concurrency each engine's level in turn while the others wait idle, so
    that both sides of a ratio meet the same minutes of this machine. Each level keeps the CPU
    seconds the idle servers used meanwhile (`idle_cpu_s`): what they took from the measured one.
    {name: serve()'s result}."""
    prompts, up = served_prompts(), {}
    try:
        for name, (engine, dtype) in engines.items():
            up[name] = Served(engine, dtype, hf_dir, gguf)
        levels: dict[str, list[dict]] = {name: [] for name in up}
        for c in LEVELS:
            for name, s in up.items():
                idle = [o.proc.pid for n, o in up.items() if n != name]
                cpu0 = sum(map(tree_cpu_seconds, idle))
                lv = s.level(c, prompts)
                levels[name].append({**lv, "idle_cpu_s": sum(map(tree_cpu_seconds, idle)) - cpu0})
        return {name: s.result(levels[name]) for name, s in up.items()}
    finally:
        for s in up.values():
            stop(s.proc)


# -- the run and the report -------------------------------------------------------------------------
OFFLINE_KEYS = ("offline_tok_s", "batch1_ms", "prefill_2048_s", "peak_rss_mib", "ready_s")
HIGHER_IS_BETTER = {"offline_tok_s", "tok_s"}


def read_gbs() -> float:
    """The machine's read bandwidth now (bench.read_bandwidth; a shared machine's bandwidth moves
    with its neighbours' load, by up to 2x from minute to minute). In a child process: a buffer
    held here would count in the peak RSS of every engine started after it (a child's ru_maxrss
    starts from its parent's RSS at the fork)."""
    out = subprocess.run([sys.executable, "-c", "from cpuserve.entrypoints import bench; "
                          "print(bench.read_bandwidth())"], capture_output=True, text=True, check=True, timeout=300)
    return float(out.stdout.split()[-1])


def repeated(fn, n: int = REPEATS) -> dict:
    """{key: [min, median]} over n runs of fn (a dict of figures), each with the read bandwidth
    probed just before and after it (the better of the two: what the machine offered meanwhile)."""
    figures = taking_turns({"": fn}, n)[""]
    figures.pop("rounds")
    return figures


def taking_turns(engines: dict, n: int = REPEATS) -> dict:
    """repeated() for engines that take turns run by run (A, B, A, B, ...): each of a ratio's
    pairs of runs meets the same minutes of this machine, which one engine's runs after the
    other's cannot promise (a peer's offline level moved 1.27x between two sittings an hour apart
    on 2026-12-03, ours 1.19x). {name: {key: [min, median], ..., "rounds": [{key: figure}, ...]
    in order}}: every round is kept, so that each round's ratio can be read."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    before = read_gbs()  # one probe between two runs serves both
    for _ in range(n):
        for name, fn in engines.items():
            r = fn()
            after = read_gbs()
            runs[name].append({**r, "read_gbs": max(before, after)})
            before = after
    return {name: {**{k: [min(r[k] for r in rs), statistics.median(r[k] for r in rs)] for k in rs[0]
                      if all(isinstance(r.get(k), (int, float)) for r in rs)},
                   "rounds": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in rs]}
            for name, rs in runs.items()}


def attempt(results: dict, key: str, fn) -> None:
    print(f"[peers] {key} ...", flush=True)
    try:
        results[key] = fn()
    except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others' figures
        results[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(f"[peers] {key}: {json.dumps(results[key])[:400]}", flush=True)


def machine() -> dict:
    from cpuserve_topology import read_topology
    cpuinfo = Path("/proc/cpuinfo").read_text()
    name = readme_tables.cpu_name()
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if re.match(r"^(flags|Features)", ln)), [])
    keep = sorted(f for f in flags if re.match(r"^(avx|fma|f16c|amx|asimd|sve|bf16|vnni)", f))
    topo = read_topology()
    return {"cpu": name, "cpus": THREADS, "isa_flags": keep, "date": time.strftime("%Y-%m-%d"),
            "cpu_quota": getattr(topo, "cpu_quota", None)}


def rerun_refusal(stored: dict | None, here: dict) -> str | None:
    """Why rows of this machine cannot join the table of `stored` (peers.json's machine), or
    None: a PEERS_ONLY row set beside rows from another CPU would compare two machines in one
    table under this machine's name."""
    if not stored:
        return "docs/bench/peers.json has no machine: run the full `make bench-peers` first"
    differ = [k for k in ("cpu", "cpus", "isa_flags") if stored.get(k) != here.get(k)]
    if not differ:
        return None
    return (f"PEERS_ONLY: docs/bench/peers.json is from {stored.get('cpu')} ({stored.get('cpus')} CPUs, "
            f"{stored.get('date')}), this machine is {here.get('cpu')} ({here.get('cpus')} CPUs): its "
            f"{', '.join(differ)} differ. Rows from two machines would share one table: run the full "
            "`make bench-peers` (without PEERS_ONLY) on this machine")


def main() -> None:
    """Every workload of every engine; with PEERS_ONLY="section:name,..." (e.g. "serving:llama.cpp
    Q4_1"), only those, the others kept from the last docs/bench/peers.json (refused when that run
    was on another machine)."""
    only = {tuple(x.split(":", 1)) for x in filter(None, os.environ.get("PEERS_ONLY", "").split(","))}
    res: dict = json.loads((OUT / "peers.json").read_text()) if only else {"offline": {}, "serving": {}}
    here = machine()
    if only and (why := rerun_refusal(res.get("machine"), here)):
        raise SystemExit(why)
    gguf, hf_dir = models()
    res["machine"] = here

    def chosen(section: str, key: str) -> bool:
        return not only or (section, key) in only

    def rerun_at(section: str, key: str) -> None:
        if only:  # the report says which rows are not from the full run, and when they ran
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            res.setdefault("reruns", {})[f"{section}:{key}"] = f"{when}, {commit()}"

    def run(section: str, key: str, fn) -> None:
        if chosen(section, key):
            attempt(res[section] if section != "top" else res, key, fn)
            rerun_at(section, key)

    def run_in_turns(section: str, engines: dict, together) -> None:
        """The rows of engines on the same weights, taking turns: together(the chosen ones)."""
        engines = {key: spec for key, spec in engines.items() if chosen(section, key)}
        if not engines:
            return
        label, both = " / ".join(engines), {}
        attempt(both, label, lambda: together(engines))
        for key in engines:  # each row its own figures, or the pair's failure
            res[section][key] = both[label].get(key, both[label])
            rerun_at(section, key)
    off = res["offline"]
    from cpuserve.entrypoints.quantize import default_w8a8
    w8a8 = default_w8a8()
    # (dtype, row name, cpuserve's weights, vLLM's): the rows of both engines on the same weights
    same_weights = [(d, "W8A8" if d == "w8a8" else d, m, w8a8 if d == "w8a8" else hf_dir)
                    for d, m in (("float32", gguf), ("bfloat16", gguf), ("w8a8", w8a8))]
    for dtype, name, model, peer_model in same_weights:
        run_in_turns("offline", {f"cpuserve {name}": lambda d=dtype, m=model: python_offline("cpuserve", d, m),
                                 f"vLLM {name}": lambda d=dtype, m=peer_model: python_offline("vllm", d, m)},
                     taking_turns)
    def prefill_pairs() -> dict:
        out: dict = {}
        for dtype, name, model, peer_model in same_weights:
            attempt(out, name, lambda d=dtype, m=model, pm=peer_model, n=name: prefill_in_turns(
                {f"cpuserve {n}": ("cpuserve", d, m), f"vLLM {n}": ("vllm", d, pm)}))
        return out
    run("top", "prefill_alternating", prefill_pairs)
    run("offline", "transformers float32", lambda: repeated(lambda: python_offline("transformers", "float32", hf_dir,
                                                                                   skip_prefill=True), 1))
    for kind, f in llama_files(gguf).items():
        if kind != "F32":
            run("offline", f"cpuserve {kind}", lambda: repeated(lambda: python_offline("cpuserve", "gguf", f)))
        if kind != "F32":
            run("offline", f"cpuserve int8-act {kind}",
                lambda: repeated(lambda: python_offline("cpuserve", "gguf-int8", f)))
        run("offline", f"llama.cpp {kind}", lambda: repeated(lambda: llama_offline(f)))
    for name, engine, dtype in (("cpuserve Q4_1", "cpuserve", "gguf"), ("cpuserve int8-act Q4_1", "cpuserve", "gguf-int8")):
        run("serving", name, lambda: serve(engine, dtype, hf_dir, gguf))
    run_in_turns("serving", {"cpuserve float32": ("cpuserve", "float32"), "vLLM float32": ("vllm", "float32")},
                 lambda engines: serve_in_turns(engines, hf_dir, gguf))
    run("serving", "llama.cpp Q4_1", lambda: serve("llama", "Q4_1", hf_dir, gguf))
    run("top", "batch1_alternating", lambda: alternating_batch1(gguf))
    from cpuserve.entrypoints import bench
    run("top", "roofline", lambda: bench.run(batch=64, tokens=32))
    assert off is res["offline"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "peers.json").write_text(json.dumps(res, indent=1) + "\n")
    report(res)


def commit() -> str:
    return f"commit {readme_tables.head_commit() or 'unknown'}"


def fmt(v: list | None, digits: int = 1) -> str:
    return "–" if not v else f"{v[0]:.{digits}f} / {v[1]:.{digits}f}"


def ratio(ours: list | None, theirs: list | None, key: str) -> str:
    if not ours or not theirs:
        return "–"
    r = ours[1] / theirs[1] if key in HIGHER_IS_BETTER else theirs[1] / ours[1]
    return f"**{r:.2f}x**" if r >= 1 else f"{r:.2f}x"


def failure(error: str) -> str:
    """A failed run's error as one table cell: a command that died is named with how it ended
    (CalledProcessError's tail), anything else by its first line; no newlines or pipes."""
    m = re.match(r"CalledProcessError: Command '\['([^']+)'.*\]' (.+)$", error, re.S)
    text = f"{Path(m.group(1)).name} {m.group(2)}" if m else error.strip().splitlines()[0]
    return text.replace("|", "/")[:200]


READY_NOTE = ("ready s (warm): the process's start to the offline engine constructed, the model converted "
              "before and its files in the page cache; cpuserve's offline `LLM` faults its whole 4 GiB KV cache in "
              "before it is ready (`CPUSERVE_KV_POPULATE=start`, its default), which is most of its figure on a VM "
              "whose host backs memory on first touch. A server's start to ready, its cache populated while idle, "
              "is the serving table's.")


def offline_rows(off: dict) -> list[str]:
    """One row per engine and weights, with cpuserve's ratio against it on the same weights."""
    lines = []
    for name, r in off.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {failure(r['error'])} | | | | | |")
            continue
        ours, theirs = off.get(counterpart(name), {}), r
        if " int8-act " in name:  # against llama.cpp on the same file (which always quantizes activations)
            ours, theirs = r, off.get(f"llama.cpp {name.split()[-1]}", {})
        rat = " / ".join(ratio(ours.get(k), theirs.get(k), k) for k in ("offline_tok_s", "batch1_ms", "prefill_2048_s"))
        lines.append(f"| {name} | {fmt(r.get('offline_tok_s'))} | {fmt(r.get('batch1_ms'), 2)} | "
                     f"{fmt(r.get('prefill_2048_s'), 2)} | {fmt(r.get('ready_s'), 1)} | {fmt(r.get('peak_rss_mib'), 0)} | "
                     f"{rat if not name.startswith('cpuserve') or ' int8-act ' in name else ''} |")
    return lines


def turns_table(off: dict) -> list[str]:
    """Each round of the offline rows that took turns (taking_turns): cpuserve's and the peer's out
    tok/s in that round and their ratio, so that a ratio can be read pair of runs by pair of runs."""
    pairs = [(name, counterpart(name)) for name, r in off.items() if not name.startswith("cpuserve")
             and r.get("rounds") and len(off.get(counterpart(name), {}).get("rounds", [])) == len(r["rounds"])]
    if not pairs:
        return []
    lines = ["", "Offline, each peer and cpuserve on the same weights taking turns run by run (cpuserve, then the "
             "peer, in each round), so that each pair of runs meets the same minutes of this machine: out tok/s of "
             "each round and its ratio:", "",
             "| engines | each round: cpuserve / peer tok/s (ratio) | ratio of the rounds min / median |", "|---|---|---|"]
    for peer, ours in pairs:
        both = list(zip(off[ours]["rounds"], off[peer]["rounds"]))
        rats = [a["offline_tok_s"] / b["offline_tok_s"] for a, b in both]
        each = ", ".join(f"{a['offline_tok_s']:.1f} / {b['offline_tok_s']:.1f} ({r:.2f}x)" for (a, b), r in zip(both, rats))
        lines.append(f"| {ours} / {peer} | {each} | {min(rats):.2f}x / {statistics.median(rats):.2f}x |")
    return lines


def client_cpu(level: dict) -> str:
    """The benchmark client's CPU a token in a served level ('–' for a level measured before the
    client reported it)."""
    cpu = level.get("client_cpu_us_per_token")
    return "–" if cpu is None else f"{cpu:.0f}"


def serving_table(serving: dict) -> list[str]:
    lines = ["", "Serving (`serving.py`'s aiohttp client: 128-token prompts of random ids, 128 greedy output "
             "tokens, C concurrent streams back to back, a new connection per request; vLLM's OpenAI server and "
             "`llama-server --parallel 16`; client CPU: the client's own CPU a token, on the CPUs the server "
             "uses). The levels start on a settled server: cpuserve's once its `/metrics` says the start-up work "
             "it leaves for idle time is done (huge pages for the weights and KV cache, the cache's pages "
             "populated; how long after ready in brackets), the peers' when ready (they do theirs before):", "",
             "| engine | ready s cold / warm | C | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | client CPU us/token |",
             "|---|---|---|---|---|---|---|"]
    for name, r in serving.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {failure(r['error'])} | | | | | |")
            continue
        for lv in r["levels"]:
            settled = f" (+{r['settled_s']:.1f})" if r.get("settled_s") is not None else ""
            lines.append(f"| {name} | {r['ready_cold_s']:.1f} / {r['ready_warm_s']:.1f}{settled} | {lv['concurrency']} | "
                         f"{lv['tok_s']:.1f} | {lv['ttft_p50']:.0f} / {lv['ttft_p99']:.0f} | "
                         f"{lv['itl_p50']:.1f} / {lv['itl_p99']:.1f} | {client_cpu(lv)} |")
    return lines


def served_turns_note(serving_rows: dict) -> list[str]:
    """Which served rows took turns level by level (serve_in_turns), and how much CPU the idle
    servers used meanwhile against the levels' wall time: the measure that they stayed idle."""
    turns = {name: r for name, r in serving_rows.items() if "error" not in r
             and r["levels"] and all("idle_cpu_s" in lv for lv in r["levels"])}
    if not turns:
        return []
    worst = max((lv["idle_cpu_s"] / lv["wall_s"], lv["idle_cpu_s"], lv["wall_s"], name, lv["concurrency"])
                for name, r in turns.items() for lv in r["levels"])
    return ["", f"{' and '.join(turns)} took turns level by level, every server up and the others idle while one "
            "was measured, so that both sides of a ratio meet the same minutes of this machine. The idle servers "
            f"used at most {100 * worst[0]:.1f}% of a CPU meanwhile ({worst[1]:.2f} s of CPU in the {worst[2]:.1f} s "
            f"of {worst[3]}'s level at C = {worst[4]})."]


def served_steps_table(serving_rows: dict) -> list[str]:
    """Where cpuserve's served levels went (its server's step counters over each level, and the
    API process's CPU a token): what bounds the served rows, from the same run."""
    rows = [(name, lv) for name, r in serving_rows.items() if "error" not in r
            for lv in r["levels"] if lv.get("engine_steps")]
    if not rows:
        return []
    lines = ["", "Where cpuserve's time went in those levels (its server's `cpuserve:engine_step_*` counters over "
             "each level: the share of the wall time spent in steps, then per kind of step their number, mean "
             "ms and mean tokens, decode steps one row a sequence; and the API process's CPU a token):", "",
             "| engine | C | in steps | decode: n / ms / rows | mixed: n / ms / tokens | prefill: n / ms / tokens "
             "| API CPU us/token |", "|---|---|---|---|---|---|---|"]
    for name, lv in rows:
        cpu = lv.get("api_cpu_us_per_token")
        lines.append(f"| {name} | {lv['concurrency']} | " + " | ".join(serving.step_cells(lv["engine_steps"])) +
                     f" | {'–' if cpu is None else f'{cpu:.0f}'} |")
    return lines


def roofline_section(roof: dict, off: dict) -> list[str]:
    """The machine's roofline, and each system's batch-1 against its bandwidth bound and its
    offline throughput against the best GEMM peak measured here."""
    from cpuserve.entrypoints import bench
    mm = roof["machine"]
    peak = max(*mm["kernel_gflops"].values(), *mm["torch_gflops"].values())
    arith = mm.get("arith_gflops") or {}
    lines = ["", "## Roofline", "", "```", bench.format_report(roof), "```", "",
             "Each system's batch-1 decode against the bandwidth bound of the bytes it reads per token at the "
             "read bandwidth probed just before and after its runs (median over the runs; this machine's "
             "bandwidth moves with its neighbours' load), and "
             "its offline throughput as GFLOP/s (2 x 134M params a token) against the best GEMM peak measured "
             f"here, torch's or ours, any dtype ({peak:.0f} GFLOP/s), and for float32 and bfloat16 against the "
             "arithmetic peak of their instructions (multiply-add chains in registers: "
             + (", ".join(f"{k} {v:.0f}" for k, v in arith.items()) or "not measured in this run") + " GFLOP/s):", "",
             "| system | bytes read per token (MiB) | read GB/s alongside | batch-1 of its bound | "
             "offline GFLOP/s | of the peak | of its arithmetic peak |",
             "|---|---|---|---|---|---|---|"]
    params = next(iter(roof["engines"].values()))["params"]
    for name, r in off.items():
        if "error" in r or not r.get("batch1_ms"):
            continue
        nbytes = weight_bytes(name, roof)
        gflops = r["offline_tok_s"][1] * 2 * params / 1e9
        gbs = r.get("read_gbs", [0, mm["read_gbs"]])[1]
        bound_ms = nbytes / (gbs * 1e9) * 1e3
        own = next((v for k, v in arith.items() if name.endswith(f" {k}")), None)
        lines.append(f"| {name} | {nbytes / 2**20:.0f} | {gbs:.1f} | {100 * bound_ms / r['batch1_ms'][1]:.0f}% | "
                     f"{gflops:.0f} | {100 * gflops / peak:.0f}% | {'–' if own is None else f'{100 * gflops / own:.0f}%'} |")
    return lines


def report(res: dict) -> None:
    m, off = res["machine"], res["offline"]
    lines = ["# cpuserve against its peers (`make bench-peers`)", "",
             f"Machine: {m['cpu']}, {m['cpus']} CPUs (cgroup CPU quota: {m['cpu_quota'] or 'none'}), ISA: "
             f"{' '.join(m['isa_flags'])}; {m['date']}. Model: SmolLM2-135M-Instruct. Figures are min / median over "
             f"{REPEATS} runs. Ratio: cpuserve's median over the peer's (throughput), or the peer's over cpuserve's "
             "(times), for the same weights (vLLM and llama.cpp F32 against cpuserve float32 or bfloat16, "
             "llama.cpp's quantized files against cpuserve on the same file): above 1x, cpuserve is ahead.", "",
             *([f"Rerun alone after the full run (`PEERS_ONLY`), the other rows kept: "
                f"{'; '.join(f'{k} ({v})' for k, v in res['reruns'].items())}.", ""] if res.get("reruns") else []),
             "| engine | offline 64 x 128/128 out tok/s | batch-1 decode ms/token | 2,048-token prefill s | "
             "ready s (warm) | peak RSS MiB | ratio: offline / batch-1 / prefill |",
             "|---|---|---|---|---|---|---|"]
    lines += offline_rows(off)
    lines += ["", READY_NOTE]
    lines += turns_table(off)
    lines += alternating_table(res.get("batch1_alternating"))
    lines += prefill_turns_table(res.get("prefill_alternating"))
    lines += serving_table(res["serving"])
    lines += served_turns_note(res["serving"])
    lines += served_steps_table(res["serving"])
    readme_tables.update("peers", lines[2:] + ["", "Command: `make bench-peers`; roofline, plots and JSON in "
                                                   "[docs/bench/PEERS.md](docs/bench/PEERS.md)."])
    if "machine" in res.get("roofline", {}):
        lines += roofline_section(res["roofline"], off)
    lines.append("")
    (OUT / "PEERS.md").write_text("\n".join(lines))
    plot(res)
    print("\n".join(lines))


def alternating_table(alt: dict | None) -> list[str]:
    """The batch-1 rounds with the engines taking turns (alternating_batch1), as report lines."""
    if not alt:
        return []
    if "error" in alt:
        return ["", f"Batch-1 decode, engines taking turns: failed: {failure(alt['error'])}"]
    rounds = os.environ.get("PEERS_BATCH1_ROUNDS", "5")
    lines = ["", f"Batch-1 decode with the engines taking turns, {rounds} rounds (cpuserve float32, llama.cpp F32, "
             "cpuserve Q4_1, llama.cpp Q4_1 in each round, the read bandwidth probed around every run), so that both "
             "sides of a ratio meet the same minutes of this machine:", "",
             "| engine | batch-1 ms/token min / median | read GB/s min / median | ratio | each round: ms (GB/s) |",
             "|---|---|---|---|---|"]
    for name, r in alt.items():
        peer = alt.get(name.replace("cpuserve float32", "llama.cpp F32").replace("cpuserve Q4_1", "llama.cpp Q4_1"))
        rat = ratio(r["batch1_ms"], peer["batch1_ms"], "batch1_ms") if name.startswith("cpuserve") and peer else ""
        each = ", ".join(f"{ms:.2f} ({gbs:.0f})" for ms, gbs in r.get("rounds", [])) or "–"
        lines.append(f"| {name} | {fmt(r['batch1_ms'], 2)} | {fmt(r['read_gbs'], 1)} | {rat} | {each} |")
    return lines


def prefill_turns_table(pairs: dict | None) -> list[str]:
    """The 2,048-token prefills that took turns prompt by prompt (prefill_in_turns), as report lines:
    each pair's min / median, the peer's time over cpuserve's (of the medians, and the median of the
    rounds' ratios), the rounds cpuserve was ahead in, each round's pair of times."""
    if not pairs:
        return []
    lines = ["", "2,048-token prefill with cpuserve and vLLM on the same weights taking turns prompt by prompt, "
             "both engines up, a new prompt each time (cpuserve first in odd rounds, vLLM first in even ones), so "
             "that both sides of a ratio meet the same minutes of this machine:", "",
             "| weights | cpuserve s min / median | vLLM s min / median | ratio: medians / rounds' median | "
             "rounds ahead | each round: cpuserve / vLLM s | idle engine's CPU s at most |", "|---|---|---|---|---|---|---|"]
    for label, pair in pairs.items():
        if "error" in pair:
            lines.append(f"| {label} | failed: {failure(pair['error'])} | | | | | |")
            continue
        ours, theirs = pair[f"cpuserve {label}"], pair[f"vLLM {label}"]
        both = list(zip(ours["rounds"], theirs["rounds"]))
        rats = [b[0] / a[0] for a, b in both]
        mid = statistics.median(rats)
        each = ", ".join(f"{a[0]:.2f} / {b[0]:.2f}" for a, b in both)
        lines.append(f"| {label} | {fmt(ours['prefill_2048_s'], 2)} | {fmt(theirs['prefill_2048_s'], 2)} | "
                     f"{ratio(ours['prefill_2048_s'], theirs['prefill_2048_s'], 'prefill_2048_s')} / "
                     f"{f'**{mid:.2f}x**' if mid >= 1 else f'{mid:.2f}x'} | {sum(r > 1 for r in rats)} of {len(rats)} | "
                     f"{each} | {max(ours['idle_cpu_s'], theirs['idle_cpu_s']):.2f} |")
    return lines


def counterpart(name: str) -> str:
    """cpuserve's row with the same weights as a peer's row."""
    kind = name.split()[-1]
    if kind in ("float32", "F32"):
        return "cpuserve float32"
    return "cpuserve bfloat16" if kind == "bfloat16" else f"cpuserve {kind}"


def weight_bytes(name: str, roof: dict) -> int:
    """Bytes a greedy decode step reads: the float32, bfloat16 or W8A8 matrices, or the GGUF file;
    cpuserve's float32 with its LM head's bfloat16 copy (LMHead.greedy), the peers' with the
    float32 head they compute every logit from."""
    for kind in ("bfloat16", "W8A8"):
        if name.endswith(kind):
            return roof["engines"][kind.lower()]["weight_bytes"]
    if not name.endswith(("F32", "float32")):
        kind = name.split()[-1]
        f = CACHE / "models" / f"smollm2-135m-{kind.lower()}.gguf" if kind != "Q4_1" else models()[0]
        return f.stat().st_size
    f32 = roof["engines"]["float32"]
    return f32["weight_bytes"] if name.startswith("cpuserve") else f32.get("full_bytes", f32["weight_bytes"])


def plot(res: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    off = {k: v for k, v in res["offline"].items() if "error" not in v}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, title in zip(axes[:2], ("offline_tok_s", "batch1_ms"),
                              ("offline 64 x 128/128: output tok/s", "batch-1 decode ms/token")):
        names = [n for n in off if off[n].get(key)]
        ax.barh(names, [off[n][key][1] for n in names], color=["C0" if n.startswith("cpuserve") else "C7" for n in names])
        ax.set_title(title)
        ax.invert_yaxis()
    for name, r in res["serving"].items():
        if "error" not in r:
            axes[2].plot([lv["concurrency"] for lv in r["levels"]], [lv["tok_s"] for lv in r["levels"]], "o-", label=name)
    axes[2].set_xscale("log", base=2)
    axes[2].set_title("serving: output tok/s")
    axes[2].set_xlabel("concurrent streams")
    axes[2].legend(fontsize="small")
    fig.suptitle(f"{res['machine']['cpu']}, {res['machine']['cpus']} CPUs, {res['machine']['date']}")
    fig.tight_layout()
    fig.savefig(OUT / "peers.png", dpi=110)


if __name__ == "__main__":
    main()
