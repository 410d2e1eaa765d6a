"""`cpuserve` command line: `serve` (the OpenAI-compatible server) and
`generate` (the offline engine on a few prompts)."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from cpuserve.config import QUANTIZATIONS
from cpuserve.core.lora_request import parse_modules
from cpuserve.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS

SERVE_BATCHED_TOKENS = 512
SERVE_PREFILL_WHILE_DECODING = 256

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about CPUs.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face directory or .gguf file (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "fp8_e5m2", "fp8_e4m3", "fp8"],
                   help="fp8_e5m2 / fp8_e4m3 (fp8): one byte a value, with chunked prefill and prefix caching")
    p.add_argument("--quantization", "-q", default="auto",
                   choices=QUANTIZATIONS,
                   help="auto: a GGUF keeps its quantized blocks (gguf), an AWQ / GPTQ checkpoint its 4-bit groups, "
                        "a compressed-tensors one its int8 W8A8 weights; none: widen every weight to --dtype")
    p.add_argument("--quantized-activations", default="none", choices=["none", "int8"],
                   help="int8: GEMMs on GGUF / AWQ / GPTQ blocks (every kept type) quantize "
                        "their input to int8 per block and use int8 dot products (llama.cpp's scheme): faster "
                        "batches, activations rounded (see the README for the perplexity change)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-cache-space", type=float, default=None,
                   help="GiB for the KV cache (default: VLLM_CPU_KVCACHE_SPACE, else 4)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: 512 for serve, 2048 offline)")
    p.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                   help="with chunked prefill, prompt tokens a step that also decodes may take (default: 256 "
                        "for serve, the whole budget offline; 0: the whole budget)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks, one per NUMA node (see VLLM_CPU_OMP_THREADS_BIND)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve a causal LM as an embedding model (last-token pooling); "
                        "auto: encoders embed, causal LMs generate")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs (and prompt logprobs) a request may ask for; -1: the whole vocabulary")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto, the model's generation_config.json (temperature, "
                        "top_p, top_k, min_p, repetition_penalty; max_new_tokens caps every request); vllm, none; "
                        "or a directory holding a generation_config.json")
    p.add_argument("--override-generation-config", type=_json_object, default=None,
                   help='JSON object over the generation config\'s defaults, e.g. \'{"temperature": 0.5}\'')
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories) beside the base model; requests name one as their model")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='the adapters loaded at start: name=path, or a JSON object {"name": ..., "path": ...}')
    p.add_argument("--max-loras", type=int, default=8, help="the most adapters loaded at once (default 8)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    p.add_argument("--hf-overrides", type=_json_object, default=None,
                   help="JSON object merged over the model's config.json (vLLM's), e.g. a Qwen3 reranker as a "
                        "classifier: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                        "\"classifier_from_token\": [\"no\", \"yes\"], \"method\": \"from_2_way_softmax\"}'")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(model=a.model, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
                quantization=a.quantization, quantized_activations=a.quantized_activations, block_size=a.block_size,
                kv_cache_space=a.kv_cache_space, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens,
                max_prefill_tokens_while_decoding=a.max_prefill_tokens_while_decoding, max_model_len=a.max_model_len,
                enable_prefix_caching=a.enable_prefix_caching, enable_chunked_prefill=a.enable_chunked_prefill,
                seed=a.seed, tensor_parallel_size=a.tensor_parallel_size, runner=a.runner,
                generation_config=a.generation_config, override_generation_config=a.override_generation_config,
                hf_overrides=a.hf_overrides, enable_lora=a.enable_lora,
                lora_modules=parse_modules(a.lora_modules) or None, max_loras=a.max_loras,
                max_lora_rank=a.max_lora_rank, max_logprobs=a.max_logprobs)


def cmd_generate(a: argparse.Namespace) -> int:
    from cpuserve import LLM, SamplingParams

    kwargs = engine_kwargs(a)
    t0 = time.perf_counter()
    llm = LLM(kwargs.pop("model"), **kwargs)
    print(f"# ready in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed)
    prompts = a.prompt or DEMO_PROMPTS
    t1 = time.perf_counter()
    outs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in prompts] if a.chat else \
        llm.generate(prompts, params)
    dt = time.perf_counter() - t1
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if a.json:
        import json
        print(json.dumps([{"prompt": p, "token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
                          for p, o in zip(prompts, outs)]))
        return 0
    for p, o in zip(prompts, outs):
        print(f">>> {p}\n{o.outputs[0].text}\n")
    print(f"# {n} tokens in {dt:.2f}s", file=sys.stderr)
    return 0


def serve_arguments_problem(a: argparse.Namespace) -> str | None:
    """What is wrong with `serve`'s own options (the engine's are EngineConfig's to check), or
    None: refused by main() before anything loads."""
    if a.max_request_body_bytes < 1:
        return f"--max-request-body-bytes must be >= 1, got {a.max_request_body_bytes}"
    if a.drain_timeout < 0:
        return f"--drain-timeout must be >= 0 seconds, got {a.drain_timeout}"
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or pythonic)"
    if a.chat_template is not None:
        try:
            a.chat_template = chat_template_text(a.chat_template)
        except ValueError as e:
            return str(e)
    if a.enable_log_outputs and not a.enable_log_requests:
        return "--enable-log-outputs needs --enable-log-requests"
    if a.max_log_len is not None and a.max_log_len < 0:
        return f"--max-log-len must be >= 0, got {a.max_log_len}"
    problem = tls_problem(a) or root_path_problem(a.root_path)
    if problem:
        return problem
    if not a.disable_log_stats:
        from cpuserve.entrypoints.openai.metrics import stats_interval
        try:
            a.stats_interval = stats_interval()
        except ValueError as e:
            return str(e)
    return generation_config_problem(a.generation_config, a.override_generation_config)


def tls_problem(a: argparse.Namespace) -> str | None:
    """What is wrong with the --ssl-* options: a key without its certificate, a file that is not
    there, client certificates asked for with no CA to check them against."""
    if bool(a.ssl_keyfile) != bool(a.ssl_certfile):
        return "--ssl-keyfile and --ssl-certfile go together (the server's key and its certificate)"
    if not a.ssl_certfile and (a.ssl_ca_certs or a.ssl_cert_reqs):
        return "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile (HTTPS)"
    if a.ssl_cert_reqs and not a.ssl_ca_certs:
        return f"--ssl-cert-reqs {a.ssl_cert_reqs} needs --ssl-ca-certs: the CA clients' certificates are checked against"
    for flag, path in (("--ssl-keyfile", a.ssl_keyfile), ("--ssl-certfile", a.ssl_certfile),
                       ("--ssl-ca-certs", a.ssl_ca_certs)):
        if path and not Path(path).is_file():
            return f"{flag} {path}: no such file"
    return None


def root_path_problem(root: str) -> str | None:
    if root and (not root.startswith("/") or root.endswith("/")):
        return f"--root-path must start with / and not end with one (e.g. /llm), got {root!r}"
    return None


def generation_config_problem(source: str, overrides: dict | None) -> str | None:
    """What is wrong with --generation-config / --override-generation-config, before the model
    loads (the model's own file is read once it is there)."""
    from cpuserve.core.generation_config import sampling_defaults

    try:
        sampling_defaults(None, source, overrides)
    except ValueError as e:
        return str(e)
    return None


def _json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form for its CORS options: '["http://a.example"]')."""
    import json

    try:
        items = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
    return items


def _json_object(value: str) -> dict:
    """A JSON object (vLLM's form for --override-generation-config: '{"temperature": 0.5}')."""
    import json

    try:
        obj = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r}")
    return obj


def chat_template_text(value: str) -> str:
    """--chat-template's template: the file it names, else the value itself where it is a Jinja
    template; ValueError otherwise (a mistyped path must not become the template)."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def cmd_serve(a: argparse.Namespace) -> int:
    import os

    from cpuserve.config import EngineConfig
    from cpuserve.entrypoints.openai.serving import RequestLog
    from cpuserve.entrypoints.serve import Cors, ServeOptions, Tls, run

    kwargs = engine_kwargs(a)
    if kwargs["max_num_batched_tokens"] is None and a.enable_chunked_prefill:
        # Serving default (offline keeps 2048): smaller steps let new requests' prefills
        # interleave with running decodes sooner. Measured here at 16 streams: TTFT p50
        # 3.1 s -> 1.4 s with no loss of throughput (GEMMs stay efficient at 512 rows).
        kwargs["max_num_batched_tokens"] = SERVE_BATCHED_TOKENS
    if kwargs["max_prefill_tokens_while_decoding"] is None and a.enable_chunked_prefill:
        # Serving default: a step that decodes takes at most 256 prompt tokens, so running streams
        # wait for joining prompts in short steps. Measured here (Q4_1, 16 streams of 128/128): TTFT
        # p50 ~590 -> ~320 ms, inter-token p99 ~230 -> ~160 ms, the same tokens/s.
        kwargs["max_prefill_tokens_while_decoding"] = SERVE_PREFILL_WHILE_DECODING
    # Serving default (offline does both at start): the KV cache's pages beyond its first 256 MiB
    # are faulted in, and the weights turned into huge pages, while the engine is idle, not
    # before it is ready (platform/pages.py)
    kwargs["kv_populate"] = "idle"
    kwargs["weight_hugepages"] = "idle"
    names = a.served_model_name or [None]
    config = EngineConfig(**kwargs, served_model_name=names[0])
    api_key = a.api_key or os.environ.get("CPUSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    parser = a.tool_call_parser if a.enable_auto_tool_choice else None
    cors = Cors(tuple(a.allowed_origins), tuple(a.allowed_methods), tuple(a.allowed_headers), a.allow_credentials)
    tls = Tls(a.ssl_keyfile, a.ssl_certfile, a.ssl_ca_certs, a.ssl_cert_reqs) if a.ssl_certfile else None
    return run(config, ServeOptions(
        a.host, a.port, names[0], api_key, a.max_waiting_requests, a.max_request_body_bytes,
        a.drain_timeout, parser, a.chat_template, cors, stats_interval=None if a.disable_log_stats else a.stats_interval,
        tls=tls, root_path=a.root_path, docs=not a.disable_fastapi_docs, log_level=a.uvicorn_log_level,
        access_log=not a.disable_uvicorn_access_log, prompt_tokens_details=a.enable_prompt_tokens_details,
        force_usage=a.enable_force_include_usage, tokens_as_ids=a.return_tokens_as_token_ids,
        log_requests=RequestLog(a.max_log_len, a.enable_log_outputs) if a.enable_log_requests else None,
        reasoning_parser=a.reasoning_parser, model_aliases=tuple(names[1:])))


def cmd_topology(a: argparse.Namespace) -> int:
    import json

    from cpuserve.platform.binding import BindingError, plan_from_env
    from cpuserve_topology import read_topology

    topo = read_topology(a.root) if a.root else read_topology()
    try:
        plan, plan_error = plan_from_env(topo, a.tensor_parallel_size), None
    except BindingError as e:
        plan, plan_error = None, str(e)
    membind, why = (False, "not probed (recorded tree)") if a.root else _probe_membind()
    if a.json:
        out = topo.to_dict()
        out["memory_binding"] = dict(effective=membind, detail=why)
        out["binding_plan"] = None if plan is None else dict(
            mode=plan.mode, reserved_cpus=list(plan.reserved_cpus), warnings=list(plan.warnings),
            ranks=[dict(rank=r.rank, cpus=None if r.cpus is None else list(r.cpus), threads=r.num_threads,
                        mem_node=r.mem_node) for r in plan.ranks])
        if plan_error:
            out["binding_error"] = plan_error
        print(json.dumps(out, indent=2))
        return 0 if plan_error is None else 2
    print(format_topology(topo, membind, why))
    print()
    print(f"binding plan for tensor_parallel_size={a.tensor_parallel_size} (VLLM_CPU_OMP_THREADS_BIND, "
          "VLLM_CPU_NUM_OF_RESERVED_CPU, CPU_VISIBLE_MEMORY_NODES):")
    if plan_error:
        print(f"  error: {plan_error}")
        return 2
    for line in plan.describe():
        print(f"  {line}")
    for w in plan.warnings:
        print(f"  warning: {w}")
    return 0


def cmd_selftest(a: argparse.Namespace) -> int:
    import json
    import platform

    from cpuserve import _C
    from cpuserve.model_executor.selftest import format_checks, run

    checks = run(a.isa or None)
    if a.json:
        print(json.dumps({"arch": platform.machine(), "isas": _C.available_isas(),
                          "checks": [dict(c.__dict__, ok=c.ok) for c in checks]}))
    else:
        print(f"{platform.machine()}: ISAs {', '.join(_C.available_isas())}")
        print(format_checks(checks))
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"cpuserve selftest: {len(failed)} of {len(checks)} checks FAILED", file=sys.stderr)
    return 1 if failed else 0


def _probe_membind() -> tuple[bool, str]:
    from cpuserve.platform.pinning import probe_membind

    return probe_membind()


def format_topology(topo, membind: bool, why: str) -> str:
    from cpuserve_topology import format_cpulist

    gib = 1 << 30
    lines = [f"arch {topo.arch}, {len(topo.packages)} socket(s), {len(topo.nodes)} NUMA node(s), "
             f"SMT {'on' if topo.smt else 'off'}",
             f"ISA: {' '.join(topo.isa) or '-'}",
             f"allowed CPUs {format_cpulist(topo.allowed_cpus)}, memory nodes {format_cpulist(topo.allowed_mems)}"
             + (f", CPU quota {topo.cpu_quota:g}" if topo.cpu_quota is not None else ""),
             f"memory binding: {'effective' if membind else 'NOT effective'} ({why})",
             "",
             f"{'node':>4}  {'CPUs':<20} {'allowed':<20} {'cores':>5} {'allowed':>7} {'memory':>10} {'free':>10}"]
    for n in topo.nodes:
        allowed = topo.allowed_in(n.id)
        lines.append(f"{n.id:>4}  {format_cpulist(n.cpus):<20} {format_cpulist(allowed) or '-':<20} "
                     f"{len(topo.physical_cores(n.cpus)):>5} {len(topo.physical_cores(allowed)):>7} "
                     f"{n.mem_total / gib:>7.1f} GiB {n.mem_free / gib:>6.1f} GiB"
                     + ("" if n.id in topo.allowed_mems else "  (memory not allowed)"))
    lines += [f"warning: {w}" for w in topo.warnings]
    return "\n".join(lines)


def cmd_quantize(a: argparse.Namespace) -> int:
    from pathlib import Path

    from cpuserve.entrypoints.quantize import quantize
    from cpuserve.loading.model_loader import resolve

    quantize(resolve(a.model), Path(a.out), a.method, a.group_size, a.act_order, a.act_asym)
    detail = ("asymmetric activations" if a.act_asym else "symmetric activations") if a.method == "w8a8" else \
        f"group {a.group_size}{', act-order' if a.act_order else ''}"
    print(f"wrote {a.method} ({detail}) to {a.out}")
    return 0


def bench_arguments_problem(a: argparse.Namespace) -> str | None:
    """What `bench` cannot measure with these options, or None."""
    if a.prompt_len < 1 or a.tokens < 2 or a.batch < 1:
        return (f"--prompt-len and --batch must be >= 1 and --tokens >= 2 (the first token ends the prefill), "
                f"got {a.prompt_len}, {a.batch} and {a.tokens}")
    return None


def cmd_bench(a: argparse.Namespace) -> int:
    import json

    from cpuserve.entrypoints import bench

    r = bench.run(tuple(a.dtype or bench.ENGINES), a.batch, a.tokens, a.prompt_len)
    print(json.dumps(r, indent=1) if a.json else bench.format_report(r, a.batch))
    return 0


def cmd_fetch(a: argparse.Namespace) -> int:
    from cpuserve.loading.fetch import fetch

    fetch(a.source, a.sha256, Path(a.dest))
    return 0


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(s)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: smollm2 / dir name); with several, requests may name "
                        "any and answers name the first")
    s.add_argument("--api-key", default=None, help="require this bearer token on /v1 (or CPUSERVE_API_KEY)")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="queue bound: further requests get 503 until the queue drains")
    s.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="larger request bodies get 413 before they are read (default 16 MiB)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": find the calls the model writes (needs --tool-call-parser)')
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="the format the model writes tool calls in (Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral "
                        "[TOOL_CALLS], Llama 3.2/4 pythonic [f(x=1)])")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="a thinking model's <think>...</think> as the chat answer's reasoning_content, apart from "
                        "its content (and from the tool calls the parser finds)")
    s.add_argument("--chat-template", default=None,
                   help="the chat template (a Jinja file, or the template itself) in place of the model's: "
                        "for a model without one, or to override it (vLLM's --chat-template)")
    s.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS: origins a browser page may call from, a JSON list (vLLM\'s; default ["*"])')
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: methods allowed (JSON list)")
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: request headers allowed")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt, token ids and sampling parameters (users' data: off by default)")
    s.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=False,
                   help="no request logging: the default (vLLM's older flag, accepted for its command lines)")
    s.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests, log each answer's text, token ids and finish reason too")
    s.add_argument("--max-log-len", type=int, default=None,
                   help="characters of a logged prompt or answer, and token ids, at most (default: all)")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held")
    s.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, asked for or not")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:{id}" unless a request says otherwise')
    s.add_argument("--ssl-keyfile", default=None, help="HTTPS: the server's private key (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="HTTPS: the server's certificate chain (PEM)")
    s.add_argument("--ssl-ca-certs", default=None, help="HTTPS: the CA certificates clients' certificates are "
                                                         "checked against (with --ssl-cert-reqs)")
    s.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 not asked for, 1 checked when given, 2 required (mutual TLS)")
    s.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves the API under "
                                                   "(e.g. /llm): requests with or without it are served")
    s.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log lines (default warning: cpuserve logs its start and each request)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no log line per request (method, path, status, duration, request id)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (prompt and generation tokens/s, running and waiting requests, KV "
                        "cache use, prefix cache hits; every VLLM_LOG_STATS_INTERVAL seconds, default 10, while busy)")
    s.add_argument("--drain-timeout", type=float, default=25.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish while new ones get 503 "
                        "(keep it below the pod's terminationGracePeriodSeconds)")
    s.set_defaults(func=cmd_serve, problem=serve_arguments_problem, command_parser=s)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate offline for a few prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few demo prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the model's chat template")
    g.add_argument("--json", action="store_true", help="print prompts, token ids and texts as JSON")
    g.set_defaults(func=cmd_generate)


def _add_inspect(sub) -> None:
    """The commands that look at this machine and the build: selftest, topology."""
    st = sub.add_parser("selftest", help="check every native kernel on every ISA of this CPU against torch")
    st.add_argument("--isa", action="append", help="only this ISA (repeatable); default: all available")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_selftest)
    t = sub.add_parser("topology", help="show NUMA nodes, cores, memory, ISA and the thread/memory binding plan")
    t.add_argument("--json", action="store_true", help="machine-readable output")
    t.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="plan the binding for this many ranks")
    t.add_argument("--root", default=None, help=argparse.SUPPRESS)  # a recorded /sys + /proc tree (tests)
    t.set_defaults(func=cmd_topology)


def _add_bench(sub) -> None:
    bn = sub.add_parser("bench", help="this machine's roofline (bandwidth, GEMM peaks) and where the default "
                                      "model's decode sits on it, with the profile of a decode step")
    bn.add_argument("--dtype", action="append", choices=["gguf", "w8a8", "float32", "bfloat16"],
                    help="repeatable (default: all): gguf = the default model's Q4_1 blocks, w8a8 = its weights "
                         "as an INT8 W8A8 checkpoint (made once into the cache), else widened")
    bn.add_argument("--batch", type=int, default=64, help="the large batch measured (default 64)")
    bn.add_argument("--tokens", type=int, default=32, help="decode steps measured per batch size")
    bn.add_argument("--prompt-len", type=int, default=128,
                    help="prompt tokens before those steps (default 128, the benchmarks' prompts): the contexts "
                         "decoded are prompt-len to prompt-len + tokens, and attention grows with them")
    bn.add_argument("--json", action="store_true", help="machine-readable output")
    bn.set_defaults(func=cmd_bench, problem=bench_arguments_problem, command_parser=bn)


def _add_model_tools(sub) -> None:
    """The commands that make model files: quantize, fetch."""
    qz = sub.add_parser("quantize", help="write an AWQ- or GPTQ-layout 4-bit checkpoint, or a compressed-tensors "
                                         "INT8 W8A8 one, of a model (round to nearest; see entrypoints/quantize.py)")
    qz.add_argument("out", help="output directory")
    qz.add_argument("--model", default=None, help="source model (default: the packaged SmolLM2)")
    qz.add_argument("--method", choices=["awq", "gptq", "w8a8"], default="awq")
    qz.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    qz.add_argument("--act-order", action="store_true", help="GPTQ desc_act: groups by decreasing column norm")
    qz.add_argument("--act-asym", action="store_true", help="W8A8: activations with a zero point per token")
    qz.set_defaults(func=cmd_quantize)
    f = sub.add_parser("fetch", help="download a model file (http(s):// or s3://) and verify its SHA-256")
    f.add_argument("source")
    f.add_argument("--sha256", required=True, help="the file's SHA-256 (hex): nothing unverified is kept")
    f.add_argument("--dest", required=True, help="where the verified file goes")
    f.set_defaults(func=cmd_fetch)


def cmd_run_batch(a: argparse.Namespace) -> int:
    import asyncio

    from cpuserve.config import EngineConfig
    from cpuserve.entrypoints.run_batch import run
    from cpuserve.entrypoints.serve import prepare_platform

    names = a.served_model_name or [None]
    config = EngineConfig(**engine_kwargs(a), served_model_name=names[0])
    prepare_platform(config)
    return asyncio.run(run(config, Path(a.input), Path(a.output), a.max_concurrency, tuple(names[1:])))


def _add_run_batch(sub) -> None:
    b = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, as vLLM's run_batch")
    add_engine_args(b)
    b.add_argument("-i", "--input", required=True, help="the batch file: one {custom_id, method, url, body} a line")
    b.add_argument("-o", "--output", required=True, help="the results, one line per request in the input's order")
    b.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) the requests' bodies use (default: smollm2 / dir name)")
    b.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at once (default 256)")
    b.set_defaults(func=cmd_run_batch, problem=run_batch_problem, command_parser=b)


def run_batch_problem(a: argparse.Namespace) -> str | None:
    if not Path(a.input).is_file():
        return f"--input {a.input}: no such file"
    if a.max_concurrency < 1:
        return f"--max-concurrency must be >= 1, got {a.max_concurrency}"
    return generation_config_problem(a.generation_config, a.override_generation_config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpuserve", description="LLM serving on CPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_generate, _add_run_batch, _add_inspect, _add_bench, _add_model_tools):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    problem = a.problem(a) if hasattr(a, "problem") else None
    if problem:  # as argparse refuses the command's options itself: its usage, the message, status 2
        a.command_parser.error(problem)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"cpuserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
