"""`cpuserve bench`: where a model sits on this machine's roofline, and where a decode step's
time goes.

- The machine: read bandwidth (ops.read_sum, the native multi-threaded streaming sum, over 1
  GiB), GEMM GFLOP/s: torch's on 2048^3 and this engine's kernel on the model's own shape
  ([64, hidden] x [hidden, ffn]), in float32 and with bfloat16 weights, and the arithmetic peak
  of the instructions those GEMMs run on (`arith_peaks`), which no GEMM passes.
- The bounds: batch-1 decode streams every weight once per token, so it takes at least
  weight bytes / bandwidth; a large batch is bounded by 2 x params FLOPs per token at the GEMM
  peak. Measured decode (batch 1, and 64 sequences) as a fraction of each bound. A shared
  machine's read bandwidth moves in phases of minutes (34 and 55 GB/s minutes apart on one
  Zen 4 VM), so batch 1 is measured in short windows, each bracketed by its own probe, and each
  window is set against the bound of its own minute (`paired_fractions`). Beside each probe,
  how long a cache line takes between the OpenMP threads (`_C.line_transfer_ns`): tens of ns
  where their cores share an L3, over a hundred across dies or sockets, where every parallel
  region's fork and barrier costs as much more (a VM's host may move its vCPUs between the two).
- The profile of one decode step at batch 1 and 64: GEMMs, attention, each other kernel
  (norms, rotary, activation, cache writes), the sampler, and the rest (Python, scheduling,
  input preparation), from timers around each kernel call: inside the native decoder stack
  where the steps run through it (the run that is timed is the one the engine makes), around
  the Python layers' kernel calls where they run. Batch 1 and the profile decode after
  128-token prompts, as the offline and serving benchmarks do: attention's share grows with
  the context (at 16-48 tokens, a 64-sequence bfloat16 step's attention was a third of what it
  is at 128-160).

The bound arithmetic is pure (`paired_fractions`); the rest measures."""
from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch

GB = 1e9
# The prompt of the decode runs below: the offline and serving benchmarks' prompt length, so that
# their contexts (prompt_len to prompt_len + tokens) are the benchmarks' early decode steps.
PROMPT_LEN = 128


@dataclass(frozen=True)
class Machine:
    threads: int
    read_gbs: float                 # GB/s
    torch_gflops: dict              # dtype name -> GFLOP/s, torch.mm at 2048^3
    kernel_gflops: dict             # dtype name -> GFLOP/s, ops.linear on the model's shape
    torch_shape_gflops: dict = field(default_factory=dict)  # float32/bfloat16: torch's F.linear on that shape
    line_ns: float | None = None    # a cache line between OpenMP thread 0 and the slowest other, one way
    arith_gflops: dict = field(default_factory=dict)  # float32/bfloat16: the arithmetic peak (arith_peaks)
    decode_fetch: str = ""          # how the probe and the decode GEMVs fetch ahead (_C.decode_fetch)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(gib: float = 1.0, repeats: int = 10, buffer: torch.Tensor | None = None) -> float:
    """GB/s of the best of `repeats` native streaming reads (ops.read_sum, every thread on its
    share) of a buffer far larger than the caches (`buffer`, else `gib` GiB allocated here)."""
    from cpuserve.model_executor import ops

    x = torch.rand(int(gib * (1 << 30)) // 4, dtype=torch.float32) if buffer is None else buffer
    return x.numel() * 4 / _best(lambda: ops.read_sum(x), repeats) / GB


def line_transfer_ns() -> float | None:
    """ns one way for a cache line between OpenMP thread 0 and the slowest other thread of the
    pool (None with one thread, or where a pair shares a CPU and gave up)."""
    from cpuserve import _C

    ns = _C.line_transfer_ns()
    return max(ns) if ns and min(ns) > 0 else None


def paired_fractions(weight_bytes: int, windows: list[tuple]) -> dict:
    """Batch 1 against the bandwidth bound window by window: `windows` holds (GB/s probed around
    the window, seconds per token in it, and what else was measured with it). Each window's
    fraction is its own bound over its own step, so a fast probe minute is never set against a
    slow decode minute or the reverse.
    Returns the median, min and max fraction, the median step (ms) and the bound (ms) at the
    median bandwidth."""
    if not windows:
        raise ValueError("paired_fractions: no windows")
    fractions = sorted(weight_bytes / (w[0] * GB) / w[1] for w in windows)
    steps = sorted(w[1] for w in windows)
    gbs = sorted(w[0] for w in windows)
    mid = len(windows) // 2
    return {"batch1_of_bound": fractions[mid], "batch1_of_bound_range": [fractions[0], fractions[-1]],
            "batch1_ms": steps[mid] * 1e3, "batch1_bound_ms": weight_bytes / (gbs[mid] * GB) * 1e3,
            "read_gbs": gbs[mid], "read_gbs_range": [gbs[0], gbs[-1]]}


def batch1_windows(llm, tokens: int, windows: int = 5, probe_gib: float = 0.5,
                   prompt_len: int = PROMPT_LEN) -> list[tuple]:
    """(GB/s, seconds per token, line ns) of `windows` short batch-1 decode runs, each between two
    probes of the read bandwidth (the faster of the two: the strict bound), with the threads'
    cache-line transfer (`line_transfer_ns`) measured after them."""
    buffer = torch.rand(int(probe_gib * (1 << 30)) // 4, dtype=torch.float32)
    out = []
    for _ in range(windows):
        before = read_bandwidth(repeats=3, buffer=buffer)
        step, _ = decode_steps(llm, 1, tokens, prompt_len, profile=False)
        out.append((max(before, read_bandwidth(repeats=3, buffer=buffer)), step, line_transfer_ns()))
    return out


def torch_gemm_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _best(lambda: torch.mm(a, b), repeats) / GB


def torch_linear_gflops(dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 20) -> float:
    """torch's own F.linear on the shape kernel_gflops measures ours on (its oneDNN/MKL GEMM)."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    return 2 * m * n * k / _best(lambda: torch.nn.functional.linear(x, w), repeats) / GB


def random_q4_1(n: int, k: int):
    """A [n, k] Q4_1 weight (the default model's layer type) quantized from random values."""
    import gguf
    import numpy as np

    from cpuserve.loading.quant_tensor import QuantTensor

    raw = gguf.quants.quantize(torch.randn(n, k).numpy(), gguf.GGMLQuantizationType.Q4_1).view(np.uint8)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1)), 3, k)


def random_weight(dtype: torch.dtype | str, n: int, k: int):
    from cpuserve.loading.quant_tensor import Int8Tensor

    if dtype in ("gguf", "gguf-int8"):
        return random_q4_1(n, k)
    if dtype == "w8a8":
        return Int8Tensor(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01)
    return torch.randn(n, k)


def kernel_gflops(dtype: torch.dtype | str, m: int, k: int, n: int, repeats: int = 20) -> float:
    """Our GEMM on the model's MLP shape: dense in `dtype`, "gguf" (Q4_1 blocks), "gguf-int8" (the
    same on int8 dot products) or "w8a8"."""
    from cpuserve.model_executor import ops

    with ops.quantized_activations("int8" if dtype == "gguf-int8" else "none"):
        w = ops.pack(random_weight(dtype, n, k), dtype if isinstance(dtype, torch.dtype) else torch.float32)
    x = torch.randn(m, k)
    out = torch.empty(m, n)
    return 2 * m * n * k / _best(lambda: ops.linear(x, w, out=out), repeats) / GB


def arith_peaks() -> dict:
    """The arithmetic peak in GFLOP/s of the instructions the float32 and bfloat16 GEMMs run on
    (ops.peak_gflops: multiply-add chains in registers on every thread): float32 FMAs, and for
    bfloat16 the pair dot products where this CPU's kernels multiply pairs (tile dot products on
    the amx table, whose bfloat16 GEMMs run on AMX tiles), else the same FMAs (bfloat16 weights
    widened to float32 in registers)."""
    from cpuserve.model_executor import ops

    fma = ops.peak_gflops(False)
    return {"float32": fma, "bfloat16": ops.peak_gflops(True) or fma}


def measure_machine(hidden: int, ffn: int) -> Machine:
    from cpuserve import _C

    kinds = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    return Machine(torch.get_num_threads(), read_bandwidth(),
                   {k: torch_gemm_gflops(d) for k, d in kinds.items()},
                   {k: kernel_gflops(d, 64, hidden, ffn) for k, d in {**kinds, **{q: q for q in ("gguf", "gguf-int8", "w8a8")}}.items()},
                   {k: torch_linear_gflops(d, 64, hidden, ffn) for k, d in kinds.items()}, line_transfer_ns(),
                   arith_peaks(), _C.decode_fetch())


# -- the engine ---------------------------------------------------------------------------------
# the gate/up GEMM with its fused SiLU-and-mul (ops.linear_silu) counts as GEMM: uncounted, it
# fell into 'Python and scheduling'
CATEGORIES = {"linear": "GEMM", "linear_silu": "GEMM", "paged_attention": "attention",
              "greedy_head": "sampler"}  # greedy rows' token from a float32 head's bfloat16 or Q8_0 copy


class StepProfile:
    """Seconds per decode step by category, from timers wrapped around the kernel calls and
    the sampler (installed for the duration of a `with`)."""

    def __init__(self):
        self.spent: collections.Counter = collections.Counter()
        self._undo: list = []

    def __enter__(self):
        from cpuserve.model_executor import ops
        from cpuserve.worker import sampler

        for name in ("linear", "linear_silu", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul",
                     "gelu_and_mul", "reshape_and_cache", "greedy_head"):
            self._wrap(ops, name, CATEGORIES.get(name, name))
        self._wrap(sampler.Sampler, "__call__", "sampler")
        return self

    def _wrap(self, owner, name: str, category: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.spent[category] += time.perf_counter() - t0
        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _native_stack(llm):
    """The native decoder stack the model's decode steps run through (built by the first step
    with the KV caches bound), or None where the Python layers run."""
    from cpuserve.model_executor import native_step

    nd = native_step.decoder_for(llm.engine.runner.model)
    return nd.stack if nd is not None else None


def _prefill(core, batch: int) -> None:
    """Steps until every one of `batch` new requests has its first token: the prompts' prefill,
    in as many steps as the token budget takes."""
    started: set = set()
    while len(started) < batch and core.has_unfinished():
        started.update(o.request_id for o in core.step())


def decode_steps(llm, batch: int, tokens: int, prompt_len: int = PROMPT_LEN,
                 profile: bool = True) -> tuple[float, dict]:
    """Median seconds of a decode step with `batch` sequences as the engine runs it, and (with
    `profile`) where those steps' time goes (seconds per step by category, 'Python and
    scheduling' the rest): timed inside the native decoder stack where the steps run through it
    (`_native_stack`), else from timers around the Python layers' kernel calls."""
    from cpuserve import SamplingParams

    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"bench-{batch}-{i}", [1 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
    _prefill(core, batch)
    steps = []
    prof = StepProfile()
    stack = _native_stack(llm) if profile else None
    if stack is not None:
        stack.reset_timings()
        stack.set_timing(True)
    inside: dict = {}
    try:
        with prof if profile else contextlib.nullcontext():
            while core.has_unfinished():
                t0 = time.perf_counter()
                core.step()
                steps.append(time.perf_counter() - t0)
    finally:
        if stack is not None:
            stack.set_timing(False)
            inside = stack.timings()
            stack.reset_timings()
    total = sum(steps)
    share = {k: v / len(steps) for k, v in prof.spent.items()}
    for k, v in inside.items():
        share[k] = share.get(k, 0.0) + v / len(steps)
    share["Python and scheduling"] = max(0.0, total / len(steps) - sum(share.values()))
    return sorted(steps)[len(steps) // 2], share


def model_size(llm, greedy: bool = True) -> tuple[int, int]:
    """(bytes a greedy decode step of one row reads from the weights, parameters multiplied per
    token): every packed linear weight, the LM head included, not the embedding table (one row a
    token); a float32 head with copies for greedy rows (LMHead.greedy) as the copy one row reads
    (Q8_0 where it has one, else bfloat16), unless not `greedy` (what a step computing every
    float32 logit reads, as the peers' do)."""
    from cpuserve.worker.model_runner import packed_weights, tensor_bytes

    model = llm.engine.runner.model
    lm = model.lm_head
    head = {id(w) for w in packed_weights(lm)}
    lookup = {id(w) for w in packed_weights(getattr(model, "embed", None))} - head
    copies = [c for c in (getattr(lm, "greedy_copy", None), getattr(lm, "greedy_q8", None)) if c is not None]
    if copies:
        read = copies[-1] if greedy else lm.weight
        lookup |= {id(w) for w in [lm.weight, *copies]} - {id(read)}
    packed = [w for w in packed_weights(model) if id(w) not in lookup]
    return sum(tensor_bytes(w.data) for w in packed), sum(w.n * w.k for w in packed)


# the default GGUF in its blocks (Q4_1; with int8 activations), its weights as a W8A8 checkpoint,
# or widened to a dtype
ENGINES = ("gguf", "gguf-int8", "w8a8", "float32", "bfloat16")


def engine_llm(engine: str, **kw):
    from cpuserve import LLM
    from cpuserve.entrypoints.quantize import default_w8a8

    if engine == "w8a8":  # the LM head (not quantized, as compressed-tensors' "ignore" has it) in bfloat16
        return LLM(str(default_w8a8()), dtype="bfloat16", **kw)
    if engine in ("gguf", "gguf-int8"):
        return LLM(dtype="float32", quantization="gguf", quantized_activations="int8" if engine == "gguf-int8" else "none",
                   **kw)
    return LLM(dtype=engine, quantization="none", **kw)


def run(dtypes=ENGINES, batch: int = 64, tokens: int = 32, prompt_len: int = PROMPT_LEN) -> dict:
    out: dict = {"engines": {}}
    machine = None
    for dtype in dtypes:
        llm = engine_llm(dtype, kv_cache_space=1.0)
        c = llm.engine.runner.hf_config
        if machine is None:
            machine = measure_machine(c.hidden_size, c.intermediate_size)
            out["machine"] = asdict(machine)
        weight_bytes, params = model_size(llm)
        full_bytes = model_size(llm, greedy=False)[0]
        windows = batch1_windows(llm, tokens, prompt_len=prompt_len)  # each against its own minute's bandwidth
        _, one_profile = decode_steps(llm, 1, tokens, prompt_len)
        big, big_profile = decode_steps(llm, batch, tokens, prompt_len)
        peak = max(machine.kernel_gflops[dtype], machine.torch_gflops["float32"])
        out["engines"][dtype] = {
            "weight_bytes": weight_bytes, "full_bytes": full_bytes, "params": params,
            **paired_fractions(weight_bytes, windows),
            "batch1_windows": [[gbs, step * 1e3, ns] for gbs, step, ns in windows], f"batch{batch}_tok_s": batch / big,
            f"batch{batch}_gflops": 2 * params * batch / big / GB,
            f"batch{batch}_of_kernel_peak": 2 * params * batch / big / GB / machine.kernel_gflops[dtype],
            f"batch{batch}_of_best_peak": 2 * params * batch / big / GB / peak,
            **({f"batch{batch}_of_arith_peak": 2 * params * batch / big / GB / machine.arith_gflops[dtype]}
               if dtype in machine.arith_gflops else {}),
            "profile": {"1": one_profile, str(batch): big_profile},
            "profile_where": "native decoder stack" if _native_stack(llm) is not None else "Python layers",
            "contexts": [prompt_len, prompt_len + tokens]}
        del llm
    return out


def _batch1_text(e: dict, m: dict) -> str:
    """Batch 1 against its bound: per window (reports since the windows) or against one probe."""
    if "batch1_windows" not in e:
        return (f"{e['batch1_ms']:.2f} ms/token against a bound of {e['batch1_bound_ms']:.2f} at "
                f"{e.get('read_gbs', m['read_gbs']):.1f} GB/s probed alongside ({100 * e['batch1_of_bound']:.0f}%)")
    lo, hi = e["batch1_of_bound_range"]
    g_lo, g_hi = e["read_gbs_range"]
    ns = sorted(w[2] for w in e["batch1_windows"] if len(w) > 2 and w[2] is not None)
    return (f"{e['batch1_ms']:.2f} ms/token (median of {len(e['batch1_windows'])} windows), each window "
            f"{100 * e['batch1_of_bound']:.0f}% of its own bandwidth bound (median; {100 * lo:.0f}-{100 * hi:.0f}%; "
            f"read {g_lo:.1f}-{g_hi:.1f} GB/s around the windows, bound {e['batch1_bound_ms']:.2f} ms at the median "
            f"{e['read_gbs']:.1f}" + (f"; a cache line between the threads {ns[0]:.0f}-{ns[-1]:.0f} ns" if ns else "")
            + ")")


def _profile_how(e: dict) -> str:
    """Where a report's profile was timed, and at which contexts (reports before these keys:
    through the Python layers, after 16-token prompts)."""
    where = e.get("profile_where", "Python layers")
    ctx = f" (contexts {e['contexts'][0]}-{e['contexts'][1]})" if e.get("contexts") else ""
    return f"{ctx}, timed inside the native decoder stack" if where == "native decoder stack" else \
        f"{ctx} through the Python layers"


def format_report(r: dict, batch: int = 64) -> str:
    m = r["machine"]
    fetch = f" (decode fetch {m['decode_fetch']})" if m.get("decode_fetch") else ""
    lines = [f"machine: {m['threads']} threads, read bandwidth {m['read_gbs']:.1f} GB/s{fetch}; GEMM GFLOP/s: torch 2048^3 "
             + ", ".join(f"{k} {v:.0f}" for k, v in m["torch_gflops"].items()) + "; cpuserve kernel [64 x hidden] x "
             "[hidden x ffn] " + ", ".join(f"{k} {v:.0f}" for k, v in m["kernel_gflops"].items())
             + ("; torch's F.linear on that shape " + ", ".join(f"{k} {v:.0f}" for k, v in m["torch_shape_gflops"].items())
                if m.get("torch_shape_gflops") else "")
             + (f"; a cache line between the threads {m['line_ns']:.0f} ns" if m.get("line_ns") else "")
             + ("; arithmetic peak (multiply-add chains in registers) " + ", ".join(
                 f"{k} {v:.0f}" for k, v in m["arith_gflops"].items()) if m.get("arith_gflops") else ""), ""]
    for dtype, e in r["engines"].items():
        prompts = f"; decoding after {e['contexts'][0]}-token prompts" if e.get("contexts") else ""
        lines.append(f"{dtype}: weights read per token {e['weight_bytes'] / 2**20:.0f} MiB ({e['params'] / 1e6:.0f}M "
                     f"params){prompts}; batch 1: {_batch1_text(e, m)}; batch {batch}: {e[f'batch{batch}_tok_s']:.0f} tok/s = "
                     f"{e[f'batch{batch}_gflops']:.0f} GFLOP/s, {100 * e[f'batch{batch}_of_kernel_peak']:.0f}% of "
                     f"the kernel's peak, {100 * e[f'batch{batch}_of_best_peak']:.0f}% of the best GEMM peak"
                     + (f", {100 * e[f'batch{batch}_of_arith_peak']:.0f}% of the arithmetic peak"
                        if f"batch{batch}_of_arith_peak" in e else ""))
        for b, prof in e["profile"].items():
            prof = dict(prof)
            saved = prof.pop("native step saves", 0.0)
            total = sum(prof.values())
            parts = ", ".join(f"{k} {v * 1e3:.2f} ms ({100 * v / total:.0f}%)"
                              for k, v in sorted(prof.items(), key=lambda kv: -kv[1]))
            lines.append(f"  decode step at batch {b}{_profile_how(e)}: {total * 1e3:.2f} ms = {parts}"
                         + (f"; the native decoder stack saves {saved * 1e3:.2f} ms of it" if saved else ""))
    return "\n".join(lines)
